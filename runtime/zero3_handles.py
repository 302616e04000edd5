"""ZeRO-3 parameters as pm.named_parameters() shows them: edits that mean what they mean on
one device, reads that say where the values are.

Under ZeRO-3 a rank stores flat pieces of whole layers (runtime/zero.py); pm registers a
storage-less handle per parameter (runtime/param_handles.py) with the shape of this rank's
(tensor-parallel) shard. Element-wise in-place edits of a handle apply to this rank's run of
the parameter in its flat piece, so, with every rank doing the same, the whole weight is
edited as on one device; reading its values is an error naming what to read instead, never
a silent no-op on the meta device:

    before: with torch.no_grad(): p.clamp_(-c, c)      -> nothing happens (a meta tensor)
    after:  this rank's run of p is clamped: the weights equal one device's

    before: ema = p.detach().clone()                    -> a meta tensor, silently
    after:  ConfigError: ... pm.gather_params() ...

A tensor argument shaped like the parameter (`p.copy_(w)`, `p.lerp_(w, 0.1)`) is cut to the
same run. `p.data` and `p.detach()` give the handle again (without requires_grad), so
`p.data.clamp_(...)` works too.
"""
from __future__ import annotations

import torch

from nncompile.errors import ConfigError

from .param_handles import _metadata_functions, function_name, zero3_segments

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
        if handle is not None and name == "copy_" and len(args) > 1 and \
                getattr(args[1], "_nnc_handle", None) == handle._nnc_handle:
            return handle          # itself (load_state_dict after loading the flat pieces)
        if handle is not None and name in _INPLACE:
            _edit(handle, func, args[1:], kwargs)
            return handle
        _refuse(next((a for a in (*args, *kwargs.values()) if isinstance(a, cls)), handle),
                name)


def _alias(handle: ZeroHandle) -> ZeroHandle:
    with torch._C.DisableTorchFunctionSubclass():
        alias = torch.empty(handle.shape, dtype=handle.dtype, device="meta")
    alias = ZeroHandle(alias, requires_grad=False)
    alias._nnc_handle = handle._nnc_handle
    return alias


def _edit(handle: ZeroHandle, func, rest: tuple, kwargs: dict) -> None:
    pm, name = handle._nnc_handle[0](), handle._nnc_handle[1]
    seg = zero3_segments(pm)[name]
    _, start, stop, _ = seg._nnc_span
    shape = tuple(handle.shape)

    def run(x):
        if isinstance(x, ZeroHandle):
            _refuse(x, function_name(func) + " (with another ZeRO-3 parameter as its argument)")
        if torch.is_tensor(x) and x.dim() > 0:
            if tuple(x.shape) != shape:
                raise ConfigError(
                    f"{function_name(func)} on pm's ZeRO-3 parameter {name!r} {list(shape)} "
                    f"with a "
                    f"tensor of shape {list(x.shape)}: under ZeRO-3 an edit takes scalars or "
                    f"tensors shaped like the parameter (each rank applies its run of them)")
            return x.detach().reshape(-1)[start:stop].to(seg.device)
        return x
    with torch.no_grad():
        func(seg.detach(), *map(run, rest), **{k: run(v) for k, v in kwargs.items()})


def _refuse(handle, what: str):
    tag = getattr(handle, "_nnc_handle", None)
    name = tag[1] if tag else "?"
    shape = list(handle.shape) if handle is not None else "?"
    raise ConfigError(
        f"cannot compute {what} on pm's ZeRO-3 parameter {name!r} {shape}: under ZeRO-3 its "
        f"values are spread over the data-parallel ranks' flat pieces (runtime/zero.py), so "
        f"only in-place element-wise edits (clamp_, mul_, fill_, copy_ of a tensor of its "
        f"shape, ...) apply to it as on one device. Read whole weights with "
        f"pm.gather_params() (every rank calls it; keys are the original names), or train "
        f"with use_zero 0, 1 or 2, where parameters are ordinary tensors")


__all__ = ["ZeroHandle"]
