"""dce: drop ops (and constant ops) whose results nothing uses.

Before:                              After:
    a = aten.add.Tensor(x, y)            b = aten.mul.Tensor(x, y)
    b = aten.mul.Tensor(x, y)            return (b,)
    return (b,)

In-place ops (names ending in `_`) are kept. Parameters and buffers are kept even when unused,
so every FQN of the module stays in the manifest. Precondition: none. Idempotent: yes.
"""
from __future__ import annotations

from nncompile.ir import CONST, Graph, Value


def dce(graph: Graph) -> Graph:
    live = {id(v) for v in graph.outputs if isinstance(v, Value)}
    keep_ops = []
    for op in reversed(graph.ops):
        if any(id(v) in live for v in op.outputs) or op.is_inplace:
            keep_ops.append(op)
            live |= {id(v) for v in op.inputs()}
    keep_const = []
    for op in reversed(graph.const_ops):
        if any(id(v) in live for v in op.outputs):
            keep_const.append(op)
            live |= {id(v) for v in op.inputs()}
    if len(keep_ops) == len(graph.ops) and len(keep_const) == len(graph.const_ops):
        return graph
    ids_ops = {id(op) for op in keep_ops}
    ids_const = {id(op) for op in keep_const}
    g = graph.clone()
    g.ops = [new for old, new in zip(graph.ops, g.ops) if id(old) in ids_ops]
    g.const_ops = [new for old, new in zip(graph.const_ops, g.const_ops) if id(old) in ids_const]
    fwd_used = {v.name for op in g.ops for v in op.inputs()}
    fwd_used |= {v.name for v in g.outputs if isinstance(v, Value)}
    for op in g.const_ops:
        for v in op.outputs:
            if v.kind == CONST and v.name not in fwd_used:
                v.kind = "op"
    return g
