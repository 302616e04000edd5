"""insert_comm: one collective, paired with its backward dual, per placement mismatch.

Before (x is S(1), the op wants it replicated):     After:
    y = aten.layer_norm.default(x, ...)                 x_gather = comm.all_gather(x, dim=1, group=PLAN_GROUP)
                                                        y = aten.layer_norm.default(x_gather, ...)

Which collective implements each transition, and its backward, is nncompile/collectives.py's
table (`route(src, dst)`); a pair it lacks goes through Replicate (S -> P: all_gather, to_partial).

Gradients: the gradient of a replicated value must be the same full tensor on every rank. A
split op that reads a replicated input leaves only a partial gradient for it on each rank, so
that use goes through `sync_grad`, Megatron's `f`. A replicated parameter whose every use is
like that skips `sync_grad`: the runtime sums its gradient over the plan unit instead
(`partial_grad` in the manifest), together with the data-parallel reduction.
Each distinct (value, placement) conversion is made once and shared by its users. A conversion
from or to a strided split S(d|o) runs on the value viewed with dim d unmerged into (o, rest),
where the split is a plain S(d + 1):

    x: f32[8, 16] S(0|2)   ->   x_view = reshape(x, [2, 4, 16])        # S(1)
                                x_view_gather = comm.all_gather(x_view, dim=1)
                                x_view_gather_view = reshape(x_view_gather, [8, 16])   # R
Precondition: plan. Idempotent: yes (a second run finds nothing to convert).
"""
from __future__ import annotations

import torch

from .contract import contract
from nncompile.collectives import (axis_of, by_name, grad_sync_collective, group_symbol,
                                   of_target, route)
from nncompile.mesh import PLAN
from nncompile.ir import PARAM, PLAN_GROUP, Graph, Op, Partial, Replicate, Shard, Stage, \
    Strategy, StridedShard, TensorMeta, Value

ZIGZAG_KINDS = ("chunk", "all_gather", "reduce_scatter")   # the ones a zigzag order changes


def _needs_sync(op: Op, v: Value, want, axis: str = PLAN) -> bool:
    """A use of `v` that leaves a partial gradient along `axis`: `op` is split along it and
    reads `v` whole there."""
    return isinstance(want, Replicate) and _split_on(op, axis) and v.requires_grad \
        and not _sums_grad(v.producer, axis) and not op.target_name.startswith("comm.")


def _split_on(op: Op, axis: str) -> bool:
    """`op` runs on pieces along `axis` (its strategy splits an input or output there)."""
    if axis == PLAN:
        return op.strategy.is_split
    wants = op.strategy.axis_inputs.get(axis, ())
    return any(w is not None and not isinstance(w, Replicate) for w in wants) or any(
        not isinstance(v.placement_on(axis), Replicate) for v in op.outputs if v.is_tensor)


def _place(v: Value, axis: str, p) -> None:
    """Set `v`'s placement along `axis`."""
    if axis == PLAN:
        v.placement = p
    elif isinstance(p, Replicate):
        v.axes.pop(axis, None)
    else:
        v.axes[axis] = p


