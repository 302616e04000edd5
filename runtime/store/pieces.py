"""The tensors pm computes with, where its parameters are DTensor views of them.

Under a plan that splits parameters (tp, tp_sp, autodist's splits, context and expert
parallelism), pm.parameters() are DTensor Parameters (runtime/store/module_views.py, view_pieces)
and this rank's pieces sit under them, in pm.__dict__, where the generated code's
`self.<name>` finds them. The reducer, build_optimizer's fast path, clipping and checkpoints
work on the pieces:

    pm.named_parameters()        -> ("h.0.mlp_fc.weight", DTensor [128, 32] (Shard(0),))
    local_named_parameters(pm)   -> ("h0_mlp_fc_weight", the same DTensor)   the rank file's name
    local_parameters(pm)         -> ("h0_mlp_fc_weight", tensor [64, 32])    its local tensor's base
"""
from __future__ import annotations

import torch
import weakref


def pieces_of(pm) -> dict[str, torch.Tensor]:
    """{local name: the piece the generated code computes with} for parameters that are
    DTensor views (empty elsewhere: there pm's parameters are the pieces)."""
    return pm.__dict__.get("_nnc_pieces", {})


def local_named_parameters(pm):
    """pm's parameters under their local names (the rank file's attributes, what the
    runtime's bookkeeping is keyed by); pm.named_parameters() gives the model's names."""
    return torch.nn.Module.named_parameters(pm)


def local_named_buffers(pm):
    """pm's buffers under their local names (see local_named_parameters)."""
    return torch.nn.Module.named_buffers(pm)


def local_parameters(pm) -> list[tuple[str, torch.Tensor]]:
    """local_named_parameters(pm) with each DTensor view replaced by the piece under it."""
    pieces = pieces_of(pm)
    return [(n, pieces.get(n, p)) for n, p in local_named_parameters(pm)]


__all__ = ["pieces_of", "local_parameters", "local_named_parameters", "local_named_buffers"]


_LIVE: "weakref.WeakSet" = weakref.WeakSet()     # ParallelModules built in this process


def track(pm) -> None:
    """Let torch.nn.utils.clip_grad_norm_ recognize pm's parameters (called at load)."""
    _LIVE.add(pm)


def _tagged_owner(p):
    """The ParallelModule a per-parameter ZeRO-3 handle or segment, or a released parameter
    of the original module, was made for (zero3_handles.py, released.py tag them), else None."""
    for attr in ("_nnc_handle", "_nnc_origin"):
        tag = getattr(p, attr, None)
        if tag is not None:
            return tag[0]()
    ref = getattr(p, "_nnc_pm", None)
    return ref() if ref is not None else None
