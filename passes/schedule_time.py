"""The time of one pipeline step, and the activations it keeps, read off its action list
(nncompile/ir/schedule.py).

Every schedule is priced the same way, from the order its pass wrote down, not from a formula
per schedule name: each pipeline rank runs its compute actions in order, and an action starts
when its rank is free and what it needs is done:

    F(s, i)    F(s-1, i), plus a send when stage s-1 is on another rank
    B/I(s, i)  F(s, i) and B/I(s+1, i) (plus a send) when s is not the last stage
    W(s, i)    I(s, i)
    (F;B)      an overlapped pair (DualPipeV): both parts' needs; it takes the sum of the two
               (compute does not overlap compute; what overlaps is the communication, which
               this model hides in the pair)

Durations per micro-batch of stage s: F = f[s], B = b[s], I = W = b[s] / 2. The step's time is
when the last rank ends; a rank's bubble is the time it is not computing.

    >>> step_time(compute_order("1f1b", 2, 1, 4), [1, 1], [2, 2]).time
    15.0          # (M + S - 1) (f + b) = 5 * 3
"""
from __future__ import annotations

from dataclasses import dataclass

from typing import Any

from nncompile.errors import ConfigError
from nncompile.ir.schedule import Action
from nncompile.pipeline_config import PipelineConfig


@dataclass
class StepTime:
    time: float                      # when the last pipeline rank ends
    busy: dict[int, float]           # each rank's compute time

    @property
    def bubble(self) -> float:
        """The share of the ranks' time spent waiting: 1 - mean busy / step time."""
        if not self.time:
            return 0.0
        return 1.0 - sum(self.busy.values()) / (len(self.busy) * self.time)


def step_time(order: dict[int, list[Action]], forward: list[float], backward: list[float],
              send: float = 0.0) -> StepTime:
    """Simulate one step of `order` (pipeline rank -> compute actions) with per-stage forward
    and backward times per micro-batch and `send` seconds per boundary between ranks."""
    placed = {a.stage: r for r, acts in order.items() for x in acts for a in x.steps()}
    last = max(placed)
    done: dict[tuple[int, str, int], float] = {}
    clock = {r: 0.0 for r in order}
    busy = {r: 0.0 for r in order}
    nxt = {r: 0 for r in order}

    def cost(a: Action) -> float:
        full = {"F": forward[a.stage], "B": backward[a.stage]}
        return full.get(a.kind, backward[a.stage] / 2)

    def ready(a: Action) -> float | None:
        """When `a`'s inputs are there, or None while they are not."""
        needs = []
        if a.kind == "F" and a.stage > 0:
            needs.append(((a.stage - 1, "F", a.microbatch), a.stage - 1))
        if a.kind in ("B", "I"):
            needs.append(((a.stage, "F", a.microbatch), a.stage))
            if a.stage < last:
                grad = (a.stage + 1, "B", a.microbatch)
                if grad not in done:
                    grad = (a.stage + 1, "I", a.microbatch)
                needs.append((grad, a.stage + 1))
        if a.kind == "W":
            needs.append(((a.stage, "I", a.microbatch), a.stage))
        at = 0.0
        for key, src in needs:
            if key not in done:
                return None
            hop = send if placed[src] != placed[a.stage] else 0.0
            at = max(at, done[key] + hop)
        return at

    remaining = sum(len(acts) for acts in order.values())
    while remaining:
        moved = False
        for r, acts in order.items():
            while nxt[r] < len(acts):
                act = acts[nxt[r]]
                starts = [ready(x) for x in act.steps()]
                if any(s is None for s in starts):
                    break
                t = max([clock[r], *starts])
                for x in act.steps():           # an overlapped pair: one after the other
                    t += cost(x)
                    done[x.stage, x.kind, x.microbatch] = t
                    busy[r] += cost(x)
                clock[r] = t
                nxt[r] += 1
                remaining -= 1
                moved = True
        if not moved:
            stuck = {r: str(order[r][nxt[r]]) for r in order if nxt[r] < len(order[r])}
            raise ConfigError(f"the pipeline order cannot run: every rank waits ({stuck})")
    return StepTime(max(clock.values()), busy)


def peak_inflight(order: dict[int, list[Action]], stage: int) -> int:
    """The most micro-batches `stage` holds activations of in `order`: a forward adds one,
    its full backward or its weight-gradient step frees it."""
    live = peak = 0
    for acts in order.values():
        for a in (x for act in acts for x in act.steps() if x.stage == stage):
            live += 1 if a.kind == "F" else -1 if a.kind in ("B", "W") else 0
            peak = max(peak, live)
    return peak


def stage_inflight(pp: Any, s: int) -> float:
    """Micro-batches whose activations stage `s` holds at the schedule's peak; `pp` is a
    PipelinePlan or anything with ranks, stages_per_rank, schedule and microbatches."""
    cfg = PipelineConfig(pp.ranks, pp.schedule, pp.microbatches, pp.stages_per_rank)
    m, ranks, v = pp.microbatches, pp.ranks, pp.stages_per_rank
    if pp.schedule == "gpipe":
        return float(m)
    if cfg.torch_schedule() == "ScheduleDualPipeV":
        from .pipeline_schedule import compute_order
        return float(peak_inflight(compute_order(pp.schedule, ranks, v, m), s))
    if cfg.torch_schedule() == "ScheduleZBVZeroBubble":
        return float(min(m, ranks - min(s, 2 * ranks - 1 - s)))
    p = s % ranks
    if v == 1:
        return float(min(m, ranks - p))
    # interleaved: torch's warm-up runs (V-1) S + 2 (S-1-p) forward chunks before the first
    # backward; spread over the rank's V stages
    return min(m * v, (v - 1) * ranks + 2 * (ranks - 1 - p) + 1) / v


def textbook_bubble(schedule: str, ranks: int, v: int, m: int) -> float:
    """The bubble share the schedule's paper gives for chunk times F = 1, B = 2, W = 1 (V
    chunks per rank, so a rank computes 3 V M): GPipe and 1F1B (S-1)(F+B) idle; interleaved
    (S-1)(F+B)/V; ZB-H1 and ZB-V (S-1)(F+B-2W); DualPipeV (S-1)(F&B+B-3W) with F&B = F+B.
    `step_time` gives the same for their action lists (tests/test_schedule_time.py)."""
    f, b, w = 1.0, 2.0, 1.0
    idle = {"gpipe": (ranks - 1) * (f + b) * v, "1f1b": (ranks - 1) * (f + b) * v,
            "interleaved_1f1b": (ranks - 1) * (f + b),
            "zero_bubble": (ranks - 1) * (f + b - 2 * w),
            "dualpipev": (ranks - 1) * ((f + b) + b - 3 * w)}[schedule]
    return idle / (3 * v * m + idle)
