"""Gradient clipping by the true global norm of a ParallelModule's gradients.

After backward, a sharded parameter's gradient is split across the plan unit (each piece
counted once: summed over the plan group), a replicated one is identical on every rank of the
unit (counted once, locally), and every data-parallel unit holds the same reduced gradients
(nothing to sum across units). So the norm equals the single-device norm of the same model.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .rows import param_rows


def clip_grad_norm_(pm, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False) -> torch.Tensor:
    """Scale `pm`'s gradients in place so their global `norm_type` norm is at most `max_norm`;
    returns the norm before clipping (like torch.nn.utils.clip_grad_norm_). Every rank calls it."""
    norm_type = float(norm_type)
    sharded, replicated = [], []
    for row in param_rows(pm):
        grad = getattr(pm, row.name).grad
        if grad is not None:
            (sharded if row.sharded else replicated).append(grad.detach())
    device = pm.device
    if math.isinf(norm_type):
        def part(gs):
            return max((g.abs().max().float() for g in gs), default=torch.zeros((), device=device))
        local = part(sharded).to(device)
        if pm.plan_group is not None:
            dist.all_reduce(local, op=dist.ReduceOp.MAX, group=pm.plan_group)
        total = torch.maximum(local, part(replicated).to(device))
    else:
        def part(gs):
            return sum((g.float().norm(norm_type) ** norm_type for g in gs),
                       torch.zeros((), device=device))
        local = part(sharded)
        if pm.plan_group is not None:
            dist.all_reduce(local, group=pm.plan_group)
        total = (local + part(replicated)) ** (1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"the total norm of order {norm_type} of the gradients is "
                           f"{float(total)}; pass error_if_nonfinite=False to clip anyway")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in sharded + replicated:
        g.mul_(coef.to(g.dtype))
    return total
