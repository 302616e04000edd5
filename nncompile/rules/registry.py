"""Op rules: for an op and a plan size n, the list of legal strategies (ways to split it).

A rule is `rule(op, n) -> list[Strategy]`; strategies name one placement per flattened tensor
input and per output. Every op can run replicated, so the replicate strategy is always offered
(last); an op with no rule is only replicated, never an error.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
from typing import Callable, Iterable, Iterator

from ..ir import BUFFER, PARAM, Op, Placement, Replicate, Strategy, StridedShard, Value

Rule = Callable[[Op, int], list[Strategy]]
RULES: dict[str, Rule] = {}


# ops whose random draw runtime/program/rng.py makes plan-independent (see localize)
RANDOM_LOCAL = {"dropout": "rng.dropout", "native_dropout": "rng.native_dropout",
                "scaled_dot_product_attention": "rng.scaled_dot_product_attention"}


def draws_random(op: Op) -> bool:
    """Whether `op` draws random numbers: dropout with p > 0 in training, or attention with
    dropout_p > 0."""
    name = getattr(op.target, "_opname", None)
    if name == "scaled_dot_product_attention":
        p = op.args[4] if len(op.args) > 4 else op.kwargs.get("dropout_p", 0.0)
        return bool(p)
    if name in ("dropout", "native_dropout"):
        p, train = (list(op.args[1:3]) + [op.kwargs.get("train", True)])[:2]
        return bool(p) and train is not False
    return False


def register(*names: str) -> Callable[[Rule], Rule]:
    """Register a rule for aten op names ('linear') or overloads ('split.Tensor')."""
    def deco(fn: Rule) -> Rule:
        for name in names:
            RULES[name] = fn
        return fn
    return deco


# op name -> fn(op, n) that rewrites a localized op's non-size arguments for one rank's
# shards (passes/localize.py), e.g. a grouped convolution split by groups runs groups // n
LOCAL_ARGS: dict[str, Callable[[Op, int], None]] = {}


# (op, its tensor inputs) while strategies(op) runs: the rules ask for them once per strategy
_CURRENT: list = [None, None]


def tensor_inputs_of(op: Op) -> list[Value]:
    """op.tensor_inputs(), computed once per strategies() call (do not modify the list)."""
    if _CURRENT[0] is op:
        return _CURRENT[1]
    return op.tensor_inputs()


def replicated(op: Op) -> Strategy:
    return Strategy(tuple(Replicate() for _ in tensor_inputs_of(op)),
                    tuple(Replicate() for _ in op.outputs), "replicate")


def make(op: Op, places: dict[Value, Placement], outputs: Iterable[Placement], note: str,
         local_target=None) -> Strategy:
    """A strategy from a {input value: placement} map (unlisted inputs replicate)."""
    ins = tuple(places.get(v, Replicate()) for v in tensor_inputs_of(op))
    return Strategy(ins, tuple(outputs), note, local_target)


def register_custom(key: str, annotation) -> None:
    """The rule of a custom op ('nncompile::my_op'): an einsum-like annotation or a rule."""
    if callable(annotation):
        RULES[key] = annotation
    else:
        from .einsum import einsum_strategies
        RULES[key] = lambda op, n: einsum_strategies(op, op.tensor_inputs(), annotation, n)


def lookup(op: Op) -> Rule | None:
    target = op.target
    if isinstance(target, str):
        return None
    name = getattr(target, "_opname", None)
    namespace = getattr(target, "namespace", "aten")
    if namespace != "aten":
        return RULES.get(f"{namespace}::{name}")
    overload = f"{name}.{getattr(target, '_overloadname', '')}"
    return RULES.get(overload) or RULES.get(name)


# Strided splits (StridedShard: heads split inside a merged batch-and-heads dim) are offered only
# inside `strided_splits()`: the tp policy keeps them within communication-free regions; the
# other policies and the cost model see plain splits only.
_STRIDED: contextvars.ContextVar[bool] = contextvars.ContextVar("strided_splits", default=False)


@contextlib.contextmanager
def strided_splits(on: bool = True) -> Iterator[None]:
    """Rules offer strided splits while in the block (in this thread: ranks compiling side by
    side in threads do not see each other's setting)."""
    token = _STRIDED.set(on)
    try:
        yield
    finally:
        _STRIDED.reset(token)


def strided_ok() -> bool:
    """Whether rules offer strided splits now (see strided_splits)."""
    return _STRIDED.get()


def outers(size: int, n: int) -> list[int]:
    """Outer factors o > 1 of a dim of `size` whose strided split StridedShard(d, o) divides
    by n (none outside strided_splits())."""
    if not _STRIDED.get() or type(size) is not int or size % n:
        return []                   # a dynamic size (symbolic.Sym): no strided split
    return _divisors(size // n)


@functools.lru_cache(maxsize=4096)
def _divisors(m: int) -> list[int]:
    """Divisors of m above 1, ascending."""
    small = [d for d in range(2, int(m ** 0.5) + 1) if m % d == 0]
    return sorted(set(small + [m // d for d in small] + ([m] if m > 1 else [])))


def _strided_ok(op: Op, s: Strategy) -> bool:
    """A strided split is offered only when asked for, with a static outer factor, and never
    for a parameter or buffer (state, whose shards are boxes of the original tensor; a
    constant is chunked at use)."""
    strided = [p for p in (*s.inputs, *s.outputs) if isinstance(p, StridedShard)]
    if not strided:
        return True
    if any(type(p.outer) is not int for p in strided):
        return False                # blocks of a dynamic size: their layout changes per call
    return _STRIDED.get() and not any(isinstance(p, StridedShard) and v.kind in (PARAM, BUFFER)
                                   for v, p in zip(tensor_inputs_of(op), s.inputs))


def strategies(op: Op, mesh: "int | Mesh") -> list[Strategy]:
    """All legal strategies of `op` on a mesh (or n ranks of the plan axis) along its "plan"
    axis; the replicate strategy comes last."""
    n = mesh if isinstance(mesh, int) else mesh.size("plan")
    out: list[Strategy] = []
    saved = _CURRENT[:]
    _CURRENT[:] = [op, op.tensor_inputs()]
    try:
        rule = lookup(op)
        if n > 1 and rule is not None:
            seen = set()
            for s in rule(op, n):
                key = (s.inputs, s.outputs)
                if key not in seen and s.is_split and _strided_ok(op, s):
                    seen.add(key)
                    out.append(s)
        out.append(replicated(op))
    finally:
        _CURRENT[:] = saved
    return out


def divisible(v: Value, dim: int, n: int) -> bool:
    return v.is_tensor and 0 <= dim < len(v.meta.shape) and v.meta.shape[dim] % n == 0 \
        and v.meta.shape[dim] >= n
