"""Trace a run of identical layers once: the frontend's speed-up for deep models.

torch.export spends the same time on each of a Llama's 32 identical decoder layers. While
exporting, every layer of a run of structurally identical `nn.ModuleList` entries gets a
patched `forward`: the first call with a new signature (below) is traced as usual between two
probe ops that record its inputs and outputs (a *template*); a later layer called with a
template's signature becomes one `nncompile_replay::call` op whose fake outputs are shaped like
the template's. The parent's code (the loop, masks, residuals) still runs for every layer.
frontend._Lowering expands each call into a copy of the template's IR ops with the layer's own
parameters, module paths (`layers.7.mlp`) and value names, in the order a full trace would name
them, so the IR is the one a full trace gives, byte for byte in every printed form.

A layer is copied only when nothing can make its trace differ from the template's:

- the same module tree (class per submodule path), the same parameter and buffer names,
  shapes, strides, dtypes and requires_grad; no forward/backward hooks (module or global), no
  instance-level `forward`; and no module anywhere in the model reachable by two paths;
- the same other attributes (equal scalars, or the same object), or differing ones
  (`LlamaAttention.layer_idx`) that the template's forward never reads or writes (watched while
  it runs); the template's forward leaves its modules' attributes as they were;
- called from the same Python stack (code and line of every frame) with the same pytree of
  arguments: tensor leaves alike in type, shape, stride, offset, dtype, device, requires_grad
  and aliasing, other leaves equal (objects: the same one); the same grad / autocast mode;
- the template's outputs are distinct tensors needing a gradient as the call op's do (when an
  input or the layer's own parameters do), and its ops read only its arguments and
  parameters/buffers (checked while lowering); a program that writes in place is
  functionalized, and must then leave no op a full trace would have eliminated.

Otherwise the layer is traced for real (and becomes a template itself), or the model is
exported again without replay. NNCOMPILE_REPLAY=0 turns it off.
"""
from __future__ import annotations

import contextlib
import enum
import itertools
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch.utils import _pytree as pytree

from ..ir import BUFFER, PARAM, Op, Value

_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
          "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
          "_forward_pre_hooks_with_kwargs")
_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                 "_global_backward_pre_hooks", "_global_forward_hooks_always_called",
                 "_global_module_registration_hooks", "_global_parameter_registration_hooks",
                 "_global_buffer_registration_hooks")
# nn.Module bookkeeping compared (or required empty) on its own, not as an attribute
_STRUCTURAL = frozenset(_HOOKS + (
    "_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", "_state_dict_hooks",
    "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks"))
_SCALARS = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device,
            torch.layout, torch.memory_format, enum.Enum)
_ids = itertools.count()
_TENSOR = object()                  # a tensor's place among a template's output leaves
_ACTIVE: dict[int, "Run"] = {}      # run id -> Run, while an export with replay runs
_OPS: tuple | None = None
last: dict[str, Any] = {}           # the latest trace: {"replayed": layers} or {"fallback": why}


def enabled() -> bool:
    return os.environ.get("NNCOMPILE_REPLAY", "1") not in ("0", "false", "no", "off")


def ops() -> tuple:
    """(probe, call): the two ops, defined on first use."""
    global _OPS
    if _OPS is None:
        @torch.library.custom_op("nncompile_replay::probe", mutates_args=())
        def probe(xs: list[torch.Tensor], run: int, member: int, which: int) -> torch.Tensor:
            raise RuntimeError("nncompile_replay.probe only runs while tracing")

        @probe.register_fake
        def _(xs, run, member, which):
            return torch.empty(0, device=xs[0].device if xs else "cpu")

        @torch.library.custom_op("nncompile_replay::call", mutates_args=())
        def call(xs: list[torch.Tensor], run: int, member: int,
                 template: int) -> list[torch.Tensor]:
            raise RuntimeError("nncompile_replay.call only runs while tracing")

        @call.register_fake
        def _(xs, run, member, template):
            t = next(t for t in _ACTIVE[run].templates if t.member.index == template)
            return [torch.empty_strided(shape, stride, dtype=dtype, device=device)
                    for shape, stride, dtype, device in t.out_metas]

        def backward(ctx, grads):
            return None, None, None, None

        probe.register_autograd(backward)
        call.register_autograd(backward)
        _OPS = (torch.ops.nncompile_replay.probe.default, torch.ops.nncompile_replay.call.default)
        # a probe's result is unused: keep it through dead-code elimination (functionalize)
        torch.fx.node.has_side_effect(_OPS[0])
    return _OPS


