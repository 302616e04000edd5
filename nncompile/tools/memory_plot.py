"""A memory profile as a picture: one panel per rank, bytes per category stacked over the run,
the peak marked, steps shaded alternately, offload's host<->device copies as orange marks
along the bottom and the predicted total as a dashed line. Drawn with
matplotlib's Agg canvas (no pyplot, no display needed)."""
from __future__ import annotations

import bisect
from pathlib import Path

from ..errors import ConfigError
from .memory import CATEGORIES, MemoryProfile, RankMemory
from .plot import save_figure

COLOURS = {"parameters": "#2e7d32", "gradients": "#1f5fbf", "optimizer_state": "#d4a017",
           "activations": "#c62828", "communication_buffers": "#7b3fa0", "other": "#9e9e9e"}
UNITS = (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10), ("B", 1))
AXES = {"events": "memory changes in order (waits take no room)",
        "time": "ms since the first step began"}


def _unit(largest: float) -> tuple[str, float]:
    return next(((name, size) for name, size in UNITS if largest >= size), UNITS[-1])


def _spans(m: RankMemory, x: str, spans) -> list[tuple[float, float]]:
    """[start, end] ms spans (steps, copies) on the x axis."""
    if x == "time":
        return [(a, b) for a, b, *_ in spans]
    events = m.events or list(range(len(m.times_ms)))

    def at(ms: float, side) -> float:
        i = min(side(m.times_ms, ms), len(events) - 1)
        return float(events[max(i, 0)])
    return [(at(a, bisect.bisect_left), at(b, bisect.bisect_right) - 0.5) for a, b, *_ in spans]


def _xs(m: RankMemory, x: str) -> tuple[list[float], float, list[tuple[float, float]]]:
    """The x of each point, of the peak and of each step's [start, end]."""
    steps = _spans(m, x, m.steps_ms)
    if x == "time":
        return m.times_ms, m.peak_ms, steps
    events = m.events or list(range(len(m.times_ms)))
    return [float(e) for e in events], float(m.peak_event), steps


def plot_profile(prof: MemoryProfile, output: Path, x: str = "events") -> Path:
    """Draw `prof` into `output` (.png, .svg, .pdf), written under a temporary name then
    renamed. x: "events" (every memory change one step along) or "time" (ms)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if x not in AXES:
        raise ConfigError(f"x={x!r}: choose one of {', '.join(AXES)}")
    ranks = sorted(prof.ranks, key=lambda m: m.rank)
    if not ranks:
        raise ConfigError("the memory profile holds no rank to draw")
    predicted = (prof.predicted or {}).get("per_rank_bytes", {}).get("total")
    unit, scale = _unit(max([m.peak_bytes for m in ranks] + [predicted or 0, 1]))
    fig = Figure(figsize=(11, 1.0 + 3.0 * len(ranks)), dpi=100)
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(ranks), 1, squeeze=False)[:, 0]
    for ax, m in zip(axes, ranks):
        xs, peak_x, steps = _xs(m, x)
        for i, (a, b) in enumerate(steps):
            if i % 2 == 0:
                ax.axvspan(a, b, color="#000000", alpha=0.05, lw=0)
        for i, (a, b) in enumerate(_spans(m, x, m.copies_ms)):    # offload's copies
            ax.axvspan(a, max(b, a + 0.5), ymin=0, ymax=0.03, color="#ef6c00", lw=0,
                       label=f"host<->device copies ({len(m.copies_ms)})" if i == 0 else None)
        labels = [f"{c} (max {m.max_bytes[c] / scale:.2f} {unit})" for c in CATEGORIES]
        ax.stackplot(xs, [[v / scale for v in m.bytes[c]] for c in CATEGORIES], labels=labels,
                     colors=[COLOURS[c] for c in CATEGORIES], step="post", alpha=0.85, lw=0)
        peak = m.peak_bytes / scale
        ax.axvline(peak_x, color="black", ls=":", lw=1)
        ax.plot([peak_x], [peak], marker="v", color="black", ms=7, ls="")
        ax.annotate(f"peak {peak:.2f} {unit} ({m.peak_ms:.0f} ms)", (peak_x, peak),
                    xytext=(6, 4), textcoords="offset points", fontsize=8)
        if predicted:
            ax.axhline(predicted / scale, color="black", ls="--", lw=1,
                       label=f"predicted total {predicted / scale:.2f} {unit}")
        ax.set_ylim(0, max(peak, (predicted or 0) / scale) * 1.15 or 1)
        ax.set_ylabel(unit)
        ax.set_xlabel(f"{AXES[x]}; {len(steps)} step(s), shaded alternately", fontsize=8)
        ax.set_title(f"rank {m.rank} ({m.device})", fontsize=10, loc="left")
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7, frameon=False)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"memory per rank ({prof.world_size} rank(s), plan_ngpus {prof.plan_ngpus})",
                 fontsize=11)

    return save_figure(fig, output)
