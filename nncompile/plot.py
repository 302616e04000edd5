"""The op graph of plan.json as a picture: one node per op, coloured by its output's placement,
collectives drawn as diamonds, user inputs as squares, laid out left to right in topological
layers. Drawn with matplotlib's Agg canvas (no pyplot, no display needed).
"""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from .errors import ConfigError
from .ir.placement import Placement, Replicate, Shard, parse_placement

FIXED_COLOURS = {"R": "#4c72b0", "P": "#c44e52", "-": "#bbbbbb"}
SHARD_COLOURS = ["#55a868", "#dd8452", "#8172b3", "#937860", "#da8bc3", "#8c8c8c", "#ccb974",
                 "#64b5cd"]
MARKERS = {"op": ("o", "op"), "collective": ("D", "collective (comm.*)"),
           "input": ("s", "user input")}
MAX_PIXELS = 40e6


def _parsed(placement: str) -> Placement | None:
    """The placement a plan.json entry names (None for '-', no tensor output)."""
    try:
        return parse_placement(placement)
    except ValueError:
        return None


def placement_colour(placement: str) -> str:
    if placement in FIXED_COLOURS:
        return FIXED_COLOURS[placement]
    p = _parsed(placement)
    if isinstance(p, Shard):
        return SHARD_COLOURS[p.dim % len(SHARD_COLOURS)]
    return "#222222"


def _describe(placement: str) -> str:
    p = _parsed(placement)
    if isinstance(p, Shard):
        return f"{placement} split dim {p.dim}"
    return {"R": "R replicated", "P": "P partial sum", "-": "no tensor output"}.get(placement,
                                                                                   placement)


def _split(entry: str) -> tuple[str, str]:
    """'value: placement' -> (value, placement)."""
    name, _, placement = entry.rpartition(": ")
    return (name, placement) if name else (entry, "-")


def _short(target: str) -> str:
    """'aten.linear.default' -> 'linear', 'comm.all_gather' -> 'all_gather'."""
    parts = target.split(".")
    name = parts[1] if parts[0] == "aten" and len(parts) > 1 else parts[-1]
    return name if len(name) <= 14 else name[:13] + "…"


def op_graph(plan: dict[str, Any], input_names: set[str]):
    """networkx DiGraph: an edge from the op producing a value to each op reading it; user
    inputs are source nodes. Parameters, buffers and constants are left out."""
    import networkx as nx
    g = nx.DiGraph()
    producer = {}
    for op in plan["ops"]:
        outs = [_split(o) for o in op["outputs"]]
        g.add_node(op["name"], placement=outs[0][1] if outs else "-", label=_short(op["op"]),
                   kind="collective" if op["op"].startswith("comm.") else "op")
        for value, _ in outs:
            producer[value] = op["name"]
    for op in plan["ops"]:
        for entry in op["inputs"]:
            value, placement = _split(entry)
            src = producer.get(value)
            if src is None and value in input_names:
                g.add_node(value, placement=placement, label=value, kind="input")
                src = value
            if src is not None and src != op["name"]:
                g.add_edge(src, op["name"])
    return g


def _layers(g) -> list[list[str]]:
    """Topological layers, with every op other than a user input moved as late as its readers
    allow (so a side branch sits next to where it is used); sets each node's 'layer'."""
    import networkx as nx
    for depth, nodes in enumerate(nx.topological_generations(g)):
        for n in nodes:
            g.nodes[n]["layer"] = depth
    for n in reversed(list(nx.topological_sort(g))):
        readers = [g.nodes[s]["layer"] for s in g.successors(n)]
        if readers and g.nodes[n]["kind"] != "input":
            g.nodes[n]["layer"] = max(g.nodes[n]["layer"], min(readers) - 1)
    layers: dict[int, list[str]] = {}
    for n, d in g.nodes(data=True):
        layers.setdefault(d["layer"], []).append(n)
    return [layers[k] for k in sorted(layers)]


def _positions(g, layers: list[list[str]]) -> dict[str, tuple[float, float]]:
    """x: the layer; y: within a layer, nodes ordered by where their inputs are (fewer
    crossing edges), centred on 0."""
    pos: dict[str, tuple[float, float]] = {}
    for x, nodes in enumerate(layers):
        def key(n):
            ys = [pos[p][1] for p in g.predecessors(n) if p in pos]
            return sum(ys) / len(ys) if ys else 0.0
        ordered = sorted(nodes, key=key, reverse=True)
        for i, n in enumerate(ordered):
            pos[n] = (float(x), (len(ordered) - 1) / 2 - i)
    return pos