class _Inserter:
    """Conversions along one mesh axis, each made once per (value, placement, sync)."""

    def __init__(self, g: Graph):
        self.g = g
        self.cache: dict[tuple, Value] = {}
        self.new_ops: list[Op] = []

    def _value(self, v: Value, name: str, meta: TensorMeta, axis: str, p) -> Value:
        out = Value(self.g.fresh_name(name), meta, requires_grad=v.requires_grad)
        out.placement, out.axes = v.placement, dict(v.axes)
        _place(out, axis, p)
        return out

    def emit(self, kind: str, v: Value, dst, axis: str = PLAN, **kwargs) -> Value:
        out = self._value(v, f"{v.name}_{kind}", v.meta, axis, dst)
        if axis in self.g.plan_state.zigzag_axes and kind in ZIGZAG_KINDS:
            kwargs = {**kwargs, "zigzag": True}
        op = Op(f"comm.{kind}", (v,), {**kwargs, "group": group_symbol(axis)}, [out],
                module_path=v.producer.module_path if v.producer else "")
        src = v.placement_on(axis)
        op.strategy = Strategy((v.placement,), (out.placement,), kind) if axis == PLAN \
            else Strategy((v.placement,), (v.placement,), kind, axis_inputs={axis: (src,)})
        self.new_ops.append(op)
        return out

    def reshape(self, v: Value, shape: tuple[int, ...], placement, axis: str = PLAN) -> Value:
        """A layout op (no data moves): `v` viewed as `shape`, placed as `placement`."""
        out = self._value(v, f"{v.name}_view", TensorMeta(tuple(shape), v.meta.dtype), axis,
                          placement)
        op = Op(torch.ops.aten.reshape.default, (v, list(shape)), {}, [out],
                module_path=v.producer.module_path if v.producer else "")
        op.strategy = Strategy((v.placement,), (out.placement,), "unmerge strided split") \
            if axis == PLAN else Strategy((v.placement,), (v.placement,),
                                          "unmerge strided split",
                                          axis_inputs={axis: (v.placement_on(axis),)})
        self.new_ops.append(op)
        return out

    def strided(self, v: Value, want, sync: bool, axis: str) -> Value:
        """A conversion from or to StridedShard(d, o): through v viewed with dim d unmerged
        into (o, size // o), where the split is a plain S(d + 1)."""
        have = v.placement_on(axis)
        if isinstance(have, StridedShard):
            d, o = have.dim, have.outer
            shape = v.meta.shape
            wide = shape[:d] + (o, shape[d] // o) + shape[d + 1:]
            full = self.reshape(self.convert(self.reshape(v, wide, Shard(d + 1), axis),
                                             Replicate(), axis=axis), shape, Replicate(), axis)
            return self.convert(full, want, sync, axis)
        if not isinstance(have, (Replicate, Partial)):
            return self.convert(self.convert(v, Replicate(), axis=axis), want, sync, axis)
        d, o = want.dim, want.outer
        shape = v.meta.shape
        wide = shape[:d] + (o, shape[d] // o) + shape[d + 1:]
        split = self.convert(self.reshape(v, wide, have, axis), Shard(d + 1), sync, axis)
        return self.reshape(split, shape, want, axis)

    def convert(self, v: Value, want, sync: bool = False, axis: str = PLAN) -> Value:
        """`v` placed as `want` along `axis` (its placements on other axes kept)."""
        key = (id(v), want, sync, axis)
        have = v.placement_on(axis)
        if key not in self.cache and have != want and want is not None and any(
                isinstance(p, StridedShard) for p in (have, want)):
            self.cache[key] = self.strided(v, want, sync, axis)
        if key not in self.cache and axis in self.g.plan_state.zigzag_axes and \
                isinstance(have, Shard) and isinstance(want, Shard) and have != want:
            # an all-to-all moves contiguous pieces; in the zigzag order a piece is two
            # chunks, so gather (un-zigzagging) and chunk again
            self.cache[key] = self.convert(self.convert(v, Replicate(), axis=axis), want,
                                           sync, axis)
        if key not in self.cache:
            out = v
            for kind, kwargs, dst in transition(have, want, sync, axis):
                out = self.emit(kind, out, dst, axis, **kwargs)
            self.cache[key] = out
        return self.cache[key]


def transition(src, want, sync: bool = False, axis: str = PLAN
               ) -> list[tuple[str, dict, object]]:
    """The collectives along `axis` that turn placement `src` into `want`: [(kind, kwargs,
    placement after)]. With `sync` (a replicated result whose users leave partial gradients)
    the backward also sums gradients over the axis: a gather then reduce-scatters them,
    anything else adds sync_grad."""
    steps = [(c.name, c.kwargs(a, b), b) for c, a, b in route(src, want, axis)]
    if sync and len(steps) == 1 and by_name(steps[0][0]).reduce_grad_dual:
        kind, kwargs, dst = steps[0]
        return [(kind, {**kwargs, "reduce_grad": True}, dst)]
    return steps + [(grad_sync_collective(axis).name, {}, Replicate())] if sync else steps


def _sums_grad(op: Op | None, axis: str = PLAN) -> bool:
    """`op` is a collective along `axis` whose backward already sums the gradient over it."""
    c = of_target(op.target_name) if op is not None else None
    return c is not None and axis_of(op) == axis and (
        c.syncs_grad or (bool(c.reduce_grad_dual) and op.kwargs.get("reduce_grad", False)))


def _partial_params(g: Graph, axis: str) -> set[str]:
    """Replicated (along `axis`) trainable parameters whose every use leaves a partial
    gradient there: the runtime sums their gradients over the axis instead of sync_grad."""
    uses: dict[int, list[bool]] = {}
    for op in g.ops:
        wants = op.strategy.inputs if axis == PLAN else op.strategy.axis_inputs.get(axis)
        for i, v in enumerate(op.tensor_inputs()):
            if v.kind == PARAM:
                want = wants[i] if wants else (Replicate() if axis != PLAN else None)
                uses.setdefault(id(v), []).append(
                    _needs_sync(op, v, want, axis) and isinstance(v.placement_on(axis), Replicate))
    return {v.name for v in g.params if v.requires_grad and uses.get(id(v)) and all(uses[id(v)])}


@contract(requires=(Stage.PLANNED,), produces=(Stage.COMM_INSERTED,))
def insert_comm(graph: Graph) -> Graph:
    g = graph.clone()
    axes = [a for a in g.axes if a != PLAN]
    # replicated parameters whose every use leaves a partial gradient: reduced by the runtime
    partial = {axis: _partial_params(g, axis) for axis in [PLAN] + axes}
    ins = _Inserter(g)
    ops: list[Op] = []
    for op in g.ops:
        ins.new_ops = []
        tensors = op.tensor_inputs()
        repl = {}
        for i, (v, want) in enumerate(zip(tensors, op.strategy.inputs)):
            for axis in axes:           # split along another axis on the dim the plan wants
                have = v.placement_on(axis)     # split: gathered there first (never nested)
                other = (op.strategy.axis_inputs.get(axis) or (Replicate(),) * len(tensors))[i]
                if isinstance(want, Shard) and isinstance(have, Shard) and \
                        have.dim == want.dim and other != have:
                    sync = _needs_sync(op, v, other, axis) and v.name not in partial[axis]
                    repl[id(v)] = ins.convert(repl.get(id(v), v), other, sync, axis)
            sync = _needs_sync(op, v, want) and v.name not in partial[PLAN]
            repl[id(v)] = ins.convert(repl.get(id(v), v), want, sync)
        for axis in axes:                                # the mesh's other axes
            wants = op.strategy.axis_inputs.get(axis) or (Replicate(),) * len(tensors)
            for v, want in zip(tensors, wants):
                sync = _needs_sync(op, v, want, axis) and v.name not in partial[axis]
                repl[id(v)] = ins.convert(repl.get(id(v), v), want, sync, axis)
        op.map_values(lambda v: repl.get(id(v), v))
        ops += ins.new_ops + [op]
    ins.new_ops = []
    # a buffer's new value (the last outputs) is written back into its shard: placed as it is
    nupd = len(g.trace_info.buffer_updates)
    buffers = {v.fqn: v for v in g.buffers}
    wants = [Replicate()] * (len(g.outputs) - nupd) + \
        [buffers[f].placement for f in g.trace_info.buffer_updates]
    outs = []
    for v, want in zip(g.outputs, wants):
        if isinstance(v, Value) and v.is_tensor:
            v = ins.convert(v, want)
            for axis in axes:                            # whole along the other axes
                v = ins.convert(v, Replicate(), axis=axis)
        outs.append(v)
    g.outputs = outs
    g.ops = ops + ins.new_ops
    g.stages = g.stages | {Stage.COMM_INSERTED}
    g.plan_state.partial_grad_params = sorted(partial[PLAN]
                                              | set(g.plan_state.partial_grad_params))
    g.plan_state.axis_partial_grad = {**g.plan_state.axis_partial_grad, **{
        axis: sorted(partial[axis] | set(g.plan_state.axis_partial_grad.get(axis, ())))
        for axis in axes}}
    return g
