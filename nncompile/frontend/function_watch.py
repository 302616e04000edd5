"""Where the user's code is, and the torch.autograd.Function watcher the frontend exports under.

`user_frame_from_text(stack_text)` finds the innermost frame of a stack trace that is model
code (not torch, nncompile or the standard library). `WatchFunctions`, entered around
torch.export, records the autograd.Function subclasses forward applies to tensors needing a
gradient (torch.export would inline their forward and drop their backward); `check()` then
raises a TraceError naming the first and how to register it:

    class Scale(torch.autograd.Function): ...     forward: y = Scale.apply(x)
    -> TraceError: forward applies the torch.autograd.Function m.Scale (defined at m.py:3) ...
"""
from __future__ import annotations

import importlib.util
import inspect
import os
import re
import sys
import traceback
from typing import Any

import torch
from torch.utils import _pytree as pytree

from .. import compat
from ..errors import TraceError
from ..ir import SourceInfo

_TORCH_DIR = os.path.dirname(torch.__file__)
_HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))    # nncompile/
# nncompile.passes and nncompile.runtime live beside nncompile/ in a checkout (pyproject's
# package-dir: `passes/`, `runtime/`) and inside it in a wheel; found by path, not imported
_OWN_DIRS = tuple(d + os.sep for d in (
    _HERE, *(os.path.join(base, sub) for base in (_HERE, os.path.dirname(_HERE))
             for sub in ("passes", "runtime"))))
_STDLIB = os.path.dirname(os.__file__) + os.sep


def _package_dirs(*names: str) -> tuple[str, ...]:
    """Where these packages are installed (without importing them)."""
    found = []
    for name in names:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        for loc in (spec.submodule_search_locations or []) if spec else []:
            found.append(os.path.abspath(loc) + os.sep)
    return tuple(found)


# dispatchers that call the model's own function: never the model's line (Hugging Face's
# kernel hub wraps `apply_rotary_pos_emb` and others in a module whose forward calls them)
_WRAPPER_DIRS = _package_dirs("kernels")


def is_user_file(path: str) -> bool:
    """Model code: not torch, not nncompile, not the standard library, not a dispatcher of
    _WRAPPER_DIRS (packages such as transformers count as model code)."""
    path = os.path.abspath(path)
    if path.startswith(_TORCH_DIR) or path.startswith(_OWN_DIRS) or "<" in path \
            or (_WRAPPER_DIRS and path.startswith(_WRAPPER_DIRS)):
        return False
    return not path.startswith(_STDLIB) or "site-packages" in path


def display_path(path: str) -> str:
    path = os.path.abspath(path)
    if "site-packages" + os.sep in path:
        return path.split("site-packages" + os.sep, 1)[1]
    rel = os.path.relpath(path)
    return rel if not rel.startswith("..") else path


def user_frame_from_text(text: str) -> SourceInfo | None:
    """The innermost `File "...", line N` frame of a stack trace that is user code."""
    frames = re.findall(r'File "([^"]+)", line (\d+)(?:, in [^\n]*)?\n\s*([^\n]*)', text or "")
    for path, line, code in reversed(frames):
        if is_user_file(path):
            return SourceInfo(display_path(path), int(line), code.strip())
    return None

def _is_registered_function(cls: type) -> bool:
    """A torch.autograd.Function made an op with nncompile.register_op."""
    from ..custom_ops import REGISTRY
    return any(getattr(op.impl, "__self__", None) is cls for op in REGISTRY.values())


def _function_where(cls: type) -> str:
    try:
        path = inspect.getsourcefile(cls)
        line = inspect.getsourcelines(cls)[1]
    except (OSError, TypeError):
        return ""
    return f" (defined at {display_path(path)}:{line})" if path else ""


def _subclasses(cls: type) -> list[type]:
    out, todo = [], list(cls.__subclasses__())
    while todo:
        c = todo.pop()
        out.append(c)
        todo.extend(c.__subclasses__())
    return out


