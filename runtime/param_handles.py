"""Parameters as an optimizer sees them, the same under every plan.

Grouping code (nanoGPT's `configure_optimizers`, Hugging Face's Trainer) reads
`pm.named_parameters()`: names, `dim()`, `requires_grad`, dtype. Under ZeRO-3 a rank stores
flat 1-D pieces of whole layers (runtime/zero.py), so pm registers a *handle* per parameter
instead: a Parameter without storage (on the meta device) with the local name and the shape of
this rank's shard, as under dp or tp:

    before: pm.named_parameters() -> ("zero_h_0", [2113])            every weight in no-decay
    after:  pm.named_parameters() -> ("h0_attn_q_proj_weight", [32, 32]), ("h0_ln_1_bias", [32])

An optimizer over handles steps *segments*: per parameter, the contiguous run of this rank's
flat piece that holds its elements (possibly empty), a Parameter viewing the flat storage whose
`.grad` is a view of the flat gradient. Each segment sits in the group its handle was put in,
so every group keeps its own hyper-parameters. A torch optimizer built over handles swaps them
for their segments as it is built (`add_param_group`), and once more before each step (a step
pre-hook, for parameters added another way), so `torch.optim.AdamW(pm.parameters())` steps
the pieces. Optimizers that are not element-wise are refused there: they would see pieces.

The original module: a parameter a rank keeps whole (full slice, same device, not ZeRO-3) is
registered in pm as the very same Parameter, so an optimizer built before `parallelize`
steps what pm computes with. The others are released (their storage resized to nothing,
which frees their memory; shape and dtype stay) and adopted by the optimizer's next step:
swapped for pm's shard (or segment). Calling the original module after that is an error
naming pm.
"""
from __future__ import annotations

import threading
import weakref
from typing import Iterable

import torch
from torch.utils.weak import WeakIdKeyDictionary

from nncompile.errors import CheckpointError, ConfigError

from .elementwise import (check_elementwise, check_pieces,  # noqa: F401 (imported from here)
                          declare_elementwise, is_elementwise)
from .torch_patches import wrap_once


def zero_stage(pm) -> str | None:
    """'ZeRO-3' etc. when pm's optimizer steps pieces of tensors, else None."""
    memory = pm.memory
    if memory.zero:
        return f"ZeRO-{memory.zero}" + (" with offload_optimizer" if memory.offload_optimizer
                                        else "")
    return "offload_optimizer" if memory.offload_optimizer else None


# ---- ZeRO-3 handles and segments ----------------------------------------------------------
def make_handles(pm) -> None:
    """Register a storage-less handle per local parameter (ZeRO-3), by local name; its
    element-wise in-place edits apply to its segment (runtime/zero3_handles.py)."""
    from nncompile.rows import param_rows
    from .zero3_handles import ZeroHandle         # (imported here: it imports this file)
    rows = {row.name: row for row in param_rows(pm)}
    for unit in pm.zero.units:
        flat = pm.zero.flat(unit)
        for name in unit.layout.names:
            h = ZeroHandle(torch.empty(rows[name].local_shape, dtype=flat.dtype,
                                       device="meta"), requires_grad=unit.trainable)
            h._nnc_handle = (weakref.ref(pm), name)
            pm.register_parameter(name, h)


def cut(layout, piece: torch.Tensor) -> list[tuple[int, int, int, int]]:
    """Per tensor of `layout`: (start, stop) in the piece, (start, stop) in the tensor."""
    return [(at, at + e - s, s, e) for at, s, e in layout.runs()]


def segment_params(piece: torch.Tensor, layout, requires_grad: bool = True) -> list:
    """A Parameter per tensor of `layout` viewing its run of `piece`."""
    segs = []
    for i, (a, b, s, e) in enumerate(cut(layout, piece)):
        seg = torch.nn.Parameter(piece.detach()[a:b], requires_grad=requires_grad)
        seg._nnc_span = (layout.names[i], s, e, layout.numels[i])
        segs.append(seg)
    return segs


