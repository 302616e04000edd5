"""Print a Graph as valid Python. The same printer feeds codegen, graph dumps and notebooks.

    def forward(idx, targets, *, wte_weight, ...):
        # gpt.py:24  x = self.wte(idx) + self.wpe(pos)
        wte = aten.embedding.default(wte_weight, idx)  # f32[8, 16, 32] S(2)
        ...
        return (loss,)

The header names plan_ngpus and the stages the passes established. Comments carry what the
code does not: a value's dtype, shape (`local of full` with local_n) and placement, `no_grad` /
`requires_grad` where a value differs from the default (see default_requires_grad), an op's
strategy note in brackets and, while an input lacks the placement the strategy wants (before
insert_comm), `wants (R, S(1), P)`. nncompile.ir.parse_graph reads all of it back.

Names the code refers to but does not define: `aten` (torch.ops.aten), `torch`, `comm`
(nncompile.runtime.comm), `custom` (ops made with nncompile.register_op), `PLAN_GROUP` (the
plan unit's process group) and `DEVICE`.
"""
from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Any

import torch

from .graph import PARAM, Graph, Op, Stage, Value, target_name

_DTYPES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16",
           torch.float64: "f64", torch.int64: "i64", torch.int32: "i32", torch.int16: "i16",
           torch.int8: "i8", torch.uint8: "u8", torch.bool: "b8", torch.complex64: "c64"}


class Symbol(str):
    """A literal printed as a bare name (e.g. DEVICE, PLAN_GROUP)."""


DEVICE = Symbol("DEVICE")
PLAN_GROUP = Symbol("PLAN_GROUP")


_NAMES: contextvars.ContextVar[dict[int, str]] = contextvars.ContextVar("value_names",
                                                                        default={})


@contextlib.contextmanager
def value_names(names: dict[Value, str]):
    """Print these Values under other names while inside (codegen prints parameters as
    `self.<name>`); the graph itself is not changed."""
    token = _NAMES.set({id(v): name for v, name in names.items()})
    try:
        yield
    finally:
        _NAMES.reset(token)


def fmt_literal(x: Any) -> str:
    if isinstance(x, Value):
        return _NAMES.get().get(id(x), x.name)
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
    if v.kind != PARAM and v.requires_grad != default_requires_grad(v):   # params say frozen
        text += " requires_grad" if v.requires_grad else " no_grad"
    return text


def default_requires_grad(v: Value) -> bool:
    """What printed IR implies unless it marks the value: a parameter needs a gradient; an
    op's floating output needs one when any of its inputs does; other values do not."""
    if v.producer is None:
        return v.kind == PARAM
    return v.is_tensor and (v.meta.dtype.is_floating_point or v.meta.dtype.is_complex) \
        and any(i.requires_grad for i in v.producer.inputs())


def fmt_wants(op: Op) -> str:
    """`  wants (R, S(1), P)`: the input placements the op's strategy asks for (`*`: any),
    printed only while some input does not have them yet (before insert_comm)."""
    s, tensors = op.strategy, op.tensor_inputs()
    if s is None or not s.note or (len(s.inputs) == len(tensors) and all(
            w is not None and w == v.placement for v, w in zip(tensors, s.inputs))):
        return ""
    return "  wants (" + ", ".join("*" if w is None else repr(w) for w in s.inputs) + ")"


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
    note = f"  [{op.strategy.note}]{fmt_wants(op)}" if op.strategy is not None \
        and op.strategy.note else ""
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


def fmt_header(g: Graph) -> list[str]:
    """plan_ngpus, the stages the passes established and the replicated parameters whose
    gradient the runtime sums over the plan unit (after insert_comm)."""
    stages = ",".join(s.name.lower() for s in Stage if s in g.stages)
    lines = [f"# nncompile IR: plan_ngpus={g.plan_ngpus}" + (f" stages={stages}" if stages
                                                              else "")]
    if g.plan_state.partial_grad_params:
        lines.append(f"# partial_grad_params: {', '.join(g.plan_state.partial_grad_params)}")
    return lines


def print_graph(g: Graph, local_n: int | None = None, source: bool = True) -> str:
    """The whole graph as a Python function `forward`; constants first, marked as such.
    source=False leaves out the user's source-line comments (file paths and line numbers),
    e.g. for the plan fingerprint."""
    lines = fmt_header(g)
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
