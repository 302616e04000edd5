"""`verify_sizes(graph)`: under dynamic_dims, every op still follows the dynamic sizes.

A pass that builds an op from traced values can bake a dynamic size into it: its shape
argument, or its output's shape, holds the traced batch or sequence as a literal. The program
then fails at any other size, or, at a size with the traced element count, silently reads
the wrong elements:

    traced at (s_batch, s_seq) = (2, 16):
        good:  v = aten.reshape.default(x, [s_batch, 1, s_seq, 16])
        baked: v = aten.reshape.default(x, [2, 1, 16, 16])   # fails at (3, 12); wrong at (4, 8)

The check moves every dynamic size one allowed step from its traced value (keeping its range
and multiple), then runs each aten op of the graph on the meta device with its inputs shaped
as their Values are at those sizes (one rank's shard once the graph is localized). The
outputs must come out shaped as the op's output Values are there. An op that cannot run on
the meta device at the traced sizes either (data-dependent, a collective, a local
implementation) is not checked. `run_pipeline` runs this on every compile with dynamic dims
and names the pass that first built the offending op.
"""
from __future__ import annotations

import math
from typing import Any

import sympy
import torch
from torch.utils import _pytree as pytree

from ..custom_ops import is_custom_op
from ..errors import GraphError
from ..symbolic import _SPECS, Sym
from .graph import Graph, Op, Stage, Value
from .printer import DEVICE, Symbol


class _Skip(Exception):
    """The op has an argument the meta device cannot take: not checked."""


