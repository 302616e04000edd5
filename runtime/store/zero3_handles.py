"""ZeRO-3 parameters where no one DTensor describes a rank's run (0-d tensors, one process
without a process group, groups of replicas spanning context or expert ranks; elsewhere,
ZeRO-3 over groups of the data-parallel ranks and pipelines included, pm.named_parameters()
are the module's Shard(0) DTensors, runtime/store/zero3_views.py): edits that mean what they mean on one device,
reads that say where the values are.

Under ZeRO-3 a rank stores flat pieces of whole layers (runtime/store/zero.py); pm registers a
storage-less handle per parameter (make_handles, below) with the shape of this rank's
(tensor-parallel) shard. Element-wise in-place edits of a handle apply to this rank's run of
the parameter in its flat piece, so, with every rank doing the same, the whole weight is
edited as on one device; reading its values is an error naming what to read instead, never
a silent no-op on the meta device:

    before: with torch.no_grad(): p.clamp_(-c, c)      -> nothing happens (a meta tensor)
    after:  this rank's run of p is clamped: the weights equal one device's

    before: ema = p.detach().clone()                    -> a meta tensor, silently
    after:  a copy of this rank's run (its own storage), which takes the same element-wise
            edits: ema.lerp_(p, 0.01), ema.mul_(d).add_(p, alpha=1 - d),
            torch._foreach_lerp_(emas, params, 0.01), and p.copy_(ema) to evaluate with it

    before: p.norm(), p + 1                              -> meta tensors, silently
    after:  ConfigError: ... pm.gather_params() ...

A tensor argument shaped like the parameter (`p.copy_(w)`, `p.lerp_(w, 0.1)`) is cut to the
same run; a handle or copy of the same parameter (of pm or of a copy of pm) gives its run.
`p.data` and `p.detach()` give the handle again (without requires_grad), so
`p.data.clamp_(...)` works too; `clone()` and `copy.deepcopy` give copies.
"""
from __future__ import annotations

import torch

from nncompile.errors import ConfigError

from .released import _metadata_functions, function_name
from .segments import zero3_segments
import weakref

# element-wise in-place methods: applied to this rank's run
_INPLACE = frozenset({
    "clamp_", "clamp_min_", "clamp_max_", "clip_", "mul_", "div_", "add_", "sub_", "fill_",
    "zero_", "copy_", "lerp_", "addcmul_", "addcdiv_", "neg_", "abs_", "sign_", "sgn_",
    "sqrt_", "rsqrt_", "exp_", "log_", "pow_", "masked_fill_", "nan_to_num_", "tanh_",
    "sigmoid_", "floor_", "ceil_", "round_", "trunc_", "reciprocal_", "square_", "true_divide_",
    "__imul__", "__iadd__", "__isub__", "__itruediv__"})
# conversions nn.Module._apply runs on every parameter (pm.to(...), pm.float()): as before
_PASS = frozenset({"to", "cuda", "cpu", "float", "double", "half", "bfloat16", "type",
                   "share_memory_", "pin_memory", "__reduce_ex__", "_make_subclass"})


class ZeroHandle(torch.nn.Parameter):
    """A ZeRO-3 parameter handle (see the module docstring)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _metadata_functions() or function_name(func) in _PASS:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        handle = args[0] if args and isinstance(args[0], cls) else None
        name = function_name(func)
        if handle is not None and name in ("data", "detach"):
            return _alias(handle)
        if handle is not None and name == "clone":
            return _copy(handle)
        if name.startswith("_foreach_") and name[len("_foreach_"):] in _INPLACE and args and \
                isinstance(args[0], (list, tuple)):
            return _foreach(name[len("_foreach_"):], args, kwargs)
        if handle is not None and name == "copy_" and len(args) > 1 and \
                getattr(args[1], "_nnc_handle", None) == handle._nnc_handle and \
                "_nnc_run" not in args[1].__dict__ and "_nnc_run" not in handle.__dict__:
            return handle          # itself (load_state_dict after loading the flat pieces)
        if handle is not None and name in _INPLACE:
            _edit(handle, func, args[1:], kwargs)
            return handle
        _refuse(next((a for a in (*args, *kwargs.values()) if isinstance(a, cls)), handle),
                name)


    def __deepcopy__(self, memo):
        return _copy(self)


def _alias(handle: ZeroHandle) -> ZeroHandle:
    with torch._C.DisableTorchFunctionSubclass():
        alias = torch.empty(handle.shape, dtype=handle.dtype, device="meta")
    alias = ZeroHandle(alias, requires_grad=False)
    alias._nnc_handle = handle._nnc_handle
    run = handle.__dict__.get("_nnc_run")
    if run is not None:
        alias._nnc_run = run          # a copy's alias edits the copy
    return alias


def _copy(handle: ZeroHandle) -> ZeroHandle:
    """A detached copy of `handle`'s run on this rank: edited like a handle, never stepped."""
    alias = _alias(handle)
    alias._nnc_run = _run(handle).detach().clone()
    return alias


