"""Custom ops: a user's function (or torch.autograd.Function) as one op with a sharding rule.

    class MyLinear(torch.autograd.Function): ...
    my_linear = nncompile.register_op(MyLinear, "* k+, n k+ -> * n")
    y = my_linear(x, self.weight)        # in the model's forward

Tracing sees one leaf op, `torch.ops.nncompile.my_linear` (a torch.library custom op whose
shapes come from running the function on fake tensors); the plan splits it by the annotation
(nncompile/rules/einsum.py: `k+` contracted, `^` never split, `=` added to the result, or a
callable rule(op, n) -> strategies); generated code calls it as `custom.my_linear(...)`,
which runs the user's function on this rank's shards (its own autograd included). Outside
tracing the returned callable simply runs the function.
"""
from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .errors import ConfigError, NNCompileError

NAMESPACE = "nncompile"
_SCALARS = {int: "SymInt", float: "float", bool: "bool", str: "str"}


@dataclass
class CustomOp:
    name: str
    impl: Callable            # fn, or the autograd.Function's apply
    annotation: Any           # einsum-like string or rule(op, n) -> list[Strategy]
    origin: str               # where the function is defined, for generated-code comments
    params: list[str]         # schema argument types, in order

    def __call__(self, *args):
        if torch.compiler.is_exporting():
            return getattr(getattr(torch.ops, NAMESPACE), self.name)(*args)
        return self.impl(*args)


REGISTRY: dict[str, CustomOp] = {}


def is_custom_op(target: Any) -> bool:
    """Whether an IR op's target is an op made with register_op."""
    return getattr(target, "namespace", None) == NAMESPACE


def _signature(fn: Callable, is_function: bool) -> list[tuple[str, str]]:
    """[(argument name, schema type)]: annotated or defaulted ints/floats/bools/strs are
    scalars, everything else a Tensor."""
    params = list(inspect.signature(fn.forward if is_function else fn).parameters.values())
    if is_function:
        params = params[1:]                 # ctx
    out = []
    for p in params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise ConfigError(f"register_op: {fn.__name__} takes *{p.name}; custom ops need "
                              "a fixed list of arguments")
        kind = p.annotation if p.annotation in _SCALARS else type(p.default) \
            if p.default is not inspect.Parameter.empty else None
        out.append((p.name, _SCALARS.get(kind, "Tensor")))
    return out


def _check_annotation(annotation: Any, args: list[tuple[str, str]], name: str) -> None:
    if callable(annotation):
        return
    if not isinstance(annotation, str) or "->" not in annotation:
        raise ConfigError(f"register_op({name!r}): annotation must be an einsum-like string "
                          "such as '* k+, n k+ -> * n' or a rule(op, n) -> strategies, got "
                          f"{annotation!r}")
    lhs, rhs = annotation.split("->")
    operands = lhs.split(",")
    tensors = [a for a, t in args if t == "Tensor"]
    if len(operands) != len(tensors):
        raise ConfigError(f"register_op({name!r}): the annotation {annotation!r} names "
                          f"{len(operands)} operand(s) but the function takes {len(tensors)} "
                          f"tensor(s) {tensors}; give one comma-separated entry per tensor")
    if "," in rhs:
        raise ConfigError(f"register_op({name!r}): custom ops return one tensor; the "
                          f"annotation's output {rhs.strip()!r} names several")


def register_op(fn: Callable, annotation: Any, *, name: str | None = None) -> CustomOp:
    """Make `fn` (a function or a torch.autograd.Function subclass) one op with a sharding
    rule; call the returned object in the model's forward instead of `fn`."""
    is_function = isinstance(fn, type) and issubclass(fn, torch.autograd.Function)
    if not is_function and not callable(fn):
        raise ConfigError(f"register_op needs a function or a torch.autograd.Function "
                          f"subclass, got {type(fn).__name__}")
    name = name or re.sub(r"(?<!^)(?=[A-Z])", "_", fn.__name__).lower()
    if not name.isidentifier():
        raise ConfigError(f"register_op: {name!r} is not a valid op name; pass name=")
    args = _signature(fn, is_function)
    _check_annotation(annotation, args, name)
    impl = fn.apply if is_function else fn
    try:
        origin = f"{fn.__module__}.{fn.__qualname__}{'.apply' if is_function else ''}"
    except AttributeError:
        origin = repr(fn)
    types = [t for _, t in args]
    old = REGISTRY.get(name)
    if old is not None and old.params != types:
        raise ConfigError(f"register_op: op {name!r} is already registered with arguments "
                          f"{old.params}; pick another name=")
    op = CustomOp(name, impl, annotation, origin, types)
    REGISTRY[name] = op
    if old is None:
        _define(name, args)
    from .rules.registry import register_custom
    register_custom(f"{NAMESPACE}::{name}", op.annotation)
    return op


def _define(name: str, args: list[tuple[str, str]]) -> None:
    """The torch.library op tracing records; its kernels look the function up by name, so
    registering the same name again (a re-run notebook cell) swaps the implementation."""
    schema = "(" + ", ".join(f"{t} {a}" for a, t in args) + ") -> Tensor"

    def kernel(*a):
        with torch.no_grad():
            out = REGISTRY[name].impl(*a)
        return out.clone() if out._is_view() or any(out is x for x in a) else out

    lib_op = torch.library.custom_op(f"{NAMESPACE}::{name}", kernel, mutates_args=(),
                                     schema=schema)
    lib_op.register_fake(kernel)


class _Namespace:
    """`custom.<name>` in generated code: the registered function, on local shards."""

    def __getattr__(self, name: str) -> Callable:
        if name.startswith("__"):
            raise AttributeError(name)
        op = REGISTRY.get(name)
        if op is None:
            raise NNCompileError(
                f"generated code calls custom op {name!r}, which is not registered in this "
                "process; import the module that calls nncompile.register_op(..., "
                f"name={name!r}) before loading the parallel module")
        return op.impl


custom = _Namespace()


def annotation_flops(op_name: str, shapes: list[tuple[int, ...]]) -> float | None:
    """Forward FLOPs of an annotated custom op from its operand shapes: 2 x the product of
    every label's size when something is contracted, else None (the caller's default)."""
    from .rules.einsum import _labels
    op = REGISTRY.get(op_name)
    if op is None or not isinstance(op.annotation, str) or "+" not in op.annotation:
        return None
    sizes: dict[str, int] = {}
    for spec, shape in zip(op.annotation.split("->")[0].split(","), shapes):
        sizes.update(zip(_labels(spec.strip().lstrip("="), len(shape)), shape))
    total = 2.0
    for size in sizes.values():
        total *= size
    return total
