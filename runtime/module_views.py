"""The module given to parallelize holds DTensor views of pm's parameters.

Under a plan that shards parameters (tp, tp_sp, autodist's splits, context and expert
parallelism) pm keeps one rank's piece of each weight, and the module's own copy is released
(runtime/param_handles.py). Each released parameter is then replaced, in the module, by a
DTensor Parameter on the plan's device mesh (the one DCP checkpoints use, runtime/dcp.py) whose
local tensor is a view of pm's piece. Code that reads or edits `pm.module`'s weights (DDP's
`model.module` habit) works as on one device and acts on what pm trains:

    before: pm.module.h[0].mlp_fc.weight.norm()        -> the process crashed (no storage)
    after:  the DTensor norm over the plan (every rank calls it, as under FSDP2)
            pm.module.h[0].mlp_fc.weight.data.clamp_(-c, c)   -> clamps pm's piece
            pm.module.h[0].requires_grad_(False)       -> that block gets no gradient and no
                                                          update from the next forward on
            pm.module.state_dict()                     -> DTensors under the original names

A flag set on a view (`requires_grad_`) reaches pm's piece at pm's next forward. Kept released
(computing with them is a clear error): ZeRO-3's (its pieces are flat runs of whole layers), a
parameter held as parts of a fused one (q|k|v rows split by heads), and pipelined plans'.
"""
from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

from .dcp import _dtensor
from .param_handles import ReleasedParameter


def view_released(pm, module: torch.nn.Module, rows) -> list[str]:
    """Replace `module`'s released parameters by DTensor views of pm's pieces where one
    DTensor describes the piece; returns the FQNs that stay released."""
    params = list(module.named_parameters(remove_duplicate=False))
    released = [fqn for fqn, p in params if isinstance(p, ReleasedParameter)]
    if not released or pm.zero is not None or pm.PIPELINE is not None or \
            not dist.is_initialized():
        return released
    by_fqn = {row.fqn: row for row in rows if row.part is None}
    made: dict[int, torch.nn.Parameter] = {}     # id(original) -> its view (ties share one)
    views, still = [], []
    for fqn, p in params:
        if not isinstance(p, ReleasedParameter):
            continue
        row = by_fqn.get(fqn)
        local = pm._parameters.get(row.name) if row is not None else None
        if local is None or not local.is_contiguous() or local.device != p.device:
            still.append(fqn)
            continue
        view = made.get(id(p))
        if view is None:
            view = torch.nn.Parameter(_dtensor(pm, local.detach(), row),
                                      requires_grad=p.requires_grad)
            view._nnc_handle = (weakref.ref(pm), row.name)    # an optimizer steps pm's piece
            made[id(p)] = view
            views.append([view, local, view.requires_grad])
        owner, _, leaf = fqn.rpartition(".")
        module.get_submodule(owner)._parameters[leaf] = view
    if views:
        pm.__dict__["_nnc_views"] = views
        pm.register_forward_pre_hook(sync_requires_grad)
    return still


def sync_requires_grad(pm, args) -> None:
    """A view's requires_grad changed since the last forward (pm.module's
    `requires_grad_(False)` to freeze, or True to unfreeze): pm's piece follows."""
    for entry in pm.__dict__.get("_nnc_views", ()):
        view, local, seen = entry
        flag = view.requires_grad
        if flag != seen:
            local.requires_grad_(flag)
            entry[2] = flag


__all__ = ["view_released", "sync_requires_grad"]