def zero3_segments(pm) -> dict[str, torch.nn.Parameter]:
    """{local name: segment} of pm's ZeRO-3 flat pieces (made once; their .grad follows the
    flat gradient after every backward)."""
    segs = pm.__dict__.get("_nnc_segments")
    if segs is not None:
        return segs
    segs = {}
    for unit in pm.zero.units:
        flat = pm.zero.flat(unit)
        parts = segment_params(flat, unit.layout, unit.trainable)
        for seg, (a, b, _, _) in zip(parts, cut(unit.layout, flat)):
            seg._nnc_flat = (flat, a, b)
            seg._nnc_pm = weakref.ref(pm)
            segs[seg._nnc_span[0]] = seg
        if unit.trainable:
            flat.register_post_accumulate_grad_hook(
                lambda f, parts=parts: refresh_grads(parts))
    pm.__dict__["_nnc_segments"] = segs
    return segs


def refresh_grads(segs: Iterable) -> None:
    """Point each ZeRO-3 segment's .grad at its run of the flat gradient (None without). A
    parameter frozen after parallelize (`p.requires_grad_(False)` on its handle) gets none, as
    on one device: its run of the flat gradient is zeroed (a clipping norm does not count it)
    and its segment's .grad is None (no optimizer steps or decays it)."""
    for seg in segs:
        info = getattr(seg, "_nnc_flat", None)
        if info is None:
            continue
        flat, a, b = info
        g = flat.grad
        pm = seg._nnc_pm()
        handle = pm._parameters.get(seg._nnc_span[0]) if pm is not None else None
        if g is not None and handle is not None and not handle.requires_grad:
            g.detach()[a:b].zero_()
            seg.grad = None
        elif g is None:
            seg.grad = None
        elif seg.grad is None or seg.grad.data_ptr() != g[a:b].data_ptr() or \
                seg.grad.numel() != b - a:
            seg.grad = g.detach()[a:b]


# ---- mapping what the user passes to local names ------------------------------------------
def local_name(pm, p) -> str | tuple[str, ...] | None:
    """The local name of a tensor the user hands an optimizer for pm: pm's own parameter, a
    ZeRO-3 handle or segment, or a parameter of the module pm was built from (a tuple of
    names for an original parameter pm holds as several parts; see local_names)."""
    handle = getattr(p, "_nnc_handle", None) or getattr(p, "_nnc_origin", None)
    if handle is not None:
        return handle[1] if handle[0]() is pm else None
    span = getattr(p, "_nnc_span", None)
    if span is not None and any(s is p for s in pm.__dict__.get("_nnc_segments", {}).values()):
        return span[0]
    names = pm.__dict__.get("_nnc_names")
    if names is None:
        from .pieces import local_named_parameters, local_parameters
        names = {id(q): n for n, q in local_named_parameters(pm)}
        names.update({id(q): n for n, q in local_parameters(pm)})
        names.update(pm.__dict__.get("_nnc_orig_ids", {}))
        pm.__dict__["_nnc_names"] = names
    return names.get(id(p))


def local_names(pm, p) -> list[str]:
    """local_name as a list: [] for a tensor that is not pm's, one name per part of an
    original parameter pm holds as several parts (nncompile/rows.py)."""
    name = local_name(pm, p)
    if name is None:
        return []
    return list(name) if isinstance(name, tuple) else [name]


def split_groups(params) -> list[dict]:
    """What an optimizer's constructor accepts (tensors or group dicts) as group dicts."""
    if isinstance(params, torch.Tensor):
        params = [params]
    params = list(params)
    if not params:
        return []
    if isinstance(params[0], dict):
        out = []
        for g in params:
            ps = g["params"]
            out.append({**g, "params": [ps] if isinstance(ps, torch.Tensor) else list(ps)})
        return out
    return [{"params": params}]


def groups_by_name(pm, params) -> list[dict]:
    """Group dicts with local names instead of tensors (unknown tensors refused)."""
    out = []
    for g in split_groups(params):
        names = []
        for p in g["params"]:
            found = [p] if isinstance(p, str) else local_names(pm, p)
            if not found:
                shape = list(p.shape) if isinstance(p, torch.Tensor) else type(p).__name__
                raise ConfigError(
                    f"the optimizer was given a tensor {shape} that is not a parameter of "
                    f"this ParallelModule (nor of the module it was built from); pass "
                    f"pm.parameters() / pm.named_parameters() (or groups of them)")
            names += [n for n in found if n not in names]
        out.append({**g, "params": names})
    return out


# ---- adopting handles and released originals into torch optimizers ------------------------
_LOCK = threading.Lock()


