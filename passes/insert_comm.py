"""insert_comm: one collective, paired with its backward dual, per placement mismatch.

Before (x is S(1), the op wants it replicated):     After:
    y = aten.layer_norm.default(x, ...)                 x_gather = comm.all_gather(x, dim=1, group=PLAN_GROUP)
                                                        y = aten.layer_norm.default(x_gather, ...)

Transitions (forward / backward), from runtime/comm.py:
    P -> R     all_reduce      / identity
    R -> S(d)  chunk           / all_gather
    S(d) -> R  all_gather      / chunk         (reduce_scatter when users leave partial grads)
    P -> S(d)  reduce_scatter  / all_gather
    S(i)->S(j) all_to_all      / all_to_all
    R -> P     to_partial      / identity      (rank 0 keeps the value, the others zeros)
    R -> R     sync_grad       / all_reduce    (see below)

Gradients: the gradient of a replicated value must be the same full tensor on every rank. A
split op that reads a replicated input leaves only a partial gradient for it on each rank, so
that use goes through `sync_grad`, Megatron's `f`. A replicated parameter whose every use is
like that skips `sync_grad`: the runtime sums its gradient over the plan unit instead
(`partial_grad` in the manifest), together with the data-parallel reduction.
Each distinct (value, placement) conversion is made once and shared by its users.
Precondition: plan. Idempotent: yes (a second run finds nothing to convert).
"""
from __future__ import annotations

from nncompile.ir import PARAM, PLAN_GROUP, Graph, Op, Partial, Replicate, Shard, Strategy, Value


def _needs_sync(op: Op, v: Value, want) -> bool:
    src = v.producer
    synced = src is not None and (src.target == "comm.sync_grad" or (
        src.target == "comm.all_gather" and src.kwargs.get("reduce_grad", False)))
    return isinstance(want, Replicate) and op.strategy.is_split and v.requires_grad \
        and not synced and not op.target_name.startswith("comm.")


class _Inserter:
    def __init__(self, g: Graph):
        self.g = g
        self.cache: dict[tuple, Value] = {}
        self.new_ops: list[Op] = []

    def emit(self, kind: str, v: Value, dst, **kwargs) -> Value:
        out = Value(self.g.fresh_name(f"{v.name}_{kind}"), v.meta, requires_grad=v.requires_grad)
        out.placement = dst
        op = Op(f"comm.{kind}", (v,), {**kwargs, "group": PLAN_GROUP}, [out],
                module_path=v.producer.module_path if v.producer else "")
        op.strategy = Strategy((v.placement,), (dst,), kind)
        self.new_ops.append(op)
        return out

    def convert(self, v: Value, want, sync: bool = False) -> Value:
        key = (id(v), want, sync)
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
    if sync and isinstance(src, Shard) and isinstance(want, Replicate):
        return [("all_gather", {"dim": src.dim, "reduce_grad": True}, want)]
    steps = _transition(src, want)
    return steps + [("sync_grad", {}, Replicate())] if sync else steps


def _transition(src, want) -> list[tuple[str, dict, object]]:
    if want is None or src == want:
        return []
    if isinstance(src, Replicate):
        return [("chunk", {"dim": want.dim}, want)] if isinstance(want, Shard) \
            else [("to_partial", {}, want)]
    if isinstance(src, Partial):
        return [("all_reduce", {}, want)] if isinstance(want, Replicate) \
            else [("reduce_scatter", {"dim": want.dim}, want)]
    if isinstance(want, Shard):
        return [("all_to_all", {"src_dim": src.dim, "dst_dim": want.dim}, want)]
    steps = [("all_gather", {"dim": src.dim}, Replicate())]
    return steps + [("to_partial", {}, want)] if isinstance(want, Partial) else steps


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
        op.map_values(lambda v: repl.get(id(v), v))
        ops += ins.new_ops + [op]
    ins.new_ops = []
    g.outputs = [ins.convert(v, Replicate()) if isinstance(v, Value) and v.is_tensor else v
                 for v in g.outputs]
    g.ops = ops + ins.new_ops
    g.meta["comm_inserted"] = True
    g.meta["partial_grad_params"] = sorted(partial_grad | set(g.meta.get("partial_grad_params",
                                                                          [])))
    return g
