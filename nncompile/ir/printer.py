"""Print a Graph as valid Python. The same printer feeds codegen, graph dumps and notebooks.

    def forward(idx, targets, *, wte_weight, ...):
        # gpt.py:24  x = self.wte(idx) + self.wpe(pos)
        wte = aten.embedding.default(wte_weight, idx)  # f32[8, 16, 32] S(2)
        ...
        return (loss,)

Names the code refers to but does not define: `aten` (torch.ops.aten), `torch`, `comm`
(nncompile.runtime.comm), `custom` (ops made with nncompile.register_op), `PLAN_GROUP` (the
plan unit's process group) and `DEVICE`.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from .graph import PARAM, Graph, Op, Value, target_name

_DTYPES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16",
           torch.float64: "f64", torch.int64: "i64", torch.int32: "i32", torch.int16: "i16",
           torch.int8: "i8", torch.uint8: "u8", torch.bool: "b8", torch.complex64: "c64"}


class Symbol(str):
    """A literal printed as a bare name (e.g. DEVICE, PLAN_GROUP)."""


DEVICE = Symbol("DEVICE")
PLAN_GROUP = Symbol("PLAN_GROUP")


def fmt_literal(x: Any) -> str:
    if isinstance(x, Value):
        return x.name
    if isinstance(x, Symbol):
        return str(x)
    if isinstance(x, bool) or x is None:
        return repr(x)
    if isinstance(x, float):
        if math.isinf(x):
            return "float('inf')" if x > 0 else "float('-inf')"
        if math.isnan(x):
            return "float('nan')"
        return repr(x)
    if isinstance(x, (int, str)):
        return repr(x)
    if isinstance(x, (torch.dtype, torch.layout, torch.memory_format)):
        return str(x)
    if isinstance(x, torch.device):
        return str(DEVICE)
    if isinstance(x, list):
        return "[" + ", ".join(fmt_literal(e) for e in x) + "]"
    if isinstance(x, tuple):
        inner = ", ".join(fmt_literal(e) for e in x)
        return f"({inner},)" if len(x) == 1 else f"({inner})"
    if isinstance(x, dict):
        return "{" + ", ".join(f"{k!r}: {fmt_literal(v)}" for k, v in x.items()) + "}"
    raise TypeError(f"cannot print literal {x!r} of type {type(x).__name__}")


def fmt_meta(v: Value, n: int | None = None) -> str:
    if not v.is_tensor:
        return ""
    dt = _DTYPES.get(v.meta.dtype, str(v.meta.dtype).replace("torch.", ""))
    shape = list(v.meta.shape)
    text = f"{dt}{shape} {v.placement!r}"
    if n is not None and n > 1:
        text = f"{dt}{list(v.local_shape(n))} of {shape} {v.placement!r}"
    return text


def fmt_call(op: Op) -> str:
    name = target_name(op.target)
    parts = [fmt_literal(a) for a in op.args]
    parts += [f"{k}={fmt_literal(v)}" for k, v in op.kwargs.items()]
    return f"{name}({', '.join(parts)})"


def fmt_op(op: Op, indent: str = "    ", local_n: int | None = None,
           source: bool = True) -> list[str]:
    """One op as code; with `source`, its user line as a comment above it."""
    lines = []
    if source and op.source is not None:
        lines.append(f"{indent}# {op.source.file}:{op.source.line}  {op.source.code}")
    if op.multi_output:
        lhs = ", ".join(v.name for v in op.outputs) + ("," if len(op.outputs) == 1 else "")
    elif op.outputs:
        lhs = op.outputs[0].name
    else:
        lhs = ""
    metas = "; ".join(m for m in (fmt_meta(v, local_n) for v in op.outputs) if m)
    note = f"  [{op.strategy.note}]" if op.strategy is not None and op.strategy.note else ""
    comment = f"  # {metas}{note}" if metas or note else ""
    call = fmt_call(op)
    lines.append(f"{indent}{lhs + ' = ' if lhs else ''}{call}{comment}")
    return lines


def fmt_body(ops: list[Op], indent: str = "    ", local_n: int | None = None,
             source: bool = True) -> list[str]:
    """Ops as code, with a source comment wherever the user's line changes (none without
    `source`)."""
    lines, last = [], None
    for op in ops:
        lines += fmt_op(op, indent, local_n, source=source and op.source != last)
        last = op.source or last        # inserted collectives (no source) do not repeat it
    return lines


def fmt_input(v: Value, local_n: int | None = None) -> str:
    kind = f"frozen {v.kind}" if v.kind == PARAM and not v.requires_grad else v.kind
    origin = f"{kind} {v.fqn!r} " if v.fqn else (f"{kind} " if v.kind != "input" else "")
    return f"{v.name},  # {origin}{fmt_meta(v, local_n)}"


def print_graph(g: Graph, local_n: int | None = None, source: bool = True) -> str:
    """The whole graph as a Python function `forward`; constants first, marked as such.
    source=False leaves out the user's source-line comments (file paths and line numbers),
    e.g. for the plan fingerprint."""
    lines = [f"# nncompile IR: plan_ngpus={g.plan_ngpus}"]
    lines.append("def forward(")
    lines += [f"    {fmt_input(v, local_n)}" for v in g.inputs]
    kw = g.params + g.buffers
    if kw:
        lines.append("    *,")
        lines += [f"    {fmt_input(v, local_n)}" for v in kw]
    lines.append("):")
    if g.const_ops:
        lines.append("    # ---- constants: evaluated once at load time ----")
        lines += fmt_body(g.const_ops, local_n=local_n, source=source)
        lines.append("    # ---- forward ----")
    lines += fmt_body(g.ops, local_n=local_n, source=source)
    lines.append(f"    return {fmt_literal(tuple(g.outputs))}")
    return "\n".join(lines) + "\n"
