"""forward's arguments as traced, and how a call maps onto the traced tensor inputs.

torch.export flattens forward's arguments: tensors become graph inputs, and `None`, `bool`,
`int`, `float` and `str` values are constants compiled into the program. A dict, tuple, list
or dataclass argument (`forward(self, batch)`) is flattened into its tensors. The generated
module records each argument as it was traced:

    ARGS = [  # argument, its structure, its leaves: ('input', name) or ('const', value)
        ('batch', "TreeSpec(dict, ['x', 'y'], [*, *])", [('input', 'batch_x'), ('input', 'batch_y')]),
        ('use_cache', '*', [('const', False)]),
    ]

so `pm(batch, use_cache=False)` is called like the original module: arguments bind to forward's
signature by position or name, each is flattened the same way and its tensors are checked and
passed in the traced order. A constant must be given its traced value (the code was compiled
for it); an argument the trace left at its default may be passed with that default only. An
int or float that changes per call is named in parallelize's `scalar_inputs` and traced as a
0-d tensor input (scalars_as_inputs); a call may pass it as a Python number or a 0-d tensor.
"""
from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import torch
from torch.utils import _pytree as pytree

from nncompile.errors import ConfigError, InputMismatchError

CONSTANT_TYPES = (type(None), bool, int, float, str)


def _is_leaf(x: Any) -> bool:
    return x is None or isinstance(x, torch.Tensor)


def register_dataclasses(value: Any) -> None:
    """Make dataclass arguments flattenable (torch.export needs them registered)."""
    def visit(x):
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            cls = type(x)
            if cls not in pytree.SUPPORTED_NODES:
                torch.export.register_dataclass(
                    cls, serialized_type_name=f"{cls.__module__}.{cls.__qualname__}")
            for f in dataclasses.fields(x):
                visit(getattr(x, f.name))
        elif isinstance(x, (list, tuple)):
            for e in x:
                visit(e)
        elif isinstance(x, dict):
            for e in x.values():
                visit(e)
    visit(value)


def flatten(value: Any) -> tuple[list[Any], str]:
    """(leaves, structure text): tensors and constants are leaves, containers are not."""
    leaves, spec = pytree.tree_flatten(value, is_leaf=_is_leaf)
    return leaves, "*" if spec.is_leaf() else " ".join(str(spec).split())


def scalars_as_inputs(module: torch.nn.Module, dummy_args: Any, names) -> Any:
    """dummy_args with the arguments named in `names` (Python ints or floats that change per
    call: a token count, a loss scale, a step number) as 0-d tensors, so they are traced as
    run-time inputs of the one program instead of constants compiled into it:

        before: pm(x, num_items_in_batch=412) -> InputMismatchError at the next count
        after:  parallelize(..., scalar_inputs=["num_items_in_batch"]); any int is passed
    """
    if not names:
        return dummy_args
    if isinstance(names, str):
        names = [names]
    positional, _ = literal_defaults(module.forward)
    if isinstance(dummy_args, dict):
        given = dict(dummy_args)
    elif isinstance(dummy_args, (tuple, list)):
        given = dict(zip(positional, dummy_args))
    else:
        given = {positional[0] if positional else "arg0": dummy_args}
    for name in names:
        if name not in given:
            raise ConfigError(f"scalar_inputs names {name!r}, but dummy_args has no argument "
                              f"{name!r} (it has {list(given)}); give it a value to trace with")
        value = given[name]
        if isinstance(value, torch.Tensor) and value.dim() == 0:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"scalar_inputs: dummy_args[{name!r}] is {_show(value)}; a "
                              "scalar input is a Python int or float (or a 0-d tensor)")
        dtype = torch.int64 if isinstance(value, int) else torch.get_default_dtype()
        device = next((leaf.device for leaf in pytree.tree_leaves(dummy_args)
                       if isinstance(leaf, torch.Tensor)), None)
        given[name] = torch.tensor(value, dtype=dtype, device=device)
    if isinstance(dummy_args, dict):
        return given
    if isinstance(dummy_args, (tuple, list)):
        return type(dummy_args)(given[n] for n in positional[:len(dummy_args)])
    return next(iter(given.values()))


