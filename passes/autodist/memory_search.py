"""The memory options autodist picks ("auto"), jointly with the placement ILP.

Candidates are the combinations of the values left to autodist (explicit ones are kept):

    use_zero="auto"            stage 0, and 1, 2, 3 when the ZeRO group Z = dp_size x C //
                               zero_ngroups has more than one rank (C: the context ranks);
                               only 3 with offload_params
    offload_optimizer="auto"   False, True
    recompute_modules="auto"   none, every block of the model's repeated ModuleLists (`h.*`)

Each candidate is the placement problem with its memory and time terms (memory_model.py). Its
leanest plan is known in closed form, so candidates that cannot fit are dropped unsolved. The
rest are searched by branch and bound: the first is solved without the memory limit (its
fastest plan, a bound for all: candidates differ only in per-option costs), each other gets
the lower bound `that time + sum over choices of min over options of its cost difference`,
and candidates are solved under the limit in order of bound until no bound beats the fastest
plan found. Ties go to the earlier candidate (lower stage, no offload, no recompute).
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Callable

from nncompile.ir import Graph, MemoryChoice

from .ilp import GB, PlanInfeasibleError, Solution, memory_of, objective_of, solve, solve_within
from .memory_model import MemoryModel, leanest_picks
from .problem import Problem, _layer_of
from .report import choice_label

AUTO = "auto"
REL = 1e-9          # relative tolerance when comparing step times and bytes


def auto_fields(config) -> list[str]:
    """The memory options `config` leaves to autodist."""
    out = []
    if config.zero_stage == AUTO:
        out.append("use_zero")
    if config.offload_optimizer == AUTO:
        out.append("offload_optimizer")
    if config.parallel.recompute_modules == AUTO:
        out.append("recompute_modules")
    return out


def repeated_blocks(graph: Graph) -> tuple[str, ...]:
    """Path globs naming every block of the model's repeated ModuleLists, e.g. ('h.*',)."""
    seen: dict[str, set[int]] = {}
    for op in graph.ops:
        where = _layer_of(op)
        if where is not None:
            seen.setdefault(where[0], set()).add(where[1])
    return tuple(f"{prefix}.*" for prefix, idx in seen.items() if len(idx) > 1)


def memory_options(graph: Graph, config) -> list[MemoryChoice]:
    """The candidates, fastest-looking first (the order that breaks ties)."""
    training = not config.inference_only
    z = config.zero_stage
    group = config.dp_size * graph.axes.get("cp", 1) // config.zero_ngroups
    if z != AUTO:
        stages = [z]
    elif not training:
        stages = [0]
    elif config.offload_params:
        stages = [3]
    else:
        stages = [0, 1, 2, 3] if group > 1 else [0]
    offloads = [False, True] if config.offload_optimizer == AUTO else \
        [bool(config.offload_optimizer)]
    rc = config.parallel.recompute_modules
    if rc == AUTO:
        blocks = repeated_blocks(graph) if training else ()
        recomputes = [()] + ([blocks] if blocks else [])
    else:
        recomputes = [tuple(rc or ())]
    return [MemoryChoice(s, o, bool(config.offload_params) and s == 3, r)
            for s in stages for o in offloads for r in recomputes]


def choice_json(c: MemoryChoice) -> dict:
    return {"zero": c.zero, "offload_optimizer": c.offload_optimizer,
            "offload_params": c.offload_params, "recompute": list(c.recompute)}


def label(c: MemoryChoice) -> str:
    """e.g. 'ZeRO-3, optimizer offload, recompute h.*'."""
    return choice_label(choice_json(c))


@dataclass
class Candidate:
    choice: MemoryChoice
    order: int
    graph: Graph                        # the graph `prob` places (one per recompute option)
    prob: Problem
    lean_picks: list[int]
    lean: float                         # bytes per rank of its leanest plan
    lean_time: float                    # seconds per step of that plan
    bound: float = 0.0                  # lower bound on its step time within the limit
    sol: Solution | None = None
    status: str = ""                    # chosen | fits | too large | slower (bound)


@dataclass
class MemorySearch:
    chosen: Candidate
    candidates: list[Candidate]
    memory: MemoryModel
    solves: int = 0
    seconds: float = 0.0                # solver time, all solves
    auto: list[str] = field(default_factory=list)


def _cost(prob: Problem, c: int, k: int) -> float:
    ch = prob.choices[c]
    return ch.compute[k] + ch.comm[k]


def _aligned(a: Problem, b: Problem) -> bool:
    return len(a.choices) == len(b.choices) and len(a.pairs) == len(b.pairs) \
        and len(a.syncs) == len(b.syncs) \
        and all(x.name == y.name and len(x.options) == len(y.options)
                for x, y in zip(a.choices, b.choices))


def lower_bound(prob: Problem, ref: Problem | None, ref_time: float) -> float:
    """A lower bound on `prob`'s step time: from the reference's fastest plan (shared edges
    and syncs), and the sum of every choice's cheapest option."""
    own = sum(min(_cost(prob, c, k) for k in range(len(ch.options)))
              for c, ch in enumerate(prob.choices))
    if ref is None or not _aligned(prob, ref):
        return own
    delta = sum(min(_cost(prob, c, k) - _cost(ref, c, k) for k in range(len(ch.options)))
                for c, ch in enumerate(prob.choices))
    return max(own, ref_time + delta)


def _better(t: float, order: int, best: Candidate | None) -> bool:
    if best is None:
        return True
    b = best.sol.objective
    return t < b * (1 - REL) or (t <= b * (1 + REL) and order < best.order)