class WatchFunctions:
    """While exporting, record the torch.autograd.Function subclasses that forward applies to
    tensors needing a gradient: torch.export (non-strict) inlines their forward as aten ops
    and drops their custom backward, so the compiled module would train with the forward's
    autograd instead. Torch's own Functions, nncompile's and those made with register_op
    (they trace as one torch.ops.nncompile op) are fine, and so is one applied under
    no_grad or to tensors needing no gradient (no backward ever runs)."""

    def __init__(self) -> None:
        self.found: dict[type, SourceInfo | None] = {}

    def __enter__(self) -> "WatchFunctions":
        base = torch.autograd.function.Function
        self._orig, orig_fn = compat.function_apply()
        found = self.found

        def record(cls: Any, args: Any, in_forward: bool = False) -> None:
            # in_forward: called from the Function's forward, which runs without grad mode
            if isinstance(cls, type) and cls not in found \
                    and (in_forward or torch.is_grad_enabled()) \
                    and _needs_check(cls) and any(isinstance(t, torch.Tensor) and t.requires_grad
                                                  for t in pytree.tree_leaves(args)):
                found[cls] = next((SourceInfo(display_path(f.filename), f.lineno or 0,
                                              (f.line or "").strip())
                                   for f in reversed(traceback.extract_stack()[:-2])
                                   if is_user_file(f.filename)), None)

        def apply(cls, *args, **kwargs):
            record(cls, (args, kwargs))
            return orig_fn(cls, *args, **kwargs)

        base.apply = classmethod(apply)
        # `f = MyFunction.apply` bound before export bypasses the patch above; Function.apply
        # (torch 2.x) passes its arguments through this helper, whose caller knows `cls`
        self._utils = getattr(getattr(torch, "_functorch", None), "utils", None)
        self._unwrap = getattr(self._utils, "unwrap_dead_wrappers", None)
        if self._unwrap is not None:
            unwrap = self._unwrap

            def unwrap_dead_wrappers(args):
                caller = sys._getframe(1)
                if caller.f_code.co_name == "apply":
                    record(caller.f_locals.get("cls"), args)
                return unwrap(args)

            self._utils.unwrap_dead_wrappers = unwrap_dead_wrappers
        # torch 2.15 implements apply in C (compat.function_apply): `f = MyFunction.apply`
        # bound before export reaches neither hook, so each user Function's forward records
        self._forwards = []
        if not isinstance(self._orig, classmethod):
            for cls in _subclasses(base):
                fwd = cls.__dict__.get("forward")
                if isinstance(fwd, staticmethod) and _needs_check(cls):
                    def forward(*args, _f=fwd.__func__, _cls=cls, **kwargs):
                        record(_cls, (args, kwargs), in_forward=True)
                        return _f(*args, **kwargs)
                    cls.forward = staticmethod(forward)
                    self._forwards.append((cls, fwd))
        return self

    def __exit__(self, *exc: Any) -> None:
        torch.autograd.function.Function.apply = self._orig
        if self._unwrap is not None:
            self._utils.unwrap_dead_wrappers = self._unwrap
        for cls, fwd in self._forwards:
            cls.forward = fwd

    def check(self) -> None:
        if not self.found:
            return
        cls, site = next(iter(self.found.items()))
        name = f"{cls.__module__}.{cls.__qualname__}"
        at = f" at {site.file}:{site.line}: `{site.code}`" if site else ""
        others = [c.__qualname__ for c in list(self.found)[1:]]
        more = f" (also: {', '.join(others)})" if others else ""
        raise TraceError(
            f"forward applies the torch.autograd.Function {name}{_function_where(cls)}{at}"
            f"{more}. torch.export inlines its forward and drops its custom backward, so the "
            "compiled module would compute different gradients. Register it as one op with "
            f"nncompile.register_op({cls.__name__}, annotation) (e.g. "
            f"`{cls.__name__.lower()} = nncompile.register_op({cls.__name__}, \"* d -> * d\")` "
            "for an elementwise function; see docs/custom_ops.md) and call that in forward, "
            "or apply it under torch.no_grad() if no gradient flows through it.")


def _needs_check(cls: type) -> bool:
    module = getattr(cls, "__module__", "") or ""
    if module == "torch" or module.startswith(("torch.", "nncompile.")) or module == "nncompile":
        return False
    try:
        path = inspect.getsourcefile(cls) or ""
    except TypeError:
        path = ""
    if path and os.path.abspath(path).startswith(_OWN_DIRS):
        return False
    return not _is_registered_function(cls)
