"""overlap_grad_sync: fuse each `sync_grad` (and each all_gather that reduce-scatters its
gradient, tp_sp's) with the column-split linears it feeds, so that backward all-reduces (or
reduce-scatters) the input gradient while the weights' gradients are computed (Megatron-LM's
overlap of its `f` with the weight-gradient GEMMs).

Unfused, autograd computes each linear's input and weight gradients in one node, and only
then does sync_grad's backward all-reduce their sum, with nothing left to compute meanwhile.
Fused, backward computes the input gradient first, starts its all-reduce asynchronously,
computes the weight (and bias) gradients, and waits (runtime/program/comm.py, `_GradSyncLinears`):

Before (localized, tp):                          After:
    x_s = comm.sync_grad(x, group=PLAN_GROUP)        q, k, v = comm.sync_grad(x, group=PLAN_GROUP,
    q = aten.linear.default(x_s, wq, bq)                 linears=((wq, bq), (wk, bk), (wv, bv)))
    k = aten.linear.default(x_s, wk, bk)
    v = aten.linear.default(x_s, wv, bv)

    (tp_sp)  x_g = comm.all_gather(x, dim=1, reduce_grad=True, group=PLAN_GROUP)
             q = aten.linear.default(x_g, wq, bq) ...
         ->  q, ... = comm.all_gather(x, dim=1, reduce_grad=True, group=PLAN_GROUP,
                                      linears=((wq, bq), ...))

The forward is the same computation; the collective is the same (same kind, bytes and dual
in plan.json and `nncompile show`, which describe the graph before this pass). A collective
is fused when every user of its output is an `aten.linear` reading it as the input, with
parameters as weight and bias, in the same pipeline stage and outside recomputed modules,
and the output is not a graph output. Precondition: localize. Idempotent: yes (a fused op's
users are no longer linears reading its output).
"""
from __future__ import annotations

import torch

from nncompile.ir import PARAM, Graph, Op, Stage, Strategy, Value

from .contract import contract

_LINEAR = torch.ops.aten.linear.default


def _syncs_grad(op: Op) -> bool:
    """A sync_grad, or an all_gather whose backward reduce-scatters (sums) the gradient."""
    return op.target_name == "comm.sync_grad" or (
        op.target_name == "comm.all_gather" and op.kwargs.get("reduce_grad", False))


def _weight_bias(u: Op) -> tuple:
    """A linear's weight and bias (None when absent)."""
    return (u.args[1] if len(u.args) > 1 else None,
            u.args[2] if len(u.args) > 2 else u.kwargs.get("bias"))


def _fusable(sync: Op, users: list[Op], outputs: set[int]) -> bool:
    out = sync.outputs[0]
    if not users or id(out) in outputs or sync.recompute is not None or "linears" in sync.kwargs:
        return False
    for u in users:
        w, b = _weight_bias(u)
        if u.target is not _LINEAR or u.args[0] is not out or set(u.kwargs) - {"bias"} \
                or not (isinstance(w, Value) and w.kind == PARAM) \
                or not (b is None or (isinstance(b, Value) and b.kind == PARAM)) \
                or u.recompute is not None or u.stage != sync.stage:
            return False
    return True


@contract(requires=(Stage.LOCALIZED,))
def overlap_grad_sync(graph: Graph) -> Graph:
    if graph.plan_ngpus == 1 or graph.trace_info.inference_only or not any(
            _syncs_grad(op) for op in graph.ops):
        return graph
    g = graph.clone()
    users: dict[int, list[Op]] = {}
    for op in g.ops:
        for v in op.inputs():
            users.setdefault(id(v), []).append(op)
    outputs = {id(v) for v in g.outputs if isinstance(v, Value)}
    fused: dict[int, Op] = {}          # id(first linear) -> the fused op that replaces it
    dropped: set[int] = set()          # the sync_grads and the other linears
    for op in g.ops:
        if not _syncs_grad(op):
            continue
        lins = users.get(id(op.outputs[0]), [])
        if not _fusable(op, lins, outputs):
            continue
        pairs = tuple(_weight_bias(u) for u in lins)
        first = lins[0]
        new = Op(op.target, op.args, {**op.kwargs, "linears": pairs},
                 [u.outputs[0] for u in lins], source=first.source,
                 module_path=first.module_path, multi_output=True)
        new.module_stack, new.stage = first.module_stack, first.stage
        x = op.args[0]
        new.strategy = Strategy(
            (x.placement,) + tuple(t.placement for wb in pairs for t in wb if t is not None),
            tuple(u.outputs[0].placement for u in lins),
            f"{op.target_name[len('comm.'):]} + column linears", local_target=op.target)
        fused[id(first)] = new
        dropped.add(id(op))
        dropped.update(id(u) for u in lins[1:])
    if not fused:
        return graph
    g.ops = [fused.get(id(op), op) for op in g.ops if id(op) not in dropped]
    return g