def same(a: Any, b: Any) -> bool:
    """Equal scalars (and containers of them) or the same object."""
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if isinstance(a, _SCALARS):
        return a == b
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, torch.nn.Module):
        return _same_stateless_module(a, b)
    return False


def _same_stateless_module(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    """Two modules of one class kept as plain attributes (not submodules), with no
    parameters, buffers, submodules or hooks and equal other attributes: they compute the
    same. Hugging Face's kernel hub gives each attention layer its own such wrapper of a
    function (`_kernel_funcs = {"rotary_pos_emb": Func()}`)."""
    da, db = vars(a), vars(b)
    if any(da.get(k) or db.get(k) for k in _HOOKS + ("_parameters", "_buffers", "_modules")):
        return False
    rest = [k for k in da if k not in _STRUCTURAL]
    return rest == [k for k in db if k not in _STRUCTURAL] and all(same(da[k], db[k])
                                                                  for k in rest)


def _tmeta(t: torch.Tensor | None) -> tuple | None:
    if t is None:
        return None
    return (type(t), tuple(t.shape), tuple(t.stride()), t.dtype, t.device, t.requires_grad)


def _structure(layer: torch.nn.Module) -> tuple | None:
    """What must be equal between two layers (hashable), or None for a layer never replayed
    (hooks, an instance-level forward)."""
    out = []
    for rel, sub in layer.named_modules(remove_duplicate=False):
        d = vars(sub)
        if any(d.get(h) for h in _HOOKS) or "forward" in d or "__call__" in d:
            return None
        out.append((rel, type(sub),
                    tuple((k, _tmeta(v)) for k, v in sub._parameters.items()),
                    tuple((k, _tmeta(v)) for k, v in sub._buffers.items()),
                    frozenset(sub._non_persistent_buffers_set),
                    tuple(sorted(k for k in d if k not in _STRUCTURAL))))
    return tuple(out)


@dataclass
class Member:
    index: int                          # position in the run
    path: str                           # module path, e.g. "model.model.layers.7"
    module: torch.nn.Module
    differs: set = field(default_factory=set)    # {(submodule path, attribute)} unlike member 0
    tensors: dict = field(default_factory=dict)  # relative name -> parameter or buffer
    calls: int = 0


@dataclass
class Template:
    """A member traced for real between probes; later members with its signature copy it."""
    member: Member
    sig: Any = None                     # its call's signature
    out_spec: Any = None
    out_leaves: list = field(default_factory=list)   # output leaves, tensors as _TENSOR
    out_metas: list = field(default_factory=list)
    read: set = field(default_factory=set)       # watched attributes its forward touched
    usable: bool = False                # traced without anything that forbids copying it


@dataclass
class Run:
    """Structurally identical layers; each is traced for real (a template) or copied from a
    template it matches."""
    id: int
    members: list[Member]
    canonical: dict                     # id(tensor) -> FQN the frontend names it by
    watched: dict = field(default_factory=dict)  # submodule path -> differing attribute names
    templates: list[Template] = field(default_factory=list)
    replayed: int = 0
    maps: dict = field(default_factory=dict)

    def fqn_map(self, src: Member, dst: Member) -> dict[str, str] | None:
        """Canonical FQN of src's own parameters/buffers -> dst's; None where a tensor src
        shares with a module outside it is not the same one in dst."""
        key = (src.index, dst.index)
        if key not in self.maps:
            out: dict[str, str] | None = {}
            for rel, t in src.tensors.items():
                t_fqn, mt = self.canonical.get(id(t)), dst.tensors.get(rel)
                if t_fqn is None or mt is None or self.canonical.get(id(mt)) is None:
                    out = None
                    break
                if not (t_fqn == src.path or t_fqn.startswith(src.path + ".")):
                    if mt is not t:          # shared with a module outside: must stay so
                        out = None
                        break
                    continue
                if out.setdefault(t_fqn, self.canonical[id(mt)]) != self.canonical[id(mt)]:
                    out = None
                    break
            self.maps[key] = out
        return self.maps[key]


def find_runs(module: torch.nn.Module, canonical: dict[int, str]) -> list[Run]:
    """Runs of structurally identical layers in the module's ModuleLists (outermost lists
    first; layers inside a replayable layer are left to it). canonical: id(tensor) -> the FQN
    the frontend names it by."""
    if not enabled():
        return []
    from torch.nn.modules import module as nn_module
    if any(getattr(nn_module, h, None) for h in _GLOBAL_HOOKS):
        return []
    seen: set[int] = set()
    for _, m in module.named_modules(remove_duplicate=False):
        if id(m) in seen:
            # a module reachable by two paths: torch.export then traces through proxies
            # that track the path each access took, which a patched forward would bypass
            return []
        seen.add(id(m))
    runs: list[Run] = []
    covered: list[str] = []
    for name, ml in module.named_modules():
        if not isinstance(ml, torch.nn.ModuleList) or len(ml) < 2 \
                or any(name == c or name.startswith(c + ".") for c in covered):
            continue
        groups: dict[tuple, list[Member]] = {}
        for key, layer in ml._modules.items():
            if layer is None:
                continue
            st = _structure(layer)
            if st is not None:
                path = f"{name}.{key}" if name else key
                groups.setdefault(st, []).append(Member(0, path, layer))
        found = False
        for members in groups.values():
            if len(members) > 1:
                runs.append(_make_run(members, canonical))
                found = True
        if found:
            covered.append(name)
    return runs


def _make_run(members: list[Member], canonical: dict[int, str]) -> Run:
    first = members[0]
    f_subs = dict(first.module.named_modules(remove_duplicate=False))
    for i, m in enumerate(members):
        m.index = i
        m.tensors = dict(list(m.module.named_parameters(remove_duplicate=False))
                         + list(m.module.named_buffers(remove_duplicate=False)))
        if i:
            m_subs = dict(m.module.named_modules(remove_duplicate=False))
            for rel, sub in f_subs.items():
                d_f, d_m = vars(sub), vars(m_subs[rel])
                m.differs |= {(rel, k) for k in d_f if k not in _STRUCTURAL
                              and not same(d_f[k], d_m[k])}
    run = Run(next(_ids), members, canonical)
    for m in members[1:]:
        for rel, attr in m.differs:
            run.watched.setdefault(rel, set()).add(attr)
    return run


def _signature(args: tuple, kwargs: dict) -> tuple[tuple, list[torch.Tensor]]:
    leaves, spec = pytree.tree_flatten((args, kwargs))
    tensors: list[torch.Tensor] = []
    seen: dict[int, int] = {}
    desc = []
    for x in leaves:
        if isinstance(x, torch.Tensor):
            k = seen.get(id(x))
            if k is None:
                k = seen[id(x)] = len(tensors)
                tensors.append(x)
            desc.append((k, type(x), tuple(x.shape), tuple(x.stride()), x.storage_offset(),
                         x.dtype, x.device, x.requires_grad))
        else:
            desc.append(x)
    try:
        autocast = tuple(torch.is_autocast_enabled(d) for d in ("cpu", "cuda"))
    except Exception:  # noqa: BLE001 - a build without the query: compare nothing extra
        autocast = ()
    mode = (torch.is_grad_enabled(), torch.is_inference_mode_enabled(), autocast)
    stack = []
    f = sys._getframe(2)
    while f is not None:
        stack.append((f.f_code, f.f_lineno))
        f = f.f_back
    return (spec, desc, mode, stack), tensors


def _same_signature(a: tuple, b: tuple) -> bool:
    (spec_a, desc_a, mode_a, stack_a), (spec_b, desc_b, mode_b, stack_b) = a, b
    if mode_a != mode_b or stack_a != stack_b or spec_a != spec_b or len(desc_a) != len(desc_b):
        return False
    for x, y in zip(desc_a, desc_b):
        if isinstance(x, tuple) and len(x) == 8 and isinstance(x[1], type) \
                and issubclass(x[1], torch.Tensor):
            if x != y:
                return False
        elif not same(x, y):
            return False
    return True


def _watch_class(cls: type, names: frozenset, record: set) -> type:
    def prop(name: str) -> property:
        def get(self):
            record.add(name)
            return self.__dict__[name]

        def put(self, value):
            record.add(name)
            self.__dict__[name] = value

        def delete(self):
            record.add(name)
            del self.__dict__[name]
        return property(get, put, delete)
    ns = {n: prop(n) for n in names}
    ns.update(__module__=cls.__module__, __qualname__=cls.__qualname__)
    return type(cls.__name__, (cls,), ns)


def _state(subs: dict[str, torch.nn.Module]) -> list:
    return [(rel, {k: v for k, v in vars(sub).items() if k != "forward"},
             dict(sub._parameters), dict(sub._buffers), dict(sub._modules))
            for rel, sub in subs.items()]


def _same_state(a: list, b: list) -> bool:
    for (ra, *da), (rb, *db) in zip(a, b):
        for x, y in zip(da, db):
            if list(x) != list(y) or any(x[k] is not y[k] for k in x):
                return False
    return True


def _anchor(layer: torch.nn.Module) -> torch.Tensor | None:
    """The layer's first parameter that needs a gradient."""
    return next((p for p in layer.parameters() if p.requires_grad), None)


def _matching(run: Run, member: Member, sig: tuple) -> Template | None:
    """A usable template this call may copy: the same signature, and no attribute that
    differs between the two layers was touched by the template's forward."""
    for t in run.templates:
        if t.usable and not ((member.differs | t.member.differs) & t.read) \
                and run.fqn_map(t.member, member) is not None and _same_signature(sig, t.sig):
            return t
    return None


def _forward(run: Run, member: Member, orig: Any) -> Any:
    probe, call = ops()

    def forward(*args, **kwargs):
        member.calls += 1
        if member.calls > 1:                 # called again: traced for real
            return orig(*args, **kwargs)
        sig, tensors = _signature(args, kwargs)
        t = _matching(run, member, sig)
        if t is not None:
            anchor = _anchor(member.module)
            outs = iter(call(tensors if anchor is None else tensors + [anchor], run.id,
                             member.index, t.member.index))
            run.replayed += 1
            leaves = [next(outs) if x is _TENSOR else x for x in t.out_leaves]
            return pytree.tree_unflatten(leaves, t.out_spec)
        return _traced(run, member, orig, sig, tensors, args, kwargs)
    return forward


def _traced(run: Run, member: Member, orig: Any, sig: tuple, tensors: list, args: tuple,
            kwargs: dict) -> Any:
    """Trace the member for real between probes, as a template for the members after it."""
    probe, _ = ops()
    t = Template(member, sig)
    run.templates.append(t)
    probe(tensors, run.id, member.index, 0)
    subs = dict(member.module.named_modules(remove_duplicate=False))
    before = _state(subs)
    swapped = []
    read: set = set()
    try:
        for rel, names in run.watched.items():
            sub = subs[rel]
            cls = type(sub)
            sub.__class__ = _watch_class(cls, frozenset(names), read)
            swapped.append((sub, cls))
        out = orig(*args, **kwargs)
    finally:
        for sub, cls in swapped:
            sub.__class__ = cls
    # which (submodule, attribute) pairs were touched: the classes share one record, so
    # count an attribute name as read on every submodule that watches it
    t.read = {(rel, n) for rel, names in run.watched.items() for n in names if n in read}
    leaves, spec = pytree.tree_flatten(out)
    outs = [x for x in leaves if isinstance(x, torch.Tensor)]
    # the call op's floating outputs need a gradient when an input does; a layer's
    # trainable parameter goes along as an input (unused) to stand for its own
    wants_grad = torch.is_grad_enabled() and (any(x.requires_grad for x in tensors)
                                              or _anchor(member.module) is not None)
    t.usable = _same_state(before, _state(subs)) \
        and len({id(x) for x in outs}) == len(outs) \
        and all(x.requires_grad == (wants_grad and (x.dtype.is_floating_point
                                                    or x.dtype.is_complex)) for x in outs) \
        and all(isinstance(x, _SCALARS) for x in leaves if not isinstance(x, torch.Tensor))
    probe(outs, run.id, member.index, 1)
    t.out_spec = spec
    t.out_leaves = [_TENSOR if isinstance(x, torch.Tensor) else x for x in leaves]
    t.out_metas = [(tuple(x.shape), tuple(x.stride()), x.dtype, x.device) for x in outs]
    return out


@contextlib.contextmanager
def active(runs: list[Run]) -> Iterator[None]:
    """The runs' output shapes known to the call op (re-tracing an exported program)."""
    ops()
    try:
        for run in runs:
            _ACTIVE[run.id] = run
        yield
    finally:
        for run in runs:
            _ACTIVE.pop(run.id, None)


def in_template(path: str, runs: list[Run]) -> bool:
    """Whether a module path is (inside) a layer traced as a template."""
    return any(path == t.member.path or path.startswith(t.member.path + ".")
               for r in runs for t in r.templates)


@contextlib.contextmanager
def installed(runs: list[Run]) -> Iterator[None]:
    """Patch the runs' layers for one export."""
    ops()
    patched = []
    try:
        for run in runs:
            _ACTIVE[run.id] = run
            for m in run.members:
                m.calls = 0
                m.module.__dict__["forward"] = _forward(run, m, type(m.module).forward.__get__(
                    m.module))
                patched.append(m.module)
        yield
    finally:
        for mod in patched:
            mod.__dict__.pop("forward", None)
        for run in runs:
            _ACTIVE.pop(run.id, None)


# ---- lowering: frontend._Lowering records a template's ops and copies them ----

class NoReplay(Exception):
    """A replayed layer's template cannot be copied: lower a full trace instead."""


class Region:
    """A template's ops as lowered, between its probes: what a replayed layer copies."""

    def __init__(self, run: Run, member: Member, start: int, inputs: list, no_grad: bool):
        self.run, self.member, self.start, self.inputs = run, member, start, inputs
        self.no_grad = no_grad
        self.info: list[tuple[str, bool]] = []      # per op: (fx op name, under no_grad)
        self.ops: list | None = None                # set by the closing probe
        self.outputs: list = []


def copy_region(lowering: Any, region: Region, member: Member, inputs: list) -> list:
    """Append to lowering.ops a copy of region's ops for `member`, called with `inputs` (the
    call op's Values); return the Values standing for the template's outputs. The copy is what
    lowering the member's own trace gives: its parameters, module paths, value names (made in
    the same order from the same bases) and requires_grad."""
    tpath, mpath = region.member.path, member.path
    cut = len(tpath)
    fqns = region.run.fqn_map(region.member, member)
    if fqns is None:
        raise NoReplay(f"{mpath} does not share what {tpath} shares")

    def repath(p: str) -> str:
        return mpath + p[cut:] if p == tpath or p.startswith(tpath + ".") else p

    vmap: dict = {}
    for tv, mv in zip(region.inputs, inputs):      # (inputs may end with the anchor)
        if vmap.setdefault(tv, mv) is not mv:
            raise NoReplay("inputs alias differently")

    def value(v):
        mv = vmap.get(v)
        if mv is None:
            if v.kind not in (PARAM, BUFFER):
                raise NoReplay(f"{tpath} reads {v.name}, not one of its arguments")
            mv = lowering.by_fqn[fqns.get(v.fqn, v.fqn)]
        return mv

    def leaf(x: Any) -> Any:
        return value(x) if isinstance(x, Value) else x

    def remap(x: Any) -> Any:
        """pytree.tree_map(leaf, x), as lowering built the template's args (fx's
        immutable_list kept), quicker for plain tuples, lists and dicts."""
        t = type(x)
        if t is Value:
            return value(x)
        if t is tuple:
            return tuple([remap(e) for e in x])
        if t is list:
            return [remap(e) for e in x]
        if t is dict:
            return {k: remap(e) for k, e in x.items()}
        if isinstance(x, (list, tuple, dict)):
            return pytree.tree_map(leaf, x)
        return x

    for op, (opname, no_grad) in zip(region.ops, region.info):
        new = Op(op.target, remap(op.args), remap(op.kwargs), [], op.source,
                 repath(op.module_path), multi_output=op.multi_output)
        base = lowering.base(new.module_path, opname)
        grad_in = lowering.grad_in(opname, no_grad, new.inputs())
        for ov in op.outputs:
            meta = ov.meta
            rg = grad_in and meta is not None and (meta.dtype.is_floating_point
                                                   or meta.dtype.is_complex)
            nv = vmap[ov] = Value(lowering.fresh(base), meta, requires_grad=rg)
            nv.producer = new
            new.outputs.append(nv)
        new.module_stack = tuple((repath(p), c) for p, c in op.module_stack)
        lowering.ops.append(new)
    lowering.anchored.update(id(vmap[v]) for op in region.ops for v in op.outputs
                             if id(v) in lowering.anchored)
    return [value(v) for v in region.outputs]


def has_dead_ops(graph: Any, anchored: set[int]) -> bool:
    """Whether an op's outputs reach neither the graph's outputs, nor a value an assert read
    (`anchored`, ids), nor a live op: after functionalizing (which eliminates dead code) a
    replayed trace may keep what a full one would not (a template output no one reads)."""
    live = {id(v) for v in graph.outputs if isinstance(v, Value)} | anchored
    for op in reversed(graph.ops):
        if not any(id(v) in live for v in op.outputs):
            return True
        live.update(id(v) for v in op.inputs())
    return False
