"""planner: the mesh a plan unit is cut into, searched in one place, before the policy plans
the tensor axis.

The plan pass hands its graph and the user's ComputeConfig (graph.config) here. Counts keep
one meaning: config.plan_ngpus is a plan unit's ranks; the graph the policy gets carries the
mesh it plans on, its tensor ranks in graph.plan_ngpus and the other axes in graph.axes. The
config is never rewritten. `tensor_plan` decides, in this order:

    a pipeline (plan_state.pipeline)   each stage on its pp.tp ranks
    parallel.cp = C                    a cp axis of C; the policy plans the other ranks // C
    parallel.cp = "auto" (autodist)    every C that divides those ranks and the sequence is
                                       planned and priced; the fastest that fits (a 1 % tie:
                                       the leanest) wins (choose_context)
    parallel.ep = E < the tensor ranks an ep axis of E beside tensor ranks // E
    parallel.ep = "auto" (autodist)    every E that splits the experts and tokens, likewise
                                       (choose_experts)

and returns the planned graph (its mesh axes in graph.axes, its tensor ranks in
graph.plan_ngpus) and E, also in plan_state.experts. The candidates and why one won are in
plan_state.autodist["context_parallel"] / ["expert_parallel"]; a size asked for that the graph
cannot use is reported by the cp and ep passes (passes/dropped.py).

    before: config plan_ngpus=4, parallel.cp="auto"   after: graph.axes={"cp": 2},
                                                      graph.plan_ngpus=2, autodist's row per
                                                      C in plan_state.autodist
"""
from __future__ import annotations

from typing import Any, Callable

from nncompile.errors import ConfigError
from nncompile.experts import MOE_EXPERTS
from nncompile.ir import Graph
from nncompile.log import log
from nncompile.mesh import CP, EP

from .context_parallel import ZIGZAG, order_of, sequence_dims


def tensor_plan(graph: Graph, config: Any, policy: Callable) -> tuple[Graph, int | str]:
    """(the policy's planned graph, E): see the module docstring."""
    pp = graph.plan_state.pipeline
    base = graph.clone()
    base.plan_ngpus = pp.tp if pp is not None else config.plan_ngpus
    base.plan_state.tensor_ranks = base.plan_ngpus
    c = config.context_parallel
    if pp is not None and isinstance(c, int) and pp.tp % c:
        c = 1                   # a stage's ranks that cp does not divide: a cost estimate
    experts = config.expert_parallel
    if c == "auto":
        base.plan_state.experts = experts
        return choose_context(base, config, policy), experts
    if experts == "auto":
        return choose_experts(base, config, policy)
    if c > 1:                   # the tensor axis: the ranks // C, the cp axis priced by autodist
        base = with_axis(base, CP, c)
    if experts != 1 and experts < base.plan_ngpus:     # an ep axis beside the tensor ranks
        base = with_axis(base, EP, experts)            # (passes/expert_parallel.py)
    base.plan_state.experts = experts
    return policy(base, config), experts


def with_axis(graph: Graph, axis: str, size: int) -> Graph:
    """A copy of `graph` whose mesh has an `axis` of `size` beside (outside) its tensor axis,
    which keeps plan_ngpus // size ranks."""
    g = graph.clone()
    g.plan_ngpus = g.plan_state.tensor_ranks = graph.plan_ngpus // size
    g.axes = {axis: size, **g.axes}
    return g


def choose_context(graph: Graph, config, policy) -> Graph:
    """context_parallel="auto": autodist plans the tensor axis for every C dividing
    plan_ngpus whose pieces divide the sequence, each priced with its sequence split (compute
    and activations / C, keys and values gathered along cp: cost_model.py), and keeps the
    fastest plan that fits; the candidates and why are in plan_state.autodist
    ["context_parallel"]. The graph returned carries axes["cp"] = C (none for C = 1)."""
    from .autodist import PlanInfeasibleError
    zigzag = order_of(config.parallel.cp_attention, config.parallel.cp_order) == ZIGZAG
    seqs = [v.meta.shape[1] for v in graph.inputs if id(v) in sequence_dims(graph)]
    rows, planned_at, errors = [], {}, []
    n = graph.plan_ngpus
    for c in [d for d in range(1, n + 1) if n % d == 0]:
        pieces = 2 * c if zigzag and c > 1 else c
        if c > 1 and (not seqs or (type(seqs[0]) is int and seqs[0] % pieces)):
            rows.append({"cp": c, "fits": False, "why": "the sequence does not split"})
            continue
        g = with_axis(graph, CP, c) if c > 1 else graph.clone()
        try:
            planned = policy(g, config)
        except PlanInfeasibleError as e:
            rows.append({"cp": c, "fits": False, "why": str(e).splitlines()[0][:200]})
            errors.append(e)
            continue
        data = planned.plan_state.autodist or {}
        ms, gb = data.get("objective_ms"), data.get("memory_gb")
        rows.append({"cp": c, "fits": True, "ms": ms, "gb": gb})
        planned_at[c] = planned
    if not planned_at:
        raise errors[-1] if errors else ConfigError(
            "parallel.cp='auto': no context-parallel size fits; give one")
    c, tie = pick_size(rows)
    planned = planned_at[c]
    why = (f"autodist: parallel.cp={c} of {[r['cp'] for r in rows]}: "
           + ("the fastest plan that fits" if not tie else
              f"of the plans within {TIE:.0%} of the fastest modelled step (a tie at the cost "
              f"model's resolution) the one with the most memory left")
           + f" ({'; '.join(_row_text(r) for r in rows)})")
    planned.plan_state.autodist = {**(planned.plan_state.autodist or {}),
                                   "context_parallel": {"chosen": c, "candidates": rows,
                                                        "why": why}}
    log(why)
    return planned