def _targets(p, opt_cls) -> list[tuple[str, torch.Tensor]] | None:
    """What an optimizer steps instead of handle/original `p`, by local name (several for an
    original parameter pm holds as parts); None: keep p."""
    ref = getattr(p, "_nnc_handle", None) or getattr(p, "_nnc_origin", None)
    if ref is None:
        return None
    pm = ref[0]()
    if pm is None:
        raise ConfigError("the optimizer holds a parameter of a ParallelModule that no longer "
                          "exists; build the optimizer over the live module's parameters")
    if getattr(p, "_nnc_view", False):
        return None             # a DTensor over pm's piece: stepped as it is (global meaning)
    names = ref[1] if isinstance(ref[1], tuple) else (ref[1],)
    if pm.zero is not None:
        check_elementwise(opt_cls, "ZeRO-3")
        return [(n, zero3_segments(pm)[n]) for n in names]
    return [(n, getattr(pm, n)) for n in names]


def adopt(opt, groups: list[dict] | None = None) -> bool:
    """Swap handles and released originals in `opt`'s groups (or `groups`) for what pm steps,
    moving any state; returns whether any were swapped."""
    check_pieces(opt, opt.param_groups if groups is None else groups)
    swapped = False
    for g in (opt.param_groups if groups is None else groups):
        params = g["params"]
        if isinstance(params, torch.Tensor):
            params = g["params"] = [params]
        elif not isinstance(params, list):
            params = g["params"] = list(params)
        out = []
        for p in params:
            targets = _targets(p, type(opt)) if isinstance(p, torch.Tensor) else None
            if targets is None:
                out.append(p)
                if groups is None and _zero3_view(p):
                    _watch(opt)          # its state_dict() records the runs' layout
                continue
            swapped = True
            st = opt.state.pop(p, None) if groups is None else None
            for name, new in targets:     # parts of one original parameter: each in its place
                out.append(new)
                if st:                    # a resumed optimizer's moments: cut to what pm steps
                    from .carry_state import adopted_state
                    opt.state[new] = adopted_state(p, new, st, name)
                if getattr(new, "_nnc_flat", None) is not None:
                    _watch(opt)
        params[:] = out
    return swapped


def _watch(opt) -> None:
    """Once per optimizer stepping ZeRO-3 segments: zero_grad also clears the flat gradients,
    and state_dict records how the segments cut the parameters."""
    if opt.__dict__.get("_nnc_watched"):
        return
    opt.__dict__["_nnc_watched"] = True
    base = opt.zero_grad

    def zero_grad(set_to_none: bool = True):
        for g in opt.param_groups:
            for p in g["params"]:
                info = getattr(p, "_nnc_flat", None)
                if info is not None and info[0].grad is not None:
                    if set_to_none:
                        info[0].grad = None
                    else:
                        info[0].grad.zero_()
        return base(set_to_none=set_to_none)
    opt.zero_grad = zero_grad
    opt.register_state_dict_post_hook(_layout_hook)


def segment_layout(params: list, ranks: list[int], zero_rank: int, stage: int) -> dict:
    """How segments (in optimizer index order) cut the local parameters: the form
    merge.py reads under "nncompile_zero" (one entry per segment), with the ZeRO stage."""
    shards = []
    for p in params:
        name, s, e, numel = p._nnc_span
        shards.append({"names": [name], "numels": [numel], "lo": s, "hi": e})
    return {"zero_rank": zero_rank, "zero_size": len(ranks), "ranks": list(ranks),
            "stage": stage, "shards": shards}


def _zero3_view(p) -> bool:
    """Whether `p` is one of pm's ZeRO-3 DTensor parameters (runtime/zero3_views.py)."""
    tag = getattr(p, "_nnc_handle", None)
    pm = tag[0]() if tag is not None and getattr(p, "_nnc_view", False) else None
    return pm is not None and pm.zero is not None


def _layout_hook(opt, sd: dict) -> dict:
    """An optimizer over ZeRO-3 segments or DTensor parameters (whose local tensors are the
    same runs; their state stays torch's DTensors): the layout merge.py reads."""
    params = [p for g in opt.param_groups for p in g["params"]]
    if not params:
        return sd
    first = params[0]
    pm = first._nnc_pm() if getattr(first, "_nnc_flat", None) is not None else \
        first._nnc_handle[0]() if _zero3_view(first) else None
    if pm is None:
        return sd
    segs = zero3_segments(pm)
    runs = [p if getattr(p, "_nnc_flat", None) is not None else
            segs.get(p._nnc_handle[1]) if _zero3_view(p) else None for p in params]
    if any(r is None for r in runs):
        return sd
    sd["nncompile_zero"] = segment_layout(runs, pm.zero.ranks, pm.zero.rank, 3)
    return sd


