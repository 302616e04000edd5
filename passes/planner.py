"""planner: the mesh a plan unit is cut into, searched in one place, before the policy plans
the tensor axis.

The plan pass hands its graph and the ComputeConfig here. `tensor_plan` decides, in this
order, what the policy plans and with which config:

    a pipeline (plan_state.pipeline)   each stage on its pp.tp tensor ranks (stage_config)
    parallel.cp = C                    a cp axis of C; the policy plans plan_ngpus // C ranks
    parallel.cp = "auto" (autodist)    every C that divides plan_ngpus and the sequence is
                                       planned and priced; the fastest that fits (a 1 % tie:
                                       the leanest) wins (choose_context)
    parallel.ep = E < the tensor ranks an ep axis of E beside plan_ngpus // E tensor ranks
    parallel.ep = "auto" (autodist)    every E that splits the experts and tokens, likewise
                                       (choose_experts)

and returns the planned graph (its mesh axes in graph.axes), the config the tensor axis was
planned with (its plan_ngpus is the tensor ranks: the only count that config holds) and E.
The candidates and why one won are in plan_state.autodist["context_parallel"] /
["expert_parallel"]; a size asked for that the graph cannot use is reported by the cp and ep
passes (passes/dropped.py).

    before: plan_ngpus=4, parallel.cp="auto"        after: graph.axes={"cp": 2}, the tensor
                                                    axis planned on 2 ranks, autodist's row
                                                    per C in plan_state.autodist
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from nncompile.errors import ConfigError
from nncompile.experts import MOE_EXPERTS
from nncompile.ir import Graph
from nncompile.log import log
from nncompile.mesh import CP, EP

from .context_parallel import ZIGZAG, order_of, sequence_dims
from .pipeline_stages import stage_config


def tensor_plan(graph: Graph, config: Any, policy: Callable) -> tuple[Graph, Any, int | str]:
    """(the policy's planned graph, the config of its tensor axis, E): see the module
    docstring."""
    pp = graph.plan_state.pipeline
    if pp is not None:         # each stage runs on its pp.tp tensor-parallel ranks
        config = stage_config(config, pp.tp, pp.ranks)
    experts = config.expert_parallel
    if config.context_parallel == "auto":
        g = choose_context(graph, config, policy)
        return g, tensor_config(config, g.axes.get(CP, 1)), experts
    if experts == "auto":
        g, experts = choose_experts(graph, config, policy)
        return g, (tensor_config(config, experts, "ep") if EP in g.axes else config), experts
    c = config.context_parallel
    if c > 1:                  # the tensor axis: plan_ngpus // C ranks, the cp axis priced
        config = tensor_config(config, c)                             # by autodist
        graph = graph.clone()
        graph.axes = {CP: c, **graph.axes}
    e = config.expert_parallel
    if e not in (1, "auto") and e < config.plan_ngpus:     # an ep axis beside the tensor
        config = tensor_config(config, e, "ep")            # ranks (passes/expert_parallel.py)
        graph = graph.clone()
        graph.axes = {EP: e, **graph.axes}
    return policy(graph, config), config, experts


def tensor_config(config, c: int, axis: str = "cp"):
    """The ComputeConfig the policy plans the tensor axis with: plan_ngpus // C ranks, the
    data-parallel units as many as before (`axis`: the ParallelSpec field of the other axis,
    cp or ep, reset to 1)."""
    runtime = (config.runtime_ngpus or config.plan_ngpus) // c
    return dataclasses.replace(config, plan_ngpus=config.plan_ngpus // c,
                               runtime_ngpus=runtime,
                               parallel=dataclasses.replace(config.parallel, **{axis: 1}))


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
    for c in [d for d in range(1, config.plan_ngpus + 1) if config.plan_ngpus % d == 0]:
        pieces = 2 * c if zigzag and c > 1 else c
        if c > 1 and (not seqs or (type(seqs[0]) is int and seqs[0] % pieces)):
            rows.append({"cp": c, "fits": False, "why": "the sequence does not split"})
            continue
        g = graph.clone()
        if c > 1:
            g.axes = {CP: c, **g.axes}
        try:
            planned = policy(g, tensor_config(config, c))
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
    n = config.plan_ngpus
    layers = [op for op in graph.ops if op.target is MOE_EXPERTS]
    rows, planned, errors = [], {}, []
    for e in [d for d in range(1, n + 1) if n % d == 0]:
        if any(op.args[3].meta.shape[0] % e or op.args[0].meta.shape[0] % e for op in layers):
            rows.append({"ep": e, "fits": False, "why": "the experts or tokens do not split"})
            continue
        g = graph.clone()
        cfg = dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, ep=e))
        if 1 < e < n:
            cfg = tensor_config(cfg, e, "ep")
            g.axes = {EP: e, **g.axes}
        try:
            out = policy(g, cfg)
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
