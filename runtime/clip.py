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


def _grads(pm):
    """(pieces, their ZeRO group, regular): gradient pieces of a ZeRO-2/3 flat vector (each
    rank of the group holds one; summed over the group) and whole local gradients, each as
    (tensor, sharded over the plan unit)."""
    owner = pm.zero if pm.zero is not None else pm._grad_shards
    pieces = list(owner.grad_pieces()) if owner is not None else []
    group = owner.group if owner is not None else None
    regular = []
    if pm.zero is None:
        for row in param_rows(pm):
            grad = getattr(pm, row.name).grad
            if grad is not None:
                regular.append((grad, row.sharded))
    return pieces, group, regular


def clip_grad_norm_(pm, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False) -> torch.Tensor:
    """Scale `pm`'s gradients in place so their global `norm_type` norm is at most `max_norm`;
    returns the norm before clipping (like torch.nn.utils.clip_grad_norm_). Every rank calls it.
    Under ZeRO-2/3 the pieces of each flat gradient are summed over the ZeRO group first."""
    norm_type = float(norm_type)
    pieces, zero_group, regular = _grads(pm)
    device = pm.device
    inf = math.isinf(norm_type)

    def part(gs):
        gs = [g.detach() for g in gs]
        if inf:
            return max((g.abs().max().float().to(device) for g in gs),
                       default=torch.zeros((), device=device))
        return sum((g.float().norm(norm_type).to(device) ** norm_type for g in gs),
                   torch.zeros((), device=device))

    op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM

    def combine(a, b):
        return torch.maximum(a, b) if inf else a + b

    totals = []
    for sharded in (True, False):
        local = part([g for g, s in pieces if s == sharded])
        if zero_group is not None:
            dist.all_reduce(local, op=op, group=zero_group)
        local = combine(local, part([g for g, s in regular if s == sharded]))
        if sharded and pm.plan_group is not None:
            dist.all_reduce(local, op=op, group=pm.plan_group)
        totals.append(local)
    total = combine(*totals)
    if not inf:
        total = total ** (1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"the total norm of order {norm_type} of the gradients is "
                           f"{float(total)}; pass error_if_nonfinite=False to clip anyway")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g, _ in pieces + regular:
        g.detach().mul_(coef.to(g.device, g.dtype))
    return total
