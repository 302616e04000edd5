"""The module given to parallelize, after it: which of its parameters pm took as they are, and
the released rest.

A parameter a rank keeps whole (full slice, same device, not ZeRO-3) is registered in pm as
the very same Parameter (take_original), so an optimizer built before `parallelize` steps what
pm computes with. The others are released (release_original: their storage resized to
nothing, which frees their memory; shape and dtype stay) until module_views.py puts a DTensor
view of pm's piece in their place; one kept released computes nothing:

    before: model.lm_head.weight.norm()     -> the process crashes (SIGSEGV: no storage)
    after:  ConfigError: cannot compute norm on the parameter 'lm_head.weight' [64, 32] of a
            module that was parallelized: ... pm.gather_params()['lm_head.weight'] ...
"""
from __future__ import annotations

import threading
import weakref

import torch
from torch.utils.weak import WeakIdKeyDictionary

from nncompile.errors import CheckpointError, ConfigError


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


def release_original(pm, module, rows, shared: dict) -> bool:
    """Free the module's parameters pm did not take as they are, keeping shape and dtype
    (their storage resized to nothing), so an optimizer built over them adopts pm's; calling
    the module then raises. False: nothing to release (no module, inference, or on meta)."""
    if module is None or pm.INFERENCE_ONLY:
        return False
    params = dict(module.named_parameters(remove_duplicate=False))
    if any(p.is_meta for p in params.values()):
        return False
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
    return True


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
