"""Traces kept for the rest of the process: the same model traced again is not traced again.

A process that compiles one model under several plans (a sweep, `verify`, a resume that
checks `reuse="match"`, a notebook re-running a cell) traces it once; every later `trace` of an
equal model on equal dummy args returns a copy of that graph.

    before: parallelize(build(), args, ComputeConfig(2, 2), pas_policy="tp")    # traced: 1.4 s
            parallelize(build(), args, ComputeConfig(2, 2), pas_policy="data")  # traced: 1.4 s
    after:  the second call's trace is a copy of the first (a few ms)

"Equal" is decided before tracing, from what a trace can depend on, all of it in the key:
- the module tree: each submodule's class and mode, every attribute (numbers, strings,
  configs, containers and the objects they hold, small tensors by value), its hooks;
- parameters and buffers: names, shapes, dtypes, devices, requires_grad, and which are tied;
- the code: every function of the model's own classes (not torch's) and, transitively, the
  functions, classes and module-level values of their globals that they name, by module, qualified name and bytecode;
  a redefined helper or a changed global flag is a different key;
- the dummy args (structure, shapes, dtypes, devices, non-tensor values), dynamic_dims,
  torch's global modes (grad mode, default dtype, autocast), the NNCOMPILE_* environment
  variables and the working directory (the graph's source comments name files relative to
  it).

Objects of torch's and Python's own types (a logger, a lock) are compared by their type's name, other
objects by their attributes; a value the key cannot describe (nested too deep) makes the trace
unkeyed: traced as always, not kept. NNCOMPILE_TRACE_MEMO=0 turns the
memo off. A copy is a deep copy of the graph's structure (Graph.clone), so passes and callers
may edit it freely.
"""
from __future__ import annotations

import copy
import dataclasses
import enum
import functools
import hashlib
import os
import sys
import types
from collections import OrderedDict
from typing import Any

import torch
from torch.utils import _pytree as pytree

KEEP = 8                 # graphs kept (the oldest goes first)
_SMALL_TENSOR = 4096     # tensor attributes up to this many elements are keyed by value

_memo: OrderedDict[str, tuple[Any, dict]] = OrderedDict()
hits = 0                 # traces answered from the memo in this process (for tests and logs)


class Unkeyed(Exception):
    """The key cannot describe this value: trace without the memo."""


def enabled() -> bool:
    return os.environ.get("NNCOMPILE_TRACE_MEMO", "1") != "0"


def clear() -> None:
    _memo.clear()


def _library(obj: Any) -> bool:
    """torch's and Python's own code and objects: compared by name, not walked."""
    mod = (getattr(obj, "__module__", None) or "").split(".")[0]
    return mod == "torch" or mod in sys.stdlib_module_names or mod == "builtins"


