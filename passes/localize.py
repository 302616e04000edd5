"""localize: make every op run on one rank's shards.

Before (tp, plan_ngpus=2):                     After:
    v = aten.view.default(x, [8, 16, 4, 8])        v = aten.view.default(x, [8, 16, 2, 8])
      # f32[8, 16, 4, 8] S(2)                        # f32[8, 16, 2, 8] of [8, 16, 4, 8] S(2)

Size arguments (view, reshape, expand, new_zeros, full, ...) become the local shape, and a
rule's LOCAL_ARGS hook rewrites other arguments (a grouped convolution split by groups passes
groups // n); ops whose
strategy names a local implementation (e.g. the row-split mean cross-entropy) call it. `view`
becomes `reshape` (a view wherever the layout allows): tracing drops `.contiguous()` calls
that were no-ops on the traced layout, a shard produced by a collective may be laid out
differently, and kernels may return other strides than their fake versions traced (the CPU
attention kernel does, so Hugging Face T5's `reshape` after attention, traced as a view,
would fail on one rank too). With n > 1,
random ops (dropout, attention dropout) call runtime/program/rng.py, which draws the full tensor's
random numbers on every rank and keeps this rank's slice, so the plan does not change them:

    h2 = aten.dropout.default(h, 0.5, True)   ->   h2 = rng.dropout(h, 0.5, True, dim=1, group=...)

A mode argument (nncompile/modes.py: `self.training` where the model's dropout follows its
mode) is kept as it is: `rng.dropout(h, 0.5, self.training, ...)` draws nothing in eval mode.

Local
shapes follow from placements (even splits), so one localized graph serves every rank; each
rank's parameter slices are derived from placements in codegen. Precondition: insert_comm.
Idempotent: yes.
"""
from __future__ import annotations

import torch

from nncompile.collectives import group_symbol
from nncompile.ir import PLAN_GROUP, Graph, Shard, Stage
from nncompile.rules import LOCAL_ARGS, RANDOM_LOCAL, draws_random

from .contract import contract

# op name -> index of its size argument
_SIZE_ARG = {"view": 1, "reshape": 1, "_unsafe_view": 1, "expand": 1, "new_zeros": 1,
             "new_ones": 1, "new_empty": 1, "new_full": 1, "zeros": 0, "ones": 0, "empty": 0,
             "full": 0}


@contract(requires=(Stage.COMM_INSERTED,), produces=(Stage.LOCALIZED,))
def localize(graph: Graph) -> Graph:
    if Stage.LOCALIZED in graph.stages:
        return graph
    g = graph.clone()
    for op in g.ops:
        localize_op(op, g.plan_ngpus, g.axes, g.plan_state.zigzag_axes)
    g.stages = g.stages | {Stage.LOCALIZED}
    return g


def localize_op(op, n: int, axes: dict[str, int] | None = None, zigzag: tuple = ()) -> None:
    """Rewrite one op (in place) to run on one rank's shards of a plan unit of n ranks (and
    of the mesh's other `axes`, by size)."""
    s = op.strategy
    if s is not None and s.local_target is not None:
        op.target = s.local_target
        op.kwargs = {**op.kwargs, "group": PLAN_GROUP}
    axis_target = s.axis_local if s is not None else None
    if axis_target is not None:           # a local implementation along another axis
        axis, target = axis_target
        op.target = target
        op.kwargs = {**op.kwargs, "group": group_symbol(axis)}
        if axis in zigzag and target == "comm.attention_rows":
            op.kwargs["zigzag"] = True
    name = getattr(op.target, "_opname", None)
    if (n > 1 or axes) and draws_random(op):
        out = s.outputs[0] if s is not None else None
        dim, group = (out.dim if isinstance(out, Shard) else None), PLAN_GROUP
        for axis in axes or {}:                   # split along another axis (cp) instead
            p = op.outputs[0].placement_on(axis)
            if isinstance(p, Shard):
                dim, group = p.dim, group_symbol(axis)
        op.target = RANDOM_LOCAL[name]
        op.kwargs = {**op.kwargs, "dim": dim, "group": group}
        return
    if n > 1 and name in LOCAL_ARGS:
        LOCAL_ARGS[name](op, n)       # e.g. a grouped convolution's groups // n
    if name in ("view", "_unsafe_view"):
        op.target, name = torch.ops.aten.reshape.default, "reshape"
    idx = _SIZE_ARG.get(name)
    if idx is not None and len(op.args) > idx and op.outputs[0].is_tensor:
        args = list(op.args)
        args[idx] = list(op.outputs[0].local_shape(n, axes))
        op.args = tuple(args)