def as_scalar_tensor(value: Any, dtype: torch.dtype, device: torch.device) -> Any:
    """A Python int or float passed for a 0-d tensor input (scalar_inputs): that tensor."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return torch.tensor(value, dtype=dtype, device=device)
    return value


def entries(positional: list[str], args: tuple, kwargs: dict) -> list[tuple[str, Any]]:
    """(argument name, value) in the order torch.export flattens (args, kwargs)."""
    named = [(positional[i] if i < len(positional) else f"arg{i}", a) for i, a in enumerate(args)]
    return named + list(kwargs.items())


def check_constants(items: list[tuple[str, Any]]) -> None:
    """Refuse leaves torch.export would turn into something we cannot compare or record."""
    for name, value in items:
        for leaf in flatten(value)[0]:
            if not isinstance(leaf, (torch.Tensor, *CONSTANT_TYPES)):
                raise ConfigError(
                    f"dummy_args[{name!r}] holds a {type(leaf).__qualname__}; arguments may be "
                    "tensors, None, bool, int, float, str, or dicts/lists/tuples/dataclasses of "
                    "them. Pass it another way (a module attribute) or convert it.")


def record(items: list[tuple[str, Any]], input_names: list[str]) -> list[tuple]:
    """ARGS rows for the traced arguments; tensor leaves take the traced input names in order."""
    names = iter(input_names)
    rows = []
    for name, value in items:
        leaves, structure = flatten(value)
        refs = [("input", next(names)) if isinstance(leaf, torch.Tensor) else ("const", leaf)
                for leaf in leaves]
        rows.append((name, structure, refs))
    return rows


def literal_defaults(fn) -> tuple[list[str], dict[str, Any]]:
    """forward's positional parameter names, and its parameters' constant defaults."""
    params = inspect.signature(fn).parameters.values()
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    defaults = {p.name: p.default for p in params
                if p.default is not p.empty and isinstance(p.default, CONSTANT_TYPES)}
    return positional, defaults


def tensor_leaves(module: torch.nn.Module, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors of a call of `module`, in the order its traced inputs take them."""
    positional, _ = literal_defaults(module.forward)
    return [leaf for _, value in entries(positional, args, kwargs) for leaf in flatten(value)[0]
            if isinstance(leaf, torch.Tensor)]


def _same(a: Any, b: Any) -> bool:
    return type(a) is type(b) and a == b


def _show(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {str(value.dtype).removeprefix('torch.')}{list(value.shape)} tensor"
    return repr(value) if isinstance(value, CONSTANT_TYPES) else f"a {type(value).__qualname__}"


def _plain(pm) -> tuple[list[tuple[str, str]], bool] | None:
    """[(argument, traced input)] when every traced argument is one tensor (the common
    `forward(self, idx, targets)`), and whether they are forward's first positional
    parameters in that order; None otherwise. Cached on the module."""
    try:
        return pm.__dict__["_plain_args"]
    except KeyError:
        pass
    plain = None
    if all(structure == "*" and len(refs) == 1 and refs[0][0] == "input"
           for _, structure, refs in pm.ARGS):
        pairs = [(name, refs[0][1]) for name, _, refs in pm.ARGS]
        plain = (pairs, [n for n, _ in pairs] == list(pm.SIGNATURE[:len(pairs)]))
    pm.__dict__["_plain_args"] = plain
    return plain


def bind(pm, args: tuple, kwargs: dict) -> list[tuple[str, Any]]:
    """[(traced input name, value)] for a call of the generated module, in traced order."""
    plain = _plain(pm)
    if plain is not None:      # one tensor per argument, all given by position or all by name
        pairs, positional = plain
        if not kwargs and positional and len(args) == len(pairs):
            return [(ref, value) for (_, ref), value in zip(pairs, args)]
        if not args and len(kwargs) == len(pairs) and all(n in kwargs for n, _ in pairs):
            return [(ref, kwargs[name]) for name, ref in pairs]
    given: dict[str, Any] = {}
    for name, value in entries(list(pm.SIGNATURE), args, kwargs):
        if name in given:
            raise InputMismatchError(f"argument {name!r} given twice")
        given[name] = value
    traced = [row[0] for row in pm.ARGS]
    out = []
    for name, structure, refs in pm.ARGS:
        if name not in given:
            raise InputMismatchError(f"missing argument {name!r}; the module was traced with "
                                     f"{traced}")
        value = given.pop(name)
        if structure == "*":
            leaves = [value]
        else:
            leaves, got = flatten(value)
            if got != structure:
                raise InputMismatchError(
                    f"argument {name!r} has the structure {got}, but the module was traced with "
                    f"{structure}; pass it in the traced form")
        for leaf, (kind, ref) in zip(leaves, refs):
            if kind == "input":
                out.append((ref, leaf))
            elif not _same(leaf, ref):
                where = name if structure == "*" else f"a value inside {name!r}"
                changing = isinstance(leaf, (int, float)) and not isinstance(leaf, bool) \
                    and structure == "*"
                fix = (f"if it changes from call to call, parallelize with scalar_inputs="
                       f"[{name!r}] to make it a run-time input; else call parallelize again "
                       f"with this value") if changing else "call parallelize again with this value"
                raise InputMismatchError(
                    f"argument {where} is {_show(leaf)}, but the module was traced with "
                    f"{ref!r}, a constant compiled into the code; {fix} in dummy_args "
                    f"(another instance_name) to get code for it")
    for name, value in given.items():
        default = pm.DEFAULTS.get(name, inspect.Parameter.empty)
        if _same(value, default):
            continue
        if name not in pm.SIGNATURE and name not in pm.DEFAULTS:
            raise InputMismatchError(f"unexpected argument {name!r}; the module was traced with "
                                     f"{traced}")
        raise InputMismatchError(
            f"argument {name!r} is {_show(value)}, but the module was traced without it (with "
            f"its default{'' if default is inspect.Parameter.empty else ' ' + repr(default)}); "
            f"add it to dummy_args to compile it in")
    return out