class _Key:
    """Builds the description of one trace's inputs (see the module docstring)."""

    def __init__(self) -> None:
        self.seen: dict[int, int] = {}       # id(object) -> its index (cycles, sharing)
        self.keep: list[Any] = []            # alive while the key is built: ids unique
        self.code_seen: set[int] = set()
        self.parts: list[Any] = []
        self.todo: list[Any] = []

    def ref(self, obj: Any) -> tuple | None:
        """('ref', i) for an object already described (a shared config, a tied weight)."""
        i = self.seen.get(id(obj))
        if i is not None:
            return ("ref", i)
        self.seen[id(obj)] = len(self.seen)
        self.keep.append(obj)
        return None

    def value(self, v: Any, depth: int = 0) -> Any:
        if v is None or isinstance(v, (bool, int, float, str, bytes, complex)):
            return (type(v).__name__, v)
        if isinstance(v, (torch.dtype, torch.device, torch.Size, torch.memory_format,
                          torch.layout, enum.Enum, type(Ellipsis), slice, range)):
            return (type(v).__name__, repr(v))
        if depth > 12:
            raise Unkeyed("nested too deep")
        r = self.ref(v)
        if r is not None:
            return r
        if isinstance(v, torch.Tensor):
            return self.tensor(v, by_value=True)
        if isinstance(v, (tuple, list, set, frozenset)):
            items = sorted(v, key=repr) if isinstance(v, (set, frozenset)) else v
            return (type(v).__name__, tuple(self.value(x, depth + 1) for x in items))
        if isinstance(v, dict):
            return ("dict", type(v).__qualname__,
                    tuple((self.value(k, depth + 1), self.value(x, depth + 1))
                          for k, x in v.items()))
        if isinstance(v, torch.nn.Module):
            return ("module", _name(type(v)))    # described by the module walk
        if isinstance(v, type):
            self.cls(v)
            return ("class", _name(v))
        if isinstance(v, (types.FunctionType, types.MethodType, functools.partial)):
            return self.function(v, depth)
        if isinstance(v, (types.BuiltinFunctionType, types.ModuleType)) or _library(type(v)) \
                and not isinstance(v, types.SimpleNamespace) and not dataclasses.is_dataclass(v):
            return ("object", _name(v))          # a logger, a lock, torch's objects
        if hasattr(v, "__dict__"):               # a config, the model's own objects
            return ("object", self.cls(type(v)), self.value(dict(vars(v)), depth + 1))
        if hasattr(type(v), "__slots__"):
            return ("object", self.cls(type(v)), tuple(
                (s, self.value(getattr(v, s, None), depth + 1))
                for s in getattr(type(v), "__slots__", ())))
        return ("object", _name(v))

    def tensor(self, t: torch.Tensor, by_value: bool) -> tuple:
        desc = (tuple(t.shape), str(t.dtype), str(t.device), t.requires_grad,
                type(t).__qualname__)
        if not by_value or t.is_meta:
            return ("tensor",) + desc
        if t.numel() > _SMALL_TENSOR or type(t) not in (torch.Tensor, torch.nn.Parameter) \
                or t.is_sparse:          # too large to be traced as a constant: by shape
            return ("tensor",) + desc
        data = t.detach().cpu().contiguous()
        return ("tensor",) + desc + (hashlib.sha256(data.view(torch.uint8).numpy()
                                                    if data.numel() else b"").hexdigest(),)

    def function(self, f: Any, depth: int = 0) -> tuple:
        if isinstance(f, types.MethodType):
            return ("method", self.function(f.__func__), self.value(f.__self__, depth + 1))
        if isinstance(f, functools.partial):
            return ("partial", self.function(f.func), self.value(f.args, depth + 1),
                    self.value(f.keywords, depth + 1))
        code = getattr(f, "__code__", None)
        if code is None:                     # a builtin, a callable object
            return ("object", _name(f))
        if _user_code(f) and id(code) not in self.code_seen:
            self.code_seen.add(id(code))
            self.keep.append(f)
            self.todo.append(f)          # walked by expand(): no deep recursion
        return ("function", _name(f), _code(code))

    def cls(self, c: type) -> str:
        """The class's own code (its functions), once; torch's classes by name."""
        if id(c) not in self.code_seen:
            self.code_seen.add(id(c))
            self.keep.append(c)
            self.todo.append(c)
        return _name(c)

    def expand(self) -> None:
        """Describe the code of every function and class met so far, and what it names."""
        while self.todo:
            item = self.todo.pop()
            if isinstance(item, type):
                for base in item.__mro__:
                    if _library(base) or base is object:
                        continue
                    for name, attr in vars(base).items():
                        f = attr.fget if isinstance(attr, property) else attr.__func__ \
                            if isinstance(attr, (staticmethod, classmethod)) else attr
                        if isinstance(f, types.FunctionType):
                            self.parts.append(("method", base.__qualname__, name,
                                               self.function(f)))
                            if not _user_code(f):
                                self.describe(f, shallow=True)
                continue
            self.describe(item)

    def describe(self, f: types.FunctionType, shallow: bool = False) -> None:
        """A function's code, defaults, closure and the globals it names; `shallow`: those
        globals by name (a library's function: what the model's class calls is checked,
        the library's own insides are not walked)."""
        self.parts.append(("code", _name(f), _code(f.__code__),
                           self.value(f.__defaults__), self.value(f.__kwdefaults__),
                           tuple(self.value(c.cell_contents) if _filled(c) else None
                                 for c in f.__closure__ or ())))
        for name in sorted(_names(f.__code__)):     # what it reads from its module
            if name in f.__globals__:
                g = f.__globals__[name]
                self.parts.append(("global", f.__module__, name, self.value(g) if not
                                   shallow or _simple(g) else ("object", _name(g))))

    def module(self, root: torch.nn.Module) -> None:
        tensors: dict[int, int] = {}
        for name, m in root.named_modules(remove_duplicate=False):
            attrs = {k: v for k, v in vars(m).items()
                     if k not in ("_parameters", "_buffers", "_modules")}
            self.parts.append(("submodule", name, self.cls(type(m)), m.training,
                               self.value(attrs)))
            for kind, table in (("param", m._parameters), ("buffer", m._buffers)):
                for pname, t in table.items():
                    if t is None:
                        self.parts.append((kind, name, pname, None))
                        continue
                    first = tensors.setdefault(id(t), len(tensors))
                    self.parts.append((kind, name, pname, first, self.tensor(t, False)))
            self.parts.append(("children", name, tuple(m._modules)))


