"""Free at last use: the `del` lines of the generated forward.

A Python frame keeps every local alive until it returns; the model's own frames are small
(one module's forward), so its intermediates die as each frame returns. The generated forward
is one frame for the whole model, so it deletes each local tensor right after the statement
that uses it last:

Before:                                          After:
    h = aten.add.Tensor(x, y)                        h = aten.add.Tensor(x, y)
    pow = aten.pow.Tensor_Scalar(h, 2)               pow = aten.pow.Tensor_Scalar(h, 2)
    mean = aten.mean.dim(pow, [-1], True)            mean = aten.mean.dim(pow, [-1], True)
    out = aten.mul.Tensor(h, mean)                   del pow
    return (out,)                                    out = aten.mul.Tensor(h, mean)
                                                     del h, mean
                                                     return (out,)

`del` drops the frame's reference only: what autograd saved for backward it keeps (gradients
are unchanged), and a value it does not keep is freed at its last use, no later than the
plain model frees it. What is never
deleted: the function's arguments (the caller holds them, deleting frees nothing), parameters,
buffers and constants (attributes of the module; ZeRO-3's gathered parameters have their own
`del`, passes/lower_zero3.py), non-tensor values, and whatever is returned. A checkpointed closure
(recompute) is one statement of the enclosing forward that uses its arguments and defines
what it returns; its body is freed the same way, inside the closure (codegen/body.py).
"""
from __future__ import annotations

from typing import Iterable

from nncompile.ir import Graph, Value

Statement = tuple[Iterable, Iterable]        # (values it uses, values it defines)


def last_uses(statements: list[Statement], keep: Iterable, skip: Iterable) -> list[list[Value]]:
    """Per statement (in program order), the local tensors to delete right after it: those it
    uses or defines that no later statement uses, except the Values in `keep` (returned) and
    `skip` (arguments), and any Value no op computes (inputs, parameters, buffers,
    constants)."""
    live = {id(v) for v in keep if isinstance(v, Value)}
    never = {id(v) for v in skip}
    out: list[list[Value]] = [[] for _ in statements]
    for k in range(len(statements) - 1, -1, -1):
        uses, defs = statements[k]
        uses = list(uses)
        dead: dict[int, Value] = {}
        for v in uses + list(defs):
            if isinstance(v, Value) and v.is_tensor and v.kind == "op" and \
                    id(v) not in live and id(v) not in never:
                dead.setdefault(id(v), v)
        out[k] = list(dead.values())
        live.update(id(v) for v in uses if isinstance(v, Value))
    return out


def del_lines(values: list[Value], indent: str) -> list[str]:
    """`del a, b` (no line when there is nothing to delete)."""
    return [f"{indent}del {', '.join(v.name for v in values)}"] if values else []


def fixed_values(g: Graph) -> list[Value]:
    """What the forward never deletes: its arguments and the module's parameters, buffers and
    constants."""
    return g.inputs + g.params + g.buffers + g.consts
