"""`verify(graph)`: one reusable checker run after any pass (tests run it after every pass).

Checks: unique names; every use is defined before it; no op writes into its input (the IR is
functional: a collective between a view and its base would write into a copy, see
frontend.functionalize); every Shard placement names a real
dimension divisible by plan_ngpus; once communication is inserted (Stage.COMM_INSERTED in graph.stages),
every op's inputs already have the placements its strategy asks for and every output is
Replicate.
"""
from __future__ import annotations

from ..errors import GraphError
from .graph import Graph, Stage, Value
from .placement import Replicate, Shard


def _check_placement(v: Value, n: int, where: str) -> None:
    p = v.placement
    if isinstance(p, Shard):
        if not v.is_tensor:
            raise GraphError(f"{where}: non-tensor %{v.name} is sharded")
        rank = len(v.meta.shape)
        if not 0 <= p.dim < rank:
            raise GraphError(f"{where}: %{v.name} {list(v.meta.shape)} has no dim {p.dim}")
        if v.meta.shape[p.dim] % n:
            raise GraphError(f"{where}: %{v.name} dim {p.dim} of {list(v.meta.shape)} "
                             f"is not divisible by plan_ngpus={n}")


def _mutates(op) -> bool:
    schema = getattr(op.target, "_schema", None)
    return schema is not None and schema.is_mutable and op.target._opname != "detach_"


def verify(graph: Graph) -> Graph:
    """Raise GraphError on the first inconsistency; return the graph unchanged otherwise."""
    n = graph.plan_ngpus
    defined: set[int] = set()
    names: set[str] = set()

    def define(v: Value, where: str) -> None:
        if v.name in names:
            raise GraphError(f"{where}: name {v.name!r} defined twice")
        names.add(v.name)
        defined.add(id(v))
        _check_placement(v, n, where)

    for v in graph.all_inputs():
        define(v, "input")
    comm_done = Stage.COMM_INSERTED in graph.stages
    for section in (graph.const_ops, graph.ops):
        for op in section:
            where = f"op {op.name} ({op.target_name})"
            ins = op.inputs()
            for v in ins:
                if id(v) not in defined:
                    raise GraphError(f"{where}: uses %{v.name} before it is defined")
            if _mutates(op):
                raise GraphError(f"{where}: writes into its input in place; the IR must be "
                                 "functional (trace through nncompile.frontend.trace)")
            for v in op.outputs:
                define(v, where)
            if comm_done and op.strategy is not None:
                tensors = [v for v in ins if v.is_tensor]
                for axis, wants in op.strategy.axis_inputs.items():
                    for v, want in zip(tensors, wants):
                        if want is not None and v.placement_on(axis) != want:
                            raise GraphError(f"{where}: input %{v.name} is "
                                             f"{v.placement_on(axis)!r} along {axis}, "
                                             f"strategy wants {want!r}")
                if len(tensors) != len(op.strategy.inputs):
                    raise GraphError(f"{where}: strategy has {len(op.strategy.inputs)} inputs, "
                                     f"op has {len(tensors)}")
                for v, want in zip(tensors, op.strategy.inputs):
                    if want is not None and v.placement != want:
                        raise GraphError(f"{where}: input %{v.name} is {v.placement!r}, "
                                         f"strategy wants {want!r}")
    for v in graph.outputs:
        if isinstance(v, Value):
            if id(v) not in defined:
                raise GraphError(f"output %{v.name} is never defined")
            if comm_done and (v.placement != Replicate() or v.axes):
                raise GraphError(f"output %{v.name} is {v.placement!r} "
                                 f"{dict(v.axes) or ''}, not replicated")
    return graph