def _autocast() -> tuple:
    out = []
    for device in ("cpu", "cuda"):
        try:
            out.append((device, torch.is_autocast_enabled(device),
                        str(torch.get_autocast_dtype(device))))
        except (RuntimeError, TypeError, AttributeError):   # a torch without the device
            out.append((device, None))
    return tuple(out)


def _name(obj: Any) -> str:
    """What identifies a function, class or library object across objects (ids are reused once
    an object dies, and keeping objects alive to pin them costs every garbage collection)."""
    named = obj if hasattr(obj, "__qualname__") else type(obj)
    return f"{getattr(named, '__module__', '?')}.{getattr(named, '__qualname__', '?')}"


def _code(code: types.CodeType) -> str:
    """A code object by content: its bytecode, constants (nested code too), names, file."""
    consts = tuple(_code(c) if isinstance(c, types.CodeType) else repr(c)
                   for c in code.co_consts)
    text = repr((code.co_filename, code.co_qualname if hasattr(code, "co_qualname")
                 else code.co_name, code.co_code, consts, code.co_names, code.co_varnames))
    return hashlib.sha1(text.encode()).hexdigest()


def _simple(v: Any) -> bool:
    return v is None or isinstance(v, (bool, int, float, str))


@functools.lru_cache(maxsize=None)
def _is_user_file(path: str) -> bool:
    """Not an installed package's file and not Python's own: the user's code, which may
    change between two traces (a notebook re-running a cell)."""
    parts = os.path.normpath(path).split(os.sep)
    if "site-packages" in parts or "dist-packages" in parts:
        return False
    return not os.path.normpath(path).startswith(_STDLIB)


_STDLIB = os.path.normpath(os.path.dirname(os.__file__))


def _user_code(f: Any) -> bool:
    code = getattr(f, "__code__", None)
    return code is not None and not _library(f) and _is_user_file(code.co_filename)


def _filled(cell) -> bool:
    try:
        cell.cell_contents
        return True
    except ValueError:
        return False


def _names(code: types.CodeType) -> set[str]:
    out = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            out |= _names(c)
    return out


def key(module: torch.nn.Module, dummy_args: Any, dynamic_dims: Any, modes: bool) -> str | None:
    """The trace's key, or None where the memo is off or something cannot be keyed."""
    if not enabled():
        return None
    k = _Key()
    try:
        k.module(module)
        leaves, spec = pytree.tree_flatten(dummy_args)
        storages: dict[Any, int] = {}
        args = []
        for x in leaves:
            if isinstance(x, torch.Tensor):
                where = (x.untyped_storage().data_ptr(), x.storage_offset()) \
                    if not x.is_meta and x.device.type != "meta" else id(x)
                args.append(k.tensor(x, False) + (tuple(x.stride()),
                                                  storages.setdefault(where, len(storages))))
            else:
                args.append(k.value(x))
        k.parts.append(("args", str(spec), tuple(args), k.value(dynamic_dims), modes))
        k.expand()
        k.parts.append(("env", sorted((n, v) for n, v in os.environ.items()
                                      if n.startswith("NNCOMPILE_"))))
        k.parts.append(("torch", os.getcwd(), torch.is_grad_enabled(),
                        str(torch.get_default_dtype()), _autocast(),
                        torch.are_deterministic_algorithms_enabled()))
        text = repr(k.parts)
    except Exception:   # noqa: BLE001 - anything the key cannot describe: no memo
        return None
    return hashlib.sha256(text.encode()).hexdigest()


def get(digest: str | None):
    """A copy of the graph traced under `digest`, with the frontend's notes; or None."""
    global hits
    if digest is None or digest not in _memo:
        return None
    _memo.move_to_end(digest)
    graph, notes = _memo[digest]
    hits += 1
    return _copy(graph), dict(notes)


def put(digest: str | None, graph, notes: dict) -> None:
    if digest is None:
        return
    _memo[digest] = (_copy(graph), dict(notes))
    _memo.move_to_end(digest)
    while len(_memo) > KEEP:
        _memo.popitem(last=False)


def _copy(graph):
    out = graph.clone()
    out.trace_info = copy.deepcopy(graph.trace_info)
    if graph.eval_program is not None:
        out.eval_program = _copy(graph.eval_program)
    return out