TIE = 0.01        # modelled step times this close are a tie (the calibrated model's median
                  # error is 1.4-10 %: docs/autodist.md)


def pick_size(rows: list[dict], key: str = "cp") -> tuple[int, bool]:
    """(the size under `key`, whether a tie decided): the fastest plan that fits; among plans
    within TIE of it, the one needing the least memory (the most headroom for what the model
    does not see)."""
    fits = [r for r in rows if r["fits"]]
    timed = [r for r in fits if r.get("ms") is not None]
    if not timed:
        return fits[0][key], False
    fastest = min(timed, key=lambda r: r["ms"])
    close = [r for r in timed if r["ms"] <= fastest["ms"] * (1 + TIE) and r.get("gb") is not None]
    if not close:
        return fastest[key], False
    leanest = min(close, key=lambda r: (r["gb"], r["ms"]))
    return leanest[key], leanest is not fastest


def _row_text(r: dict) -> str:
    if not r["fits"]:
        return f"cp {r['cp']}: {r['why']}"
    return f"cp {r['cp']}: {r['ms']:.1f} ms, {r['gb']:.1f} GB" if r.get("ms") is not None \
        else f"cp {r['cp']}: fits"


def choose_experts(graph: Graph, config, policy) -> tuple[Graph, int]:
    """expert_parallel="auto": autodist plans every E dividing the plan's ranks that divides
    every MoE layer's experts and tokens (E = 1: each layer's split free; E = plan_ngpus:
    dispatch on the plan's ranks; between: an ep axis of E beside plan_ngpus / E tensor
    ranks, each priced with its batch and experts split: cost_model.py) and keeps the
    fastest plan that fits (a tie within 1 %: the leanest); the candidates and why are in
    plan_state.autodist["expert_parallel"]. Returns (the planned graph, E)."""
    from .autodist import PlanInfeasibleError
    n = graph.plan_ngpus
    layers = [op for op in graph.ops if op.target is MOE_EXPERTS]
    rows, planned, errors = [], {}, []
    for e in [d for d in range(1, n + 1) if n % d == 0]:
        if any(op.args[3].meta.shape[0] % e or op.args[0].meta.shape[0] % e for op in layers):
            rows.append({"ep": e, "fits": False, "why": "the experts or tokens do not split"})
            continue
        g = with_axis(graph, EP, e) if 1 < e < n else graph.clone()
        g.plan_state.experts = e
        try:
            out = policy(g, config)
        except PlanInfeasibleError as err:
            rows.append({"ep": e, "fits": False, "why": str(err).splitlines()[0][:200]})
            errors.append(err)
            continue
        data = out.plan_state.autodist or {}
        rows.append({"ep": e, "fits": True, "ms": data.get("objective_ms"),
                     "gb": data.get("memory_gb")})
        planned[e] = out
    if not planned:
        raise errors[-1] if errors else ConfigError(
            "parallel.ep='auto': no expert-parallel size fits; give one")
    e, tie = pick_size(rows, "ep")
    text = "; ".join(f"ep {r['ep']}: " + (f"{r['ms']:.1f} ms, {r['gb']:.2f} GB" if r["fits"]
                                          and r.get("ms") is not None else r.get("why", "fits"))
                     for r in rows)
    why = (f"autodist: parallel.ep={e} of {[r['ep'] for r in rows]}: "
           + ("the fastest plan that fits" if not tie else f"of the plans within {TIE:.0%} "
              "of the fastest modelled step the one with the most memory left") + f" ({text})")
    out = planned[e]
    out.plan_state.autodist = {**(out.plan_state.autodist or {}),
                               "expert_parallel": {"chosen": e, "candidates": rows, "why": why}}
    log(why)
    return out, e
