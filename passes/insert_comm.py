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
from nncompile.collectives import by_name, grad_sync_collective, group_symbol, of_target, route
from nncompile.ir import PARAM, PLAN_GROUP, Graph, Op, Partial, Replicate, Shard, Stage, \
    Strategy, StridedShard, TensorMeta, Value

def _needs_sync(op: Op, v: Value, want) -> bool:
    return isinstance(want, Replicate) and op.strategy.is_split and v.requires_grad \
        and not _sums_grad(v.producer) and not op.target_name.startswith("comm.")


class _Inserter:
    def __init__(self, g: Graph):
        self.g = g
        self.cache: dict[tuple, Value] = {}
        self.new_ops: list[Op] = []

    def emit(self, kind: str, v: Value, dst, **kwargs) -> Value:
        out = Value(self.g.fresh_name(f"{v.name}_{kind}"), v.meta, requires_grad=v.requires_grad)
        out.placement = dst
        group = group_symbol(by_name(kind).group)
        op = Op(f"comm.{kind}", (v,), {**kwargs, "group": group}, [out],
                module_path=v.producer.module_path if v.producer else "")
        op.strategy = Strategy((v.placement,), (dst,), kind)
        self.new_ops.append(op)
        return out

    def convert_on(self, axis: str, v: Value, want) -> Value:
        """`v` placed as `want` along mesh axis `axis` (not "plan"), by that axis's
        collectives; its plan placement is kept."""
        key = (id(v), axis, want)
        if key not in self.cache:
            out = v
            for c, _, dst in route(v.placement_on(axis), want, axis):
                src, prev = out.placement_on(axis), out
                out = Value(self.g.fresh_name(f"{prev.name}_{c.name}"), prev.meta,
                            requires_grad=prev.requires_grad)
                out.placement = prev.placement
                out.axes = {a: p for a, p in {**prev.axes, axis: dst}.items()
                            if not isinstance(p, Replicate)}
                op = Op(f"comm.{c.name}", (prev,),
                        {**c.kwargs(src, dst), "group": group_symbol(axis)}, [out],
                        module_path=prev.producer.module_path if prev.producer else "")
                op.strategy = Strategy((prev.placement,), (prev.placement,), c.name)
                self.new_ops.append(op)
            self.cache[key] = out
        return self.cache[key]

    def reshape(self, v: Value, shape: tuple[int, ...], placement) -> Value:
        """A layout op (no data moves): `v` viewed as `shape`, placed as `placement`."""
        out = Value(self.g.fresh_name(f"{v.name}_view"), TensorMeta(tuple(shape), v.meta.dtype),
                    requires_grad=v.requires_grad)
        out.placement = placement
        op = Op(torch.ops.aten.reshape.default, (v, list(shape)), {}, [out],
                module_path=v.producer.module_path if v.producer else "")
        op.strategy = Strategy((v.placement,), (placement,), "unmerge strided split")
        self.new_ops.append(op)
        return out

    def strided(self, v: Value, want, sync: bool) -> Value:
        """A conversion from or to StridedShard(d, o): through v viewed with dim d unmerged
        into (o, size // o), where the split is a plain S(d + 1)."""
        if isinstance(v.placement, StridedShard):
            d, o = v.placement.dim, v.placement.outer
            shape = v.meta.shape
            wide = shape[:d] + (o, shape[d] // o) + shape[d + 1:]
            full = self.reshape(self.convert(self.reshape(v, wide, Shard(d + 1)), Replicate()),
                                shape, Replicate())
            return self.convert(full, want, sync)
        if not isinstance(v.placement, (Replicate, Partial)):
            return self.convert(self.convert(v, Replicate()), want, sync)
        d, o = want.dim, want.outer
        shape = v.meta.shape
        wide = shape[:d] + (o, shape[d] // o) + shape[d + 1:]
        split = self.convert(self.reshape(v, wide, v.placement), Shard(d + 1), sync)
        return self.reshape(split, shape, want)

    def convert(self, v: Value, want, sync: bool = False) -> Value:
        key = (id(v), want, sync)
        if key not in self.cache and v.placement != want and any(
                isinstance(p, StridedShard) for p in (v.placement, want)):
            self.cache[key] = self.strided(v, want, sync)
        if key not in self.cache:
            out = v
            for kind, kwargs, dst in transition(v.placement, want, sync):
                out = self.emit(kind, out, dst, **kwargs)
            self.cache[key] = out
        return self.cache[key]


def transition(src, want, sync: bool = False) -> list[tuple[str, dict, object]]:
    """The collectives that turn placement `src` into `want`: [(kind, kwargs, placement after)].
    With `sync` (a replicated result whose users leave partial gradients) the backward also sums
    gradients over the unit: a gather then reduce-scatters them, anything else adds sync_grad."""
    steps = [(c.name, c.kwargs(a, b), b) for c, a, b in route(src, want)]
    if sync and len(steps) == 1 and by_name(steps[0][0]).reduce_grad_dual:
        kind, kwargs, dst = steps[0]
        return [(kind, {**kwargs, "reduce_grad": True}, dst)]
    return steps + [(grad_sync_collective().name, {}, Replicate())] if sync else steps


def _sums_grad(op: Op | None) -> bool:
    """`op` is a collective whose backward already sums the gradient over the group."""
    c = of_target(op.target_name) if op is not None else None
    return c is not None and (c.syncs_grad or (bool(c.reduce_grad_dual)
                                               and op.kwargs.get("reduce_grad", False)))


@contract(requires=(Stage.PLANNED,), produces=(Stage.COMM_INSERTED,))
def insert_comm(graph: Graph) -> Graph:
    g = graph.clone()
    # replicated parameters whose every use leaves a partial gradient: reduced by the runtime
    uses: dict[int, list[bool]] = {}
    for op in g.ops:
        for v, want in zip(op.tensor_inputs(), op.strategy.inputs):
            if v.kind == PARAM:
                uses.setdefault(id(v), []).append(_needs_sync(op, v, want)
                                                  and isinstance(v.placement, Replicate))
    partial_grad = {v.name for v in g.params
                    if v.requires_grad and uses.get(id(v)) and all(uses[id(v)])}
    ins = _Inserter(g)
    ops: list[Op] = []
    for op in g.ops:
        ins.new_ops = []
        tensors = op.tensor_inputs()
        repl = {}
        for v, want in zip(tensors, op.strategy.inputs):
            sync = _needs_sync(op, v, want) and v.name not in partial_grad
            repl[id(v)] = ins.convert(v, want, sync)
        for axis, wants in op.strategy.axis_inputs.items():    # the mesh's other axes
            for v, want in zip(tensors, wants):
                repl[id(v)] = ins.convert_on(axis, repl.get(id(v), v), want)
        op.map_values(lambda v: repl.get(id(v), v))
        ops += ins.new_ops + [op]
    ins.new_ops = []
    # a buffer's new value (the last outputs) is written back into its shard: placed as it is
    nupd = len(g.trace_info.buffer_updates)
    buffers = {v.fqn: v for v in g.buffers}
    wants = [Replicate()] * (len(g.outputs) - nupd) + \
        [buffers[f].placement for f in g.trace_info.buffer_updates]
    g.outputs = [ins.convert(v, want) if isinstance(v, Value) and v.is_tensor else v
                 for v, want in zip(g.outputs, wants)]
    g.ops = ops + ins.new_ops
    g.stages = g.stages | {Stage.COMM_INSERTED}
    g.plan_state.partial_grad_params = sorted(partial_grad
                                              | set(g.plan_state.partial_grad_params))
    return g
