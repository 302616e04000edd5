"""expert_parallel: place the program along the `ep` mesh axis, the batch split between
ranks whose mixture-of-experts layers dispatch to each other.

With `pas_config={"expert_parallel": E}` and E < plan_ngpus, each plan unit is E expert
ranks x plan_ngpus // E tensor ranks (the plan pass planned the tensor axis, with every MoE
layer whole on it). Every rank of the unit gets the unit's whole batch; along ep the program
splits it (dim 0 of each input) and every op runs on its rank's B/E rows. Parameters stay
whole along ep (their gradients partial sums, summed by the runtime: plan_state
.axis_partial_grad) except the experts: each MoE layer (moe_experts) holds E-th of its
experts per ep rank and sends each of its tokens' picks to the rank of their expert and back
(comm.dispatch_moe over EP_GROUP: nncompile/rules/experts.py).

Before (planned on the tensor axis):           After (along ep, E = 2):
    h = aten.embedding.default(w, ids)            h = ...   # f32[4, 16, 32] R @ep=S(0)
    y = nncompile_moe.moe_experts(x, i, p,         y = comm.dispatch_moe(..., group=EP_GROUP)
        w_in, w_out, 'silu', False)                   # w_in [4, 128, 32] R @ep=S(0)

How: the greedy walk of passes/context_parallel.py with the batch dims as the dims it keeps
split (passes/policies/greedy.py's Walk), never across a split of the tensor plan.
Precondition: plan. Idempotent: yes.
"""
from __future__ import annotations

import dataclasses

from nncompile.errors import ConfigError
from nncompile.experts import MOE_EXPERTS
from nncompile.ir import PARAM, Graph, Partial, Replicate, Shard, Stage
from nncompile.mesh import EP
from nncompile.rules import strategies
from nncompile.rules.experts import DISPATCH

from .context_parallel import _conflicts, place_along
from .policies.greedy import Walk, take_best


def no_experts_error(g: Graph, e: int) -> ConfigError:
    return ConfigError(f"pas_config['expert_parallel']={e}: {g.trace_info.model} has no "
                       "mixture-of-experts layer nncompile recognizes (an experts module of "
                       "Hugging Face's interface: docs/experts.md)")


def dispatch_of(op, e: int):
    """A MoE layer's dispatch strategy over e ranks (nncompile/rules/experts.py); a
    ConfigError naming the layer where its experts or tokens do not divide by e."""
    s = next((s for s in strategies(op, e) if s.local_target == DISPATCH), None)
    if s is None:
        x, _, _, w_in = op.args[:4]
        raise ConfigError(f"pas_config['expert_parallel']={e}: {op.module_path} has "
                          f"{w_in.meta.shape[0]} experts and {x.meta.shape[0]} tokens per "
                          f"unit; both must divide by {e}")
    return s


def _rank(walk: Walk, op, s) -> int | None:
    """Smaller is preferred; None: not allowed along ep."""
    if any(v.kind == PARAM and not isinstance(p, Replicate)
           for v, p in zip(op.tensor_inputs(), s.inputs)):
        return None                              # parameters stay whole along ep
    if s.local_target in (DISPATCH, "comm.local_moe", "comm.local_experts"):
        return None
    if walk.is_batch_split(op, s):
        return 0
    if s.is_split and all(isinstance(p, Partial) for p in s.outputs):
        return 0                                 # keep a partial sum (the loss)
    return 1 if not s.is_split else None


def batch_walk(scratch: Graph, e: int, plan_of) -> dict:
    """{op name: its strategy along ep} on `scratch` (placements reset, modified): every MoE
    layer dispatches, every other op keeps the batch split where a rule allows it."""
    walk = Walk(scratch)
    walk.placed |= {id(v) for v in scratch.params + scratch.buffers + scratch.consts}
    out = {}
    for op in scratch.ops:
        candidates = strategies(op, e)
        if op.target is MOE_EXPERTS:
            best = dispatch_of(op, e)
            walk.apply(op, best, candidates)
            out[op.name] = best
            continue
        plan = plan_of(op.name)
        out[op.name] = take_best(walk, op, candidates, lambda s, op=op, plan=plan: None
                                 if _conflicts(op, plan, s) else _rank(walk, op, s))
    return out


def choose_experts(graph: Graph, config, policy) -> tuple[Graph, int]:
    """expert_parallel="auto": autodist plans every E dividing the plan's ranks that divides
    every MoE layer's experts and tokens (E = 1: each layer's split free; E = plan_ngpus:
    dispatch on the plan's ranks; between: an ep axis of E beside plan_ngpus / E tensor
    ranks, each priced with its batch and experts split: cost_model.py) and keeps the
    fastest plan that fits (a tie within 1 %: the leanest); the candidates and why are in
    plan_state.autodist["expert_parallel"]. Returns (the planned graph, E)."""
    from nncompile.log import log
    from .autodist import PlanInfeasibleError
    from .context_parallel import TIE, pick_size, tensor_config
    n = config.plan_ngpus
    layers = [op for op in graph.ops if op.target is MOE_EXPERTS]
    rows, planned, errors = [], {}, []
    for e in [d for d in range(1, n + 1) if n % d == 0]:
        if any(op.args[3].meta.shape[0] % e or op.args[0].meta.shape[0] % e for op in layers):
            rows.append({"ep": e, "fits": False, "why": "the experts or tokens do not split"})
            continue
        g = graph.clone()
        cfg = dataclasses.replace(config, pas_config={**config.pas_config, "expert_parallel": e})
        if 1 < e < n:
            cfg = tensor_config(cfg, e, "expert_parallel")
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
            "expert_parallel='auto': no expert-parallel size fits; give one")
    e, tie = pick_size(rows, "ep")
    text = "; ".join(f"ep {r['ep']}: " + (f"{r['ms']:.1f} ms, {r['gb']:.2f} GB" if r["fits"]
                                          and r.get("ms") is not None else r.get("why", "fits"))
                     for r in rows)
    why = (f"autodist: expert_parallel={e} of {[r['ep'] for r in rows]}: "
           + ("the fastest plan that fits" if not tie else f"of the plans within {TIE:.0%} "
              "of the fastest modelled step the one with the most memory left") + f" ({text})")
    out = planned[e]
    out.plan_state.autodist = {**(out.plan_state.autodist or {}),
                               "expert_parallel": {"chosen": e, "candidates": rows, "why": why}}
    log(why)
    return out, e


class ExpertParallel:
    """The pass (see the module docstring)."""
    name = "expert_parallel"
    requires = (Stage.PLANNED,)
    produces = ()

    def __call__(self, graph: Graph) -> Graph:
        e = graph.axes.get(EP, 1)
        if e == 1 or any(EP in op.strategy.axis_inputs for op in graph.ops):
            return graph
        if not any(op.target is MOE_EXPERTS for op in graph.ops):
            raise no_experts_error(graph, e)
        g = graph.clone()
        scratch = graph.clone()
        for v in scratch.values():
            v.placement, v.axes = Replicate(), {}
        plan = {op.name: op.strategy for op in g.ops}
        place_along(g, EP, batch_walk(scratch, e, plan.get))
        for op in g.ops:
            if op.target is MOE_EXPERTS:            # the experts live split along ep
                for v in op.args[3:5]:
                    if v.kind == PARAM:
                        v.axes = {**v.axes, EP: Shard(0)}
        return g
