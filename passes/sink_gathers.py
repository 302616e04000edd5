"""sink_gathers: run element-wise ops on shards before a gather, so the gather meets the split
ops it feeds and its backward is one reduce-scatter.

Sequence-parallel plans gather a split activation (S(1): rows of the sequence) before the
column linears of attention and the MLP. When the gather lands before an element-wise op
(the RMSNorm's weight multiply, a dtype cast), insert_comm must add `sync_grad` after that
op: the backward is a chunk plus a full all-reduce, where Megatron-SP moves half the bytes in
one reduce-scatter. This pass moves such ops before the gather:

Before (x is S(1); q/k/v are split):            After:
    y = aten.mul.Tensor(x, w)   # R   [replicate]   y = aten.mul.Tensor(x, w)   # S(1) [split dim 1]
    q = aten.linear(y, wq)      # S(2)              q = aten.linear(y, wq)      # S(2)
  insert_comm then writes                         insert_comm then writes
    x_g = all_gather(x); y = x_g * w                y_g = all_gather(y, reduce_grad=True)
    y_s = sync_grad(y)   (backward: all_reduce)     (backward: reduce_scatter)

An op moves when it runs replicated, reads exactly one split activation, its other tensor
inputs are replicated parameters, buffers or constants (their gradients become partial sums,
reduced by the runtime with the data-parallel ones), and a rule lets it keep the split; a
chain of such ops moves together when, at its end, every user is a split op that wants the
value whole. Precondition: plan. Idempotent: yes.
"""
from __future__ import annotations

from nncompile.ir import FREE_KINDS, Graph, Op, Replicate, Shard, Stage, Strategy, Value
from nncompile.rules import strategies

from .contract import contract


def _kept_split(op: Op, x: Value, have: Shard, n: int) -> Strategy | None:
    """A strategy of the replicated `op` that takes `x` as `have` and keeps a split, every
    other tensor input a replicated free value."""
    if op.strategy is None or op.strategy.is_split or op.target_name.startswith("comm."):
        return None
    if len([v for v in op.outputs if v.is_tensor]) != 1:
        return None
    ins = op.tensor_inputs()
    if any(v is not x and (v.kind not in FREE_KINDS or not isinstance(v.placement, Replicate))
           for v in ins):
        return None
    for s in strategies(op, n):
        if all((want == have) if v is x else isinstance(want, Replicate)
               for v, want in zip(ins, s.inputs)) and isinstance(s.outputs[0], Shard):
            return s
    return None


@contract(requires=(Stage.PLANNED,))
def sink_gathers(graph: Graph) -> Graph:
    n = graph.plan_ngpus
    if n == 1:
        return graph
    g = graph.clone()
    users: dict[int, list[Op]] = {}
    for op in g.ops:
        for v in op.tensor_inputs():
            users.setdefault(id(v), []).append(op)
    outputs = {id(v) for v in g.outputs if isinstance(v, Value)}

    def wants_whole(u: Op, v: Value) -> bool:
        return u.strategy.is_split and not u.target_name.startswith("comm.") and all(
            isinstance(p, Replicate) for w, p in zip(u.tensor_inputs(), u.strategy.inputs)
            if w is v)

    for op in g.ops:
        xs = [v for v in op.tensor_inputs() if v.kind not in FREE_KINDS]
        if len(xs) != 1 or not isinstance(xs[0].placement, Shard):
            continue
        chain: list[tuple[Op, Strategy]] = []
        cur, x, have = op, xs[0], xs[0].placement
        while True:
            s = _kept_split(cur, x, have, n)
            if s is None:
                chain = []
                break
            chain.append((cur, s))
            out = next(v for v in cur.outputs if v.is_tensor)
            after = users.get(id(out), [])
            if not after or id(out) in outputs:
                chain = []
                break
            if all(wants_whole(u, out) for u in after):
                break                                   # the gather now meets split users
            if len(after) != 1:
                chain = []
                break
            cur, x, have = after[0], out, s.outputs[0]
        for c, s in chain:
            c.strategy = s
            for v, p in zip(c.outputs, s.outputs):
                v.placement = p if v.is_tensor else Replicate()
    return g