def _traced(graph: Graph) -> dict[sympy.Symbol, tuple[int, int]]:
    """Each size symbol of the graph's inputs: (its traced value, the multiple an input's
    dim is of it)."""
    hints: dict[sympy.Symbol, tuple[int, int]] = {}
    for v in graph.inputs:
        for s in (v.meta.shape if v.meta is not None else ()):
            if not isinstance(s, Sym):
                continue
            coeff, rest = s.expr.as_coeff_Mul()
            if isinstance(rest, sympy.Symbol) and int(s) % int(coeff) == 0:
                hints.setdefault(rest, (int(s) // int(coeff), int(coeff)))
    return hints


def second_point(graph: Graph) -> dict[sympy.Symbol, int]:
    """Each size symbol of the graph's inputs moved one allowed step from its traced value:
    {symbol: its value there}, a size that cannot move at its traced value. Empty when no
    size can move (or there are none)."""
    point, moved = {}, False
    for sym, (value, _) in _traced(graph).items():
        point[sym] = value
        spec = _SPECS.get(sym.name)
        unit = spec.multiple_of if spec is not None else 1       # the size is unit * symbol
        lo, hi, mult = graph.trace_info.sizes.get(spec.var if spec else sym.name,
                                                  (2, 2 ** 31 - 1, 1))
        step = math.lcm(unit, mult)
        for size in (value * unit + step, value * unit - step):
            if lo <= size <= hi:
                point[sym], moved = size // unit, True
                break
    return point if moved else {}


def _at(x: Any, point: dict) -> Any:
    """A size (Sym) at `point`; other literals unchanged."""
    if isinstance(x, Sym):
        e = sympy.sympify(x.expr.xreplace({k: sympy.Integer(v) for k, v in point.items()}))
        return int(e) if e.is_Integer else int(sympy.floor(e))
    return x


def _shape(v: Value, graph: Graph, point: dict | None) -> tuple[int, ...]:
    shape = v.local_shape(graph.plan_ngpus, graph.axes) if Stage.LOCALIZED in graph.stages \
        else v.meta.shape
    return tuple(_at(s, point) if point else int(s) for s in shape)


def _run(op: Op, graph: Graph, point: dict | None) -> list[tuple[int, ...]]:
    """The op's output shapes when run on the meta device at `point` (None: as traced)."""
    def arg(x: Any) -> Any:
        if isinstance(x, Value):
            if not x.is_tensor:
                raise _Skip
            return torch.empty(_shape(x, graph, point), dtype=x.meta.dtype, device="meta")
        if isinstance(x, Symbol):
            if hasattr(x, "train"):             # a mode argument (nncompile/modes.py)
                return x.train
            if x == DEVICE:
                return torch.device("meta")
            raise _Skip                         # a process group: not a meta-device op
        if isinstance(x, torch.device):
            return torch.device("meta")
        return _at(x, point) if point else (int(x) if isinstance(x, Sym) else x)

    args, kwargs = pytree.tree_map(arg, (op.args, op.kwargs))
    out = op.target(*args, **kwargs)
    outs = out if op.multi_output else [out]
    return [tuple(o.shape) if isinstance(o, torch.Tensor) else None for o in outs]


def _expected(op: Op, graph: Graph, point: dict | None) -> list:
    return [_shape(v, graph, point) if v.is_tensor else None for v in op.outputs]


def op_problem(op: Op, graph: Graph, point: dict) -> str | None:
    """What goes wrong with `op` at the sizes `point`, or None when its shapes follow them
    (or it cannot be run on the meta device: then it is not checked)."""
    if not isinstance(op.target, torch._ops.OpOverload) or is_custom_op(op.target) \
            or not op.outputs:
        return None
    try:
        want = _expected(op, graph, point)
        got = _run(op, graph, point)
        if got == want:
            return None
        problem = f"gives {_fmt(got)} where its outputs are {_fmt(want)}"
    except _Skip:
        return None
    except Exception as e:      # noqa: BLE001 -- a failure only counts if it is new
        problem = f"fails: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
    try:                        # as traced, does it run and agree? (else: not checkable)
        if _run(op, graph, None) != _expected(op, graph, None):
            return None
    except Exception:           # noqa: BLE001
        return None
    return problem


def first_baked_op(graph: Graph, point: dict) -> tuple[Op, str] | None:
    """The first op whose shapes do not follow the sizes at `point`, with what went wrong."""
    for op in graph.const_ops + graph.ops:
        problem = op_problem(op, graph, point)
        if problem is not None:
            return op, problem
    return None


def verify_sizes(graph: Graph, history: list[tuple[str, Graph, float]] | None = None) -> Graph:
    """Raise GraphError naming the op (and, from `history`, the pass that built it) whose
    shapes hold a dynamic size's traced value; return the graph unchanged otherwise."""
    if not graph.trace_info.sizes:
        return graph
    point = second_point(graph)
    if not point:
        return graph
    found = first_baked_op(graph, point)
    if found is None:
        return graph
    op, problem = found
    culprit = "a pass"
    for name, g, _ in history or []:        # the first stage where that op is bad
        same = next((o for o in g.const_ops + g.ops if o.name == op.name), None)
        if same is not None and op_problem(same, g, point) is not None:
            culprit = f"pass {name!r}" if name != "trace" else "the frontend (trace)"
            break
    sizes = _sizes(point)
    traced = _sizes({s: v for s, (v, _) in _traced(graph).items()})
    text = op.source.code.strip() if op.source is not None else op.module_path
    raise GraphError(
        f"{culprit} built op {op.name} ({op.target_name}) with a dynamic size baked in as its "
        f"traced value ({traced}): at {sizes} it {problem}. Args: {_fmt(op.args)}"
        + (f"; source: {text}" if text else "")
        + ". A pass that builds or rewrites shape arguments must keep the sizes' symbols "
        "(nncompile.symbolic.keep_symbols)")


def _sizes(values: dict[sympy.Symbol, int]) -> str:
    """"s_batch=3, s_seq=17": the symbols' values as the user's named sizes."""
    out = []
    for sym, v in sorted(values.items(), key=str):
        spec = _SPECS.get(sym.name)
        out.append(f"{spec.var}={v * spec.multiple_of}" if spec else f"{sym.name}={v}")
    return ", ".join(out)


def _fmt(x: Any) -> str:
    if isinstance(x, (list, tuple)):
        return "[" + ", ".join(_fmt(i) for i in x) + "]"
    return str(x.name) if isinstance(x, Value) else str(x)


__all__ = ["verify_sizes", "second_point", "first_baked_op"]