def _pre_step(opt, args, kwargs) -> None:
    """Before every optimizer step: adopt what was added since, refresh segment grads."""
    groups = opt.param_groups
    count = sum(len(g["params"]) for g in groups)
    if opt.__dict__.get("_nnc_count") != count:
        with _LOCK:
            adopt(opt)
        opt.__dict__["_nnc_count"] = count
        from .optimizer import warn_unsharded       # (imported here: it imports this file)
        warn_unsharded(opt)
    if opt.__dict__.get("_nnc_watched"):
        for g in groups:
            refresh_grads(g["params"])


_ADD_PARAM_GROUP = torch.optim.Optimizer.add_param_group


def _add_param_group(self, param_group):
    """torch's add_param_group after swapping handles for segments (see the module doc)."""
    if isinstance(param_group, dict) and "params" in param_group:
        adopt(self, [param_group])
        if any(getattr(p, "_nnc_flat", None) is not None for p in param_group["params"]):
            _watch(self)
    return _ADD_PARAM_GROUP(self, param_group)


def install() -> None:
    """Once per process: the add_param_group swap and the step pre-hook."""
    if wrap_once(torch.optim.Optimizer, "add_param_group", _add_param_group) is None:
        return
    from torch.optim.optimizer import register_optimizer_step_pre_hook
    register_optimizer_step_pre_hook(_pre_step)


install()


# ---- the original module -------------------------------------------------------------------
_CLAIMED_LOCK = threading.Lock()
# the module's Parameters a pm registered as its own -> (that pm, local name); kept out of
# the Parameters' __dict__ so the module still pickles
_SHARED = WeakIdKeyDictionary()


def check_not_parallelized(module) -> None:
    """A module whose parameters a ParallelModule released, or holds DTensor views of, cannot
    be compiled again (parallelize calls this before tracing)."""
    for name, p in module.named_parameters(remove_duplicate=False):
        if released(p) or hasattr(p, "_nnc_view"):
            raise ConfigError(
                f"{type(module).__name__} was already parallelized: its parameter {name!r} "
                f"now lives in that ParallelModule (its storage was released, or the module "
                f"holds a DTensor view of pm's piece), so it cannot be compiled again; "
                f"parallelize a copy made before (copy.deepcopy(model)) or a freshly built "
                f"model")


def take_original(pm, module, state: dict, rows) -> dict[str, torch.nn.Parameter]:
    """{local name: the module's own Parameter} for parameters this rank keeps whole on its
    device (registered in pm as they are); a module already parallelized into a live pm is
    not shared again, and one whose parameters were released is refused."""
    out: dict[str, torch.nn.Parameter] = {}
    if module is None:
        return out
    params = dict(module.named_parameters(remove_duplicate=False))
    check_not_parallelized(module)
    if pm.INFERENCE_ONLY or pm.zero is not None:
        return out
    with _CLAIMED_LOCK:
        for row in rows:
            p = params.get(row.fqn)
            if p is None or state.get(row.fqn) is not p or p.is_meta or p.device != pm.device or \
                    tuple(p.shape) != tuple(b - a for a, b in row.slices) or \
                    any(a != 0 for a, _ in row.slices):
                continue
            if _held_elsewhere(p, pm):
                continue        # already some live pm's parameter: that pm keeps it
            if p.requires_grad != (row.name not in pm.FROZEN):
                continue
            _SHARED[p] = (weakref.ref(pm), row.name)
            out[row.name] = p
    return out


def _held_elsewhere(p, pm) -> bool:
    """Whether another live ParallelModule registered this very Parameter."""
    tag = _SHARED.get(p)
    if tag is None:
        return False
    owner = tag[0]()
    return owner is not None and owner is not pm and owner._parameters.get(tag[1]) is p