def search(graph: Graph, config, build: Callable[[list[str]], tuple[Graph, Problem]],
           mem_limit_gb: float | None, time_limit: float) -> MemorySearch:
    """The fastest (candidate, plan) within `mem_limit_gb`; PlanInfeasibleError when none fits.
    `build(recompute_patterns)` returns the graph to place and its problem."""
    built: dict[tuple, tuple[Graph, Problem]] = {}
    cands: list[Candidate] = []
    mm = None
    for i, choice in enumerate(memory_options(graph, config)):
        if choice.recompute not in built:
            built[choice.recompute] = build(list(choice.recompute))
        g, base = built[choice.recompute]
        mm = mm or MemoryModel.of(base.model, config, g)
        prob = mm.derive(g, base, choice)
        picks = leanest_picks(prob)
        cands.append(Candidate(choice, i, g, prob, picks, memory_of(prob, picks),
                               objective_of(prob, picks)))
    out = MemorySearch(cands[0], cands, mm, auto=auto_fields(config))
    if len(cands) == 1:                 # nothing to choose: the plain ILP (and its errors)
        c = cands[0]
        c.sol, c.status = solve(c.prob, mem_limit_gb, time_limit), "chosen"
        out.solves, out.seconds = 1, c.sol.seconds
        return out
    limit = float("inf") if mem_limit_gb is None else mem_limit_gb * GB
    possible = []
    for c in cands:
        if c.lean <= limit:
            possible.append(c)
        else:
            c.status = "too large"
    if not possible:
        raise PlanInfeasibleError(nothing_fits(out, mem_limit_gb, config))
    ref = possible[0]
    free = solve_within(ref.prob, None, time_limit)
    out.solves, out.seconds = 1, free.seconds
    best = None
    if free.memory <= limit:            # its fastest plan fits: its answer within the limit
        ref.sol, best = free, ref
    for c in possible:
        c.bound = free.objective if c is ref else lower_bound(c.prob, ref.prob, free.objective)
    for c in sorted(possible, key=lambda c: (c.bound, c.order)):
        if c.sol is not None:
            continue
        if not _better(c.bound, c.order, best):
            c.status = "slower (bound)"
            continue
        start = time.perf_counter()
        c.sol = solve_within(c.prob, mem_limit_gb, time_limit)
        out.solves += 1
        out.seconds += c.sol.seconds if c.sol else time.perf_counter() - start
        if c.sol is None:
            c.status = "too large"
        elif _better(c.sol.objective, c.order, best):
            best = c
    if best is None:
        raise PlanInfeasibleError(nothing_fits(out, mem_limit_gb, config))
    for c in possible:
        if c.sol is not None and not c.status:
            c.status = "fits"
    best.status = "chosen"
    best.sol = dataclasses.replace(best.sol, seconds=out.seconds)
    out.chosen = best
    return out


def _size(b: float) -> str:
    return f"{b / GB:.3g} GB" if b >= GB / 10 else f"{b / 1e6:.3g} MB"


def nothing_fits(s: MemorySearch, mem_limit_gb: float | None, config) -> str:
    """The error when no candidate fits: the leanest one, its bytes, what to change."""
    lean = min(s.candidates, key=lambda c: (c.lean, c.order))
    table = s.memory.breakdown(lean.prob, lean.choice, lean.lean_picks)["per_rank_bytes"]
    parts = ", ".join(f"{k.replace('_', ' ')} {_size(v)}" for k, v in table.items()
                      if k != "total")
    c = lean.choice
    fixed = []
    if "use_zero" not in s.auto and c.zero < 3 and s.memory.zero_group > 1:
        fixed.append("use_zero='auto'")
    if "offload_optimizer" not in s.auto and not c.offload_optimizer:
        fixed.append("offload_optimizer='auto'")
    if "recompute_modules" not in s.auto and not c.recompute:
        fixed.append("parallel.recompute_modules='auto'")
    if c.zero == 3 and not c.offload_params:
        fixed.append("offload_params=True")
    more = f", or let autodist choose more: {', '.join(fixed)}" if fixed else ""
    return (f"autodist: no plan fits mem_limit_gb={mem_limit_gb:g} GB per rank with any of the "
            f"{len(s.candidates)} memory options considered; the leanest plan needs "
            f"{lean.lean / GB:.4g} GB per rank with {label(c)} (use_zero={c.zero}, "
            f"offload_optimizer={c.offload_optimizer}, offload_params={c.offload_params}, "
            f"recompute_modules={list(c.recompute)}): {parts}. Raise "
            "parallel.mem_limit_gb, add data-parallel ranks (runtime_ngpus: ZeRO shards "
            f"the training state over them), increase plan_ngpus or shrink the batch{more}.")


def memory_report(s: MemorySearch, mem_limit_gb: float | None) -> dict:
    """plan.json's autodist["memory"]: the choice, its bytes per rank, every candidate."""
    best = s.chosen
    rows = []
    for c in s.candidates:
        if c.sol is not None:
            total = s.memory.breakdown(c.prob, c.choice, c.sol.picks)["per_rank_bytes"]["total"]
            t, fits = c.sol.objective, True
        else:
            total = s.memory.breakdown(c.prob, c.choice, c.lean_picks)["per_rank_bytes"]["total"]
            t, fits = (c.bound, True) if c.status == "slower (bound)" else (c.lean_time, False)
        rows.append({"choice": choice_json(c.choice), "total": total, "time_ms": t * 1e3,
                     "fits": fits, "status": c.status, "solved": c.sol is not None})
    return {"choice": choice_json(best.choice),
            **s.memory.breakdown(best.prob, best.choice, best.sol.picks),
            "mem_limit_bytes": None if mem_limit_gb is None else int(round(mem_limit_gb * GB)),
            "zero_group": s.memory.zero_group, "auto": list(s.auto),
            "ilp_solves": s.solves, "candidates": rows}
