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
insert_comm), `wants (R, S(1), P)`. nncompile.ir.parse_graph reads all of it back. An
inserted collective that prepares an input of the next op sits under that op's source line;
one that converts the previous op's output stays under the previous op's line.

Names the code refers to but does not define: `aten` (torch.ops.aten), `torch`, `comm`
(nncompile.runtime.program.comm), `custom` (ops made with nncompile.register_op), `PLAN_GROUP` (the
plan unit's process group) and `DEVICE`.
"""
from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Any

import torch

from ..symbolic import Sym
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


_AXIS_SIZES: contextvars.ContextVar[dict] = contextvars.ContextVar("axis_sizes", default={})


@contextlib.contextmanager
def axis_sizes(sizes: dict[str, int]):
    """Local shapes printed while inside split values along the mesh's other axes too
    (Graph.axes: their sizes)."""
    token = _AXIS_SIZES.set(dict(sizes))
    try:
        yield
    finally:
        _AXIS_SIZES.reset(token)


_NOTES: contextvars.ContextVar[Any] = contextvars.ContextVar("op_notes", default=None)


@contextlib.contextmanager
def op_notes(note):
    """While inside, `note(op)` gives whole-line comments to print above each op (below its
    source line); codegen names each collective's backward this way."""
    token = _NOTES.set(note)
    try:
        yield
    finally:
        _NOTES.reset(token)


def _fmt_list(x: list) -> str:
    return "[" + ", ".join([fmt_literal(e) for e in x]) + "]"


def _fmt_tuple(x: tuple) -> str:
    inner = ", ".join([fmt_literal(e) for e in x])
    return f"({inner},)" if len(x) == 1 else f"({inner})"


# exact types printed without the checks below (a subclass, such as Symbol, takes the long way)
_FAST = {int: repr, str: repr, bool: repr, type(None): repr, torch.dtype: str,
         list: _fmt_list, tuple: _fmt_tuple}


def fmt_literal(x: Any) -> str:
    t = type(x)
    if t is Value:
        return _NAMES.get().get(id(x), x.name)
    fast = _FAST.get(t)
    if fast is not None:
        return fast(x)
    if isinstance(x, Value):
        return _NAMES.get().get(id(x), x.name)
    if isinstance(x, Symbol):
        return str(x)
    if isinstance(x, Sym):
        return x.code()
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
    if isinstance(x, complex):           # a small complex constant (a rotary's freqs_cis)
        return f"complex({fmt_literal(x.real)}, {fmt_literal(x.imag)})"
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


def fmt_axes(v: Value) -> str:
    """A value's placements along the mesh's other axes (Graph.axes): " @cp=S(1)" each."""
    return "".join(f" @{axis}={p!r}" for axis, p in v.axes.items())


def fmt_meta(v: Value, n: int | None = None) -> str:
    meta = v.meta
    if meta is None:
        return ""
    dt = _DTYPES.get(meta.dtype) or str(meta.dtype).replace("torch.", "")
    shape = list(meta.shape)
    if n is not None and (n > 1 or v.axes):
        text = f"{dt}{list(v.local_shape(n, _AXIS_SIZES.get()))} of {shape} {v.placement!r}"
    else:
        text = f"{dt}{shape} {v.placement!r}"
    text += fmt_axes(v)
    if v.kind != PARAM and v.requires_grad != default_requires_grad(v):   # params say frozen
        text += " requires_grad" if v.requires_grad else " no_grad"
    return text


def default_requires_grad(v: Value) -> bool:
    """What printed IR implies unless it marks the value: a parameter needs a gradient; an
    op's floating output needs one when any of its inputs does; other values do not."""
    if v.producer is None:
        return v.kind == PARAM
    return v.meta is not None and (v.meta.dtype.is_floating_point or v.meta.dtype.is_complex) \
        and any(i.requires_grad for i in v.producer.inputs())


def fmt_wants(op: Op) -> str:
    """`  wants (R, S(1), P)`: the input placements the op's strategy asks for (`*`: any),
    printed only while some input does not have them yet (before insert_comm)."""
    return _wants(op.strategy, op.tensor_inputs())


def _wants(s: Any, tensors: list[Value]) -> str:
    if s is None or not s.note or (len(s.inputs) == len(tensors) and all(
            w is not None and w == v.placement for v, w in zip(tensors, s.inputs))):
        return ""
    return "  wants (" + ", ".join("*" if w is None else repr(w) for w in s.inputs) + ")"


def fmt_call(op: Op) -> str:
    return _call(op, _NAMES.get())


def _lit(x: Any, names: dict[int, str]) -> str:
    """fmt_literal with the printed-name map fetched once (the common types first)."""
    t = type(x)
    if t is Value:
        return names.get(id(x), x.name)
    if t is int or t is str or t is bool or x is None:
        return repr(x)
    if t is tuple:
        inner = ", ".join([_lit(e, names) for e in x])
        return f"({inner},)" if len(x) == 1 else f"({inner})"
    if t is list:
        return "[" + ", ".join([_lit(e, names) for e in x]) + "]"
    return fmt_literal(x)


def _call(op: Op, names: dict[int, str]) -> str:
    parts = [_lit(a, names) for a in op.args]
    if op.kwargs:
        parts += [f"{k}={_lit(v, names)}" for k, v in op.kwargs.items()]
    return f"{target_name(op.target)}({', '.join(parts)})"


def _meta(v: Value, n: int | None, inputs_grad: bool) -> str:
    """fmt_meta of an output of the op whose inputs' any-requires_grad is `inputs_grad`."""
    meta = v.meta
    floating = meta.dtype.is_floating_point or meta.dtype.is_complex
    dt = _DTYPES.get(meta.dtype) or str(meta.dtype).replace("torch.", "")
    shape = list(meta.shape)
    if n is not None and (n > 1 or v.axes):
        text = f"{dt}{list(v.local_shape(n, _AXIS_SIZES.get()))} of {shape} {v.placement!r}"
    else:
        text = f"{dt}{shape} {v.placement!r}"
    if v.axes:
        text += fmt_axes(v)
    if v.kind != PARAM and v.requires_grad != (floating and inputs_grad):
        text += " requires_grad" if v.requires_grad else " no_grad"
    return text


def fmt_op(op: Op, indent: str = "    ", local_n: int | None = None,
           source: bool = True) -> list[str]:
    """One op as code; with `source`, its user line as a comment above it."""
    lines = []
    src = op.source
    if source and src is not None:
        lines.append(_source_comment(src, indent))
    note = _NOTES.get()
    if note is not None:
        lines += [f"{indent}# {text}" for text in note(op)]
    outputs = op.outputs
    if op.multi_output:
        lhs = ", ".join(v.name for v in outputs) + ("," if len(outputs) == 1 else "")
    elif outputs:
        lhs = outputs[0].name
    else:
        lhs = ""
    ins = op.inputs()
    inputs_grad = None
    metas = []
    for v in outputs:
        if v.meta is None:
            continue
        if v.producer is op:
            if inputs_grad is None:
                inputs_grad = any(i.requires_grad for i in ins)
            metas.append(_meta(v, local_n, inputs_grad))
        else:
            metas.append(fmt_meta(v, local_n))
    metas = "; ".join(metas)
    s = op.strategy
    note = f"  [{s.note}]{_wants(s, [v for v in ins if v.meta is not None])}" \
        if s is not None and s.note else ""
    if op.float8:                      # a linear run in float8 (passes/float8.py)
        note += f"  float8={op.float8}"
    comment = f"  # {metas}{note}" if metas or note else ""
    call = _call(op, _NAMES.get())
    lines.append(f"{indent}{lhs + ' = ' if lhs else ''}{call}{comment}")
    return lines


def fmt_body(ops: list[Op], indent: str = "    ", local_n: int | None = None,
             source: bool = True, after: list[list[str]] | None = None) -> list[str]:
    """Ops as code, with a source comment wherever the user's line changes (none without
    `source`); `after[i]`: lines printed right after op i (codegen's `del` lines)."""
    lines, last = [], None
    for i, op in enumerate(ops):
        if source and op.source is None and op.target_name.startswith("comm."):
            served = _served(ops, i)    # an inserted collective sits under its consumer's line
            if served is not None and served.source != last:
                lines.append(_source_comment(served.source, indent))
                last = served.source
        lines += fmt_op(op, indent, local_n, source=source and op.source != last)
        if after is not None:
            lines += after[i]
        last = op.source or last        # inserted collectives (no source) do not repeat it
    return lines


def _source_comment(src: Any, indent: str) -> str:
    return f"{indent}# {src.file}:{src.line}  {src.code}"


def _served(ops: list[Op], i: int) -> Op | None:
    """The op an inserted collective ops[i] is for, when it prepares an input of the next op
    with a user line (possibly through more inserted ops) and does not convert the output of
    the op just before it (an all_reduce after a linear stays under the linear's line)."""
    op = ops[i]
    if i > 0 and any(v.producer is ops[i - 1] for v in op.tensor_inputs()):
        return None
    want = {id(v) for v in op.outputs}
    for nxt in ops[i + 1:]:
        uses = any(id(v) in want for v in nxt.inputs())
        if nxt.source is not None:
            return nxt if uses else None
        if uses:
            want.update(id(v) for v in nxt.outputs)
    return None


def fmt_input(v: Value, local_n: int | None = None) -> str:
    kind = f"frozen {v.kind}" if v.kind == PARAM and not v.requires_grad else v.kind
    origin = f"{kind} {v.fqn!r} " if v.fqn else (f"{kind} " if v.kind != "input" else "")
    if v.part is not None:     # a piece of a fused parameter: (source, shape, view, box, groups)
        p = v.part
        origin += f"part{(p.source, p.source_shape, p.view, p.box, p.groups)!r} "
    return f"{v.name},  # {origin}{fmt_meta(v, local_n)}"


def fmt_header(g: Graph) -> list[str]:
    """plan_ngpus, the mesh's other axes (Graph.axes, when there are any), the stages the
    passes established and the replicated parameters whose
    gradient the runtime sums over the plan unit (after insert_comm)."""
    stages = ",".join(s.name.lower() for s in Stage if s in g.stages)
    axes = ",".join(f"{a}:{size}" for a, size in g.axes.items())
    lines = [f"# nncompile IR: plan_ngpus={g.plan_ngpus}" + (f" axes={axes}" if axes else "")
             + (f" stages={stages}" if stages else "")]
    if g.plan_state.partial_grad_params:
        lines.append(f"# partial_grad_params: {', '.join(g.plan_state.partial_grad_params)}")
    return lines


def print_graph(g: Graph, local_n: int | None = None, source: bool = True) -> str:
    """The whole graph as a Python function `forward`; constants first, marked as such.
    source=False leaves out the user's source-line comments (file paths and line numbers),
    e.g. for the plan fingerprint."""
    with axis_sizes(g.axes):
        return _print_graph(g, local_n, source)


def _print_graph(g: Graph, local_n: int | None, source: bool) -> str:
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


def print_graph_texts(g: Graph, local_n: int | None = None) -> tuple[str, str]:
    """(print_graph(g, local_n), print_graph(g, local_n, source=False)), each op formatted
    once for both."""
    with axis_sizes(g.axes):
        return _print_graph_texts(g, local_n)


def _print_graph_texts(g: Graph, local_n: int | None) -> tuple[str, str]:
    lines = fmt_header(g)
    lines.append("def forward(")
    lines += [f"    {fmt_input(v, local_n)}" for v in g.inputs]
    kw = g.params + g.buffers
    if kw:
        lines.append("    *,")
        lines += [f"    {fmt_input(v, local_n)}" for v in kw]
    lines.append("):")
    with_source, without = list(lines), lines

    def body(ops: list[Op]) -> None:
        last = None
        for op in ops:
            src = op.source
            if src is not None and src != last:
                with_source.append(f"    # {src.file}:{src.line}  {src.code}")
            line = fmt_op(op, "    ", local_n, source=False)
            with_source.extend(line)
            without.extend(line)
            last = src or last

    if g.const_ops:
        for out in (with_source, without):
            out.append("    # ---- constants: evaluated once at load time ----")
        body(g.const_ops)
        for out in (with_source, without):
            out.append("    # ---- forward ----")
    body(g.ops)
    ret = f"    return {fmt_literal(tuple(g.outputs))}"
    with_source.append(ret)
    without.append(ret)
    return "\n".join(with_source) + "\n", "\n".join(without) + "\n"