def release_original(pm, module, rows, shared: dict) -> None:
    """Free the module's parameters pm did not take as they are, keeping shape and dtype
    (their storage resized to nothing), so an optimizer built over them adopts pm's; calling
    the module then raises."""
    if module is None or pm.INFERENCE_ONLY:
        return
    params = dict(module.named_parameters(remove_duplicate=False))
    if any(p.is_meta for p in params.values()):
        return
    by_fqn: dict[str, str | tuple[str, ...]] = {}
    for row in rows:        # a parameter held as parts: all its parts' names, never shared
        if row.part is None:
            by_fqn[row.fqn] = row.name
        else:
            by_fqn[row.source] = (*by_fqn.get(row.source, ()), row.name)
    ids = {}
    gone = []
    for fqn, p in params.items():
        name = by_fqn.get(fqn)
        if name is None:
            continue
        ids[id(p)] = name
        if isinstance(name, str) and name in shared:
            continue
        if _held_elsewhere(p, pm):
            continue                    # another live pm computes with this very tensor
        p._nnc_origin = (weakref.ref(pm), name)
        p._nnc_fqn = fqn
        if not p.is_meta and p.numel():
            p.grad = None
            _free(p)                           # shape, dtype and device stay
            if type(p) is torch.nn.Parameter:  # print/copy/pickle say so, not read freed memory
                p.__class__ = ReleasedParameter
            gone.append(fqn)
    pm.__dict__["_nnc_orig_ids"] = ids
    if gone and not getattr(module, "_nnc_guard", False):
        module._nnc_guard = True
        module.register_forward_pre_hook(_released_forward(gone[0]))
    for fqn in gone:        # the modules holding them: their state_dict() would be storage-less
        owner = module.get_submodule(fqn.rpartition(".")[0])
        if not getattr(owner, "_nnc_sd_guard", False):
            owner._nnc_sd_guard = True
            owner.register_state_dict_pre_hook(_released_state_dict)
    # where one DTensor describes pm's piece, the module holds that instead
    from .module_views import view_released      # (imported here: it imports this file)
    view_released(pm, module, rows)
    from .stage_params import release_other_stages
    release_other_stages(pm, module, rows)


def _free(p: torch.nn.Parameter) -> None:
    """Give back p's memory, keeping its shape: its storage resized to nothing (one that
    cannot resize, which from_pretrained maps from the safetensors file, first swapped for a
    fresh one)."""
    if not p.untyped_storage().resizable():
        p.data = torch.empty_like(p.data)       # never written: no memory is touched
    p.untyped_storage().resize_(0)


class ReleasedParameter(torch.nn.Parameter):
    """An original module's Parameter whose storage a ParallelModule freed (still a Parameter,
    same shape, dtype and device, adopted by the optimizer's next step). Reading its values
    would read freed memory, so its metadata (shape, dtype, requires_grad, ...) reads as
    before, and computing with it, reading `.data`, printing, copying or pickling it is an
    error that names what to do:

        before: model.lm_head.weight.norm()     -> the process crashes (SIGSEGV: no storage)
        after:  ConfigError: cannot compute norm on the parameter 'lm_head.weight' [64, 32] of
                a module that was parallelized: ... pm.gather_params()['lm_head.weight'] ...
    """

    def __repr__(self) -> str:
        dtype = str(self.dtype).replace("torch.", "")
        return (f"<released Parameter {list(self.shape)} {dtype}: its values live in the "
                f"ParallelModule returned by nncompile.parallelize (pm.gather_params() gives "
                f"them whole)>")

    __str__ = __repr__

    def _refuse(self, what: str):
        raise ConfigError(
            f"cannot {what} a parameter of a module that was parallelized: its storage was "
            f"released and its values live in the ParallelModule; {what} the model before "
            f"nncompile.parallelize (copy.deepcopy(model)), or save pm's state "
            f"(nncompile.save_checkpoint / pm.gather_params())")

    def __deepcopy__(self, memo):
        self._refuse("copy")

    def __reduce_ex__(self, protocol):
        self._refuse("pickle")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in _metadata_functions():
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        p = next((a for a in (*args, *(kwargs or {}).values()) if isinstance(a, cls)), None)
        name = function_name(func)
        origin = getattr(p, "_nnc_origin", None)
        fqn = getattr(p, "_nnc_fqn", None) or (origin[1] if origin else "?")
        shape = list(p.shape) if p is not None else "?"
        verb = f"read .{name} of" if name in ("data", "T", "mT", "H", "real", "imag") else \
            f"compute {name} on"
        raise ConfigError(
            f"cannot {verb} the parameter {fqn!r} {shape} of a module that was "
            f"parallelized: its storage was released and its values live in the "
            f"ParallelModule (pm) that nncompile.parallelize returned. Read them whole with "
            f"pm.gather_params()[{fqn!r}] (every rank calls it), or use pm's own parameters "
            f"(pm.named_parameters()); edits belong on those, or on the model before "
            f"parallelize")


