"""Reading a number out of one of pm's DTensors: one device's value, or a clear error.

pm's parameters, and their gradients, are DTensors over the plan's mesh. A reduction of one
(`p.grad.norm()`, `p.sum()`) is a DTensor whose value is spread over the ranks (a partial),
and torch's DTensor answers `.item()` / `float()` with this rank's part, silently:

    before: p.grad.norm().item()   -> 0.634 on one rank, 0.581 on the other (one device: 0.889)
    after:  ValueReadError: ... p.grad.norm().full_tensor().item() on every rank ...

A rank cannot tell here whether the other ranks read the same value (rank 0 alone logging
is common), so a collective would hang them: the read is refused instead, naming the calls
that give one device's value. `nncompile.grad_norms(pm)` gives every gradient's norm at once.

This is the one entry nncompile puts into torch's DTensor dispatch (its table of per-op
handlers, for `aten._local_scalar_dense`, the op behind `.item()`); it acts only on DTensors
over a mesh nncompile made, and on the others does what torch does.
"""
from __future__ import annotations

import weakref

import torch

from nncompile import compat
from nncompile.errors import ValueReadError

_MESHES: "weakref.WeakSet" = weakref.WeakSet()     # meshes nncompile made


def _local_scalar(op, args, kwargs):
    t = args[0]
    placements = t.placements
    if t.device_mesh in _MESHES and any(p.is_partial() or p.is_shard() for p in placements):
        spread = ", ".join(map(str, placements))
        raise ValueReadError(
            f"reading a number out of a DTensor spread over the ranks ({spread}) would give "
            "this rank's part, not the value one device computes; call .full_tensor() on it "
            "first, on every rank (for example p.grad.norm().full_tensor().item()), or "
            "nncompile.grad_norms(pm) for every parameter's gradient norm (every rank calls "
            "them: they communicate)")
    return op(t.to_local(), *args[1:], **kwargs)


def own_mesh(mesh) -> None:
    """`mesh` is nncompile's: reading a partial DTensor over it is refused (installs the
    handler the first time)."""
    compat.add_dtensor_op_handler(torch.ops.aten._local_scalar_dense.default, _local_scalar)
    _MESHES.add(mesh)


def grad_norms(pm) -> dict[str, float]:
    """{name: the L2 norm of its gradient} for each of pm's parameters that has one, as one
    device computes it (a pipeline rank: its stages' parameters). Every rank calls it."""
    from torch.distributed.tensor import DTensor
    out = {}
    for name, p in pm.named_parameters():
        if p.grad is None:
            continue
        norm = p.grad.detach().norm()
        out[name] = float(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    return out


__all__ = ["own_mesh", "grad_norms"]
