"""expert_parallel: place the program along the `ep` mesh axis, the batch split between
ranks whose mixture-of-experts layers dispatch to each other.

With `parallel=ParallelSpec(ep=E)` and E < plan_ngpus, each plan unit is E expert
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


from nncompile.errors import ConfigError
from nncompile.experts import MOE_EXPERTS
from nncompile.ir import PARAM, Graph, Partial, Replicate, Shard, Stage
from nncompile.mesh import EP
from nncompile.rules import strategies
from nncompile.rules.experts import DISPATCH

from .context_parallel import _conflicts, place_along
from .policies.greedy import Walk, take_best


def no_experts_error(g: Graph, e: int) -> ConfigError:
    return ConfigError(f"parallel.ep={e}: {g.trace_info.model} has no "
                       "mixture-of-experts layer nncompile recognizes (an experts module of "
                       "Hugging Face's interface: docs/experts.md)")


def dispatch_of(op, e: int):
    """A MoE layer's dispatch strategy over e ranks (nncompile/rules/experts.py); a
    ConfigError naming the layer where its experts or tokens do not divide by e."""
    s = next((s for s in strategies(op, e) if s.local_target == DISPATCH), None)
    if s is None:
        x, _, _, w_in = op.args[:4]
        raise ConfigError(f"parallel.ep={e}: {op.module_path} has "
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