def function_name(func) -> str:
    """The name a __torch_function__ override sees: a method's, or a property's (.data, .T)."""
    name = getattr(func, "__name__", str(func))
    if name in ("__get__", "__set__"):
        name = getattr(getattr(func, "__self__", None), "__name__", name)
    return name


_METADATA: frozenset | None = None


def _metadata_functions() -> frozenset:
    """What a ReleasedParameter answers: its shape, dtype, device, flags and gradient slot,
    never its values."""
    global _METADATA
    if _METADATA is None:
        T = torch.Tensor
        props = ["shape", "dtype", "device", "is_meta", "is_cuda", "is_cpu", "is_sparse",
                 "is_quantized", "is_nested", "layout", "ndim", "requires_grad", "grad",
                 "is_leaf", "grad_fn", "names", "_base", "_version", "is_mkldnn", "itemsize",
                 "nbytes", "_grad", "_grad_fn", "output_nr", "_cdata", "is_xla", "is_mps",
                 "is_xpu", "is_ipu", "is_mtia", "is_vulkan", "is_maia"]
        funcs = {getattr(T, n).__get__ for n in props if hasattr(T, n)}
        funcs |= {getattr(T, n).__set__ for n in ("requires_grad", "grad", "_grad")
                  if hasattr(T, n)}
        funcs |= {getattr(T, n).__delete__ for n in ("grad",) if hasattr(T, n)}
        funcs |= {getattr(T, n) for n in (
            "size", "dim", "numel", "nelement", "element_size", "stride", "storage_offset",
            "untyped_storage", "data_ptr", "requires_grad_", "is_floating_point",
            "is_complex", "is_contiguous", "get_device", "type", "__hash__", "__format__",
            "_is_view", "is_shared", "is_pinned", "register_hook",
            "register_post_accumulate_grad_hook", "retain_grad", "__setstate__",
            "_typed_storage", "storage") if hasattr(T, n)}
        funcs |= {getattr(torch, n) for n in ("is_floating_point", "is_complex", "numel")}
        _METADATA = frozenset(funcs)
    return _METADATA


def released(p) -> bool:
    """Whether `p` is an original module's parameter whose storage a ParallelModule freed."""
    return getattr(p, "_nnc_origin", None) is not None and not p.is_meta and p.numel() > 0 \
        and p.untyped_storage().size() == 0


def _released_state_dict(module, prefix: str, keep_vars: bool) -> None:
    """state_dict() of a module whose parameters a ParallelModule released: an error naming
    what to save instead (the tensors have no storage; torch.save would write empty ones)."""
    for name, p in module.named_parameters(recurse=False):
        if released(p):
            raise CheckpointError(
                f"state_dict() of the module given to nncompile.parallelize (or a submodule): "
                f"its parameter "
                f"{prefix + name!r} (and the others the plan shards) was released when it was "
                f"parallelized and now lives in the ParallelModule, so this state dict would "
                f"hold tensors without storage. Save a checkpoint with "
                f"nncompile.save_checkpoint(dir, pm, optimizer) (resume with "
                f"nncompile.load_checkpoint; `python -m nncompile merge dir -o merged.pt` makes "
                f"the state dict this module loads), or take the full weights with "
                f"pm.gather_params() (by the same names; every rank calls it)")


def _released_forward(example: str):
    def hook(module, args):
        try:
            p = module.get_parameter(example)
        except AttributeError:          # the parameter was taken out of the module since
            return None
        if released(p) or getattr(p, "_nnc_handle", None) is not None:
            raise ConfigError(
                f"{type(module).__name__} was parallelized: its parameters (e.g. {example!r}) "
                f"now live in the ParallelModule returned by nncompile.parallelize (the "
                f"module holds released tensors or DTensor views of pm's pieces); call that "
                f"module (pm(...)) instead, or "
                f"parallelize a copy (copy.deepcopy(model)) to keep this one usable")
        return None
    return hook