def _run(x: ZeroHandle) -> torch.Tensor:
    """This rank's run of a handle (a view of its flat piece) or of a copy (its own)."""
    run = x.__dict__.get("_nnc_run")
    if run is not None:
        return run
    pm, name = x._nnc_handle[0](), x._nnc_handle[1]
    return zero3_segments(pm)[name]


def _span(x: ZeroHandle) -> tuple:
    pm, name = x._nnc_handle[0](), x._nnc_handle[1]
    return zero3_segments(pm)[name]._nnc_span


def _foreach(op: str, args: tuple, kwargs: dict):
    """torch._foreach_<op>_(tensors, others..., **kw) as one edit per tensor (EMA code)."""
    tensors = list(args[0])
    for i, t in enumerate(tensors):
        rest = [a[i] if isinstance(a, (list, tuple)) else a for a in args[1:]]
        getattr(torch.Tensor, op)(t, *rest, **kwargs)
    return None


def _edit(handle: ZeroHandle, func, rest: tuple, kwargs: dict) -> None:
    name = handle._nnc_handle[1]
    span = _span(handle)
    _, start, stop, _ = span
    shape = tuple(handle.shape)

    def run(x):
        if isinstance(x, ZeroHandle):
            if _span(x) != span or tuple(x.shape) != shape:
                _refuse(x, f"{function_name(func)} with pm's ZeRO-3 parameter {name!r} (its "
                        f"argument is another parameter, whose run on this rank differs)")
            return _run(x).detach()
        if torch.is_tensor(x) and x.dim() > 0:
            if tuple(x.shape) != shape:
                raise ConfigError(
                    f"{function_name(func)} on pm's ZeRO-3 parameter {name!r} {list(shape)} "
                    f"with a "
                    f"tensor of shape {list(x.shape)}: under ZeRO-3 an edit takes scalars or "
                    f"tensors shaped like the parameter (each rank applies its run of them)")
            return x.detach().reshape(-1)[start:stop].to(target.device)
        return x
    target = _run(handle).detach()
    with torch.no_grad():
        func(target, *map(run, rest), **{k: run(v) for k, v in kwargs.items()})


def _refuse(handle, what: str):
    tag = getattr(handle, "_nnc_handle", None)
    name = tag[1] if tag else "?"
    shape = list(handle.shape) if handle is not None else "?"
    raise ConfigError(
        f"cannot compute {what} on pm's ZeRO-3 parameter {name!r} {shape}: under ZeRO-3 its "
        f"values are spread over the data-parallel ranks' flat pieces (runtime/store/zero.py), so "
        f"only in-place element-wise edits (clamp_, mul_, fill_, copy_ of a tensor of its "
        f"shape, ...) apply to it as on one device. Read whole weights with "
        f"pm.gather_params() (every rank calls it; keys are the original names), or train "
        f"with use_zero 0, 1 or 2, where parameters are ordinary tensors")


__all__ = ["ZeroHandle"]


def make_handles(pm) -> None:
    """Register a storage-less handle per local parameter (ZeRO-3), by local name; its
    element-wise in-place edits apply to its segment (runtime/store/zero3_handles.py)."""
    from nncompile.rows import param_rows
    from .zero3_handles import ZeroHandle
    rows = {row.name: row for row in param_rows(pm)}
    for unit in pm.zero.units:
        flat = pm.zero.flat(unit)
        for name in unit.layout.names:
            h = ZeroHandle(torch.empty(rows[name].local_shape, dtype=flat.dtype,
                                       device="meta"), requires_grad=unit.trainable)
            h._nnc_handle = (weakref.ref(pm), name)
            pm.register_parameter(name, h)