def plot_plan(plan: dict[str, Any], manifest: dict[str, Any], output: Path) -> Path:
    """Draw the plan's op graph into `output`, written under a temporary name then renamed."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    g = op_graph(plan, {i["name"] for i in manifest.get("inputs", [])})
    if not g.number_of_nodes():
        raise ConfigError("plan.json has no ops to draw")
    layers = _layers(g)
    pos = _positions(g, layers)
    widest = max(len(nodes) for nodes in layers)
    width = min(max(8.0, 1.0 + 0.75 * len(layers)), 300.0)
    height = min(max(5.0, 1.5 + 0.55 * widest), 150.0)
    dpi = max(20, min(100, int(math.sqrt(MAX_PIXELS / (width * height)))))

    fig = Figure(figsize=(width, height), dpi=dpi)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.set_axis_off()
    for u, v in g.edges:
        ax.annotate("", xy=pos[v], xytext=pos[u], zorder=1,
                    arrowprops=dict(arrowstyle="-|>", color="#9a9a9a", lw=0.6, shrinkA=7,
                                    shrinkB=7, mutation_scale=8,
                                    connectionstyle="arc3,rad=0.06"))
    placements = sorted({d["placement"] for _, d in g.nodes(data=True)},
                        key=lambda p: (not isinstance(_parsed(p), Replicate),
                                       not isinstance(_parsed(p), Shard), p))
    for kind, (marker, _) in MARKERS.items():
        for placement in placements:
            nodes = [n for n, d in g.nodes(data=True)
                     if d["kind"] == kind and d["placement"] == placement]
            if not nodes:
                continue
            collective = kind == "collective"
            ax.scatter([pos[n][0] for n in nodes], [pos[n][1] for n in nodes], zorder=3,
                       s=170 if collective else 140, marker=marker,
                       c=placement_colour(placement), edgecolors="black" if collective
                       else "white", linewidths=1.4 if collective else 0.8)
    for n, d in g.nodes(data=True):
        ax.annotate(d["label"], pos[n], xytext=(0, -11), textcoords="offset points",
                    ha="center", va="top", fontsize=6, zorder=4)
    handles = [Line2D([], [], ls="", marker="o", markersize=9, markerfacecolor=
                      placement_colour(p), markeredgecolor="white", label=_describe(p))
               for p in placements]
    handles += [Line2D([], [], ls="", marker=marker, markersize=8, markerfacecolor="white",
                       markeredgecolor="black", label=label)
                for kind, (marker, label) in MARKERS.items()
                if any(d["kind"] == kind for _, d in g.nodes(data=True))]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8,
              title="output placement / node", title_fontsize=8, frameon=False)
    n_comm = sum(1 for _, d in g.nodes(data=True) if d["kind"] == "collective")
    cfg = manifest.get("config", {})
    ax.set_title(f"{manifest.get('model', '?')}: policy {manifest.get('policy', '?')}, "
                 f"plan_ngpus {plan.get('plan_ngpus', '?')}, runtime_ngpus "
                 f"{cfg.get('runtime_ngpus', '?')} ({len(plan['ops'])} ops, {n_comm} comm ops)",
                 fontsize=11)

    return save_figure(fig, output, dpi=dpi)


def save_figure(fig, output: Path, dpi=None) -> Path:
    """Write a matplotlib figure in the format its suffix names, atomically (temp name, then
    rename); a suffix matplotlib cannot write is a ConfigError naming the ones it can."""
    fmt = output.suffix.lstrip(".").lower() or "png"
    supported = fig.canvas.get_supported_filetypes()
    if fmt not in supported:
        raise ConfigError(f"cannot write {output}: .{fmt} is not an image format matplotlib "
                          f"writes; use one of {', '.join('.' + f for f in sorted(supported))}")
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(f".{output.name}.tmp-{os.getpid()}")
    try:
        fig.savefig(tmp, format=fmt, bbox_inches="tight", **({"dpi": dpi} if dpi else {}))
        os.replace(tmp, output)
    finally:
        tmp.unlink(missing_ok=True)
    return output
