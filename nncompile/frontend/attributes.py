"""Tensors forward keeps on the module while it is traced.

torch.export runs forward on fake tensors (shapes, no data) that belong to one export. A
forward that keeps a tensor (a router's capacity jitter kept for its auxiliary loss, a cached
mask) keeps a fake one:

    self.noise = torch.rand_like(logits) * self.eps        # an attribute forward adds
    self.stats.noise = noise                               # on an object the module holds

torch puts back the module attributes that existed before the export, but not one that forward
added, nor what it wrote into an object, dict or list the module holds. Such a tensor outlives
its export: the user's module holds it afterwards, and the next export (the eval-mode trace,
the full trace after a layer-replay attempt, the next compile) reads it as a constant of a
finished trace and fails ("We found a fake tensor in the exported program constant's list", or
a size symbol of the old trace where a number belongs).

`kept(module)` runs one export with the places reachable from the module (its submodules'
attributes, and the objects, dicts and lists they hold, a few levels deep) as they were:

- a fake tensor the export wrote there is undone afterwards (the earlier value put back, or the
  new entry removed); other writes stay;
- a fake tensor already there (left by an export outside nncompile) is hidden from the export
  and put back afterwards, so no trace reads another trace's tensor.

    before: parallelize(router) -> router.noise is a FakeTensor; the eval-mode trace fails
    after:  router.noise as it was before the compile (absent); each trace draws its own
"""
from __future__ import annotations

import contextlib
import types
from typing import Any, Iterator

import torch
from torch._subclasses.fake_tensor import is_fake

_DEPTH = 3                  # levels of objects below a module's attributes that are looked at
_MODULE_OWN = frozenset(vars(torch.nn.Module()))     # torch's bookkeeping: not user values
_OPAQUE = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType,
           types.MethodType, torch.Tensor, torch.nn.Module, str, bytes)


def _entries(obj: Any) -> dict | None:
    """The values a place holds by key: a module's own attributes, an object's __dict__, a
    dict's items, a list's items (by index); None for anything else."""
    if isinstance(obj, torch.nn.Module):
        return {k: v for k, v in vars(obj).items() if k not in _MODULE_OWN}
    if isinstance(obj, dict):
        return dict(obj)
    if isinstance(obj, list):
        return dict(enumerate(obj))
    if isinstance(obj, _OPAQUE):
        return None
    d = getattr(obj, "__dict__", None)
    return dict(d) if type(d) is dict else None


def _holds_fake(value: Any, depth: int = _DEPTH) -> bool:
    if isinstance(value, torch.Tensor):
        return is_fake(value)
    if depth == 0 or isinstance(value, _OPAQUE):
        return False
    if isinstance(value, (tuple, set, frozenset)):
        return any(_holds_fake(v, depth - 1) for v in value)
    entries = _entries(value)
    return entries is not None and any(_holds_fake(v, depth - 1) for v in entries.values())


def _places(module: torch.nn.Module) -> list[tuple[Any, dict]]:
    """(place, its entries now) for every place reachable from the module: each submodule,
    and the objects, dicts and lists below their attributes down to _DEPTH levels."""
    seen: set[int] = set()
    out = []
    todo = [(m, 0) for m in module.modules()]
    while todo:
        obj, depth = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        entries = _entries(obj)
        if entries is None:
            continue
        out.append((obj, entries))
        if depth < _DEPTH:
            todo.extend((v, depth + 1) for v in entries.values()
                        if not isinstance(v, torch.nn.Module))
    return out


def _put(obj: Any, key: Any, value: Any) -> None:
    if isinstance(obj, (dict, list)):
        obj[key] = value
    else:
        obj.__dict__[key] = value


def _drop(obj: Any, key: Any) -> None:
    if isinstance(obj, dict):
        obj.pop(key, None)
    else:
        obj.__dict__.pop(key, None)


@contextlib.contextmanager
def kept(module: torch.nn.Module) -> Iterator[None]:
    """Run one export with the module's places as they were (see the module docstring)."""
    places = _places(module)
    hidden = []                          # (place, key, value): a stale fake tensor, hidden
    for obj, entries in places:
        if isinstance(obj, list):        # an item cannot be hidden without moving the others
            continue
        for key, value in entries.items():
            if _entries(value) is None and _holds_fake(value):   # places: at their own level
                hidden.append((obj, key, value))
                _drop(obj, key)
    try:
        yield
    finally:
        for obj, entries in places:
            now = _entries(obj)
            if isinstance(obj, list):
                if any(k not in entries or entries[k] is not v for k, v in now.items()
                       if _holds_fake(v)):
                    obj[:] = list(entries.values())
                continue
            for key, value in now.items():
                if (key not in entries or entries[key] is not value) and _holds_fake(value):
                    if key in entries:
                        _put(obj, key, entries[key])
                    else:
                        _drop(obj, key)
        for obj, key, value in hidden:
            _put(obj, key, value)
