"""Gradient clipping by the true global norm of a ParallelModule's gradients.

After backward, a sharded parameter's gradient is split across the plan unit (each piece
counted once: summed over the plan group), a replicated one is identical on every rank of the
unit (counted once, locally), and every data-parallel unit holds the same reduced gradients
(nothing to sum across units). Under a pipeline each stage's total is summed over the
pipeline ranks, a tied weight counted on the lowest stage holding it only (its copies are
equal). So the norm equals the single-device norm of the same model.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .groups import pipe_group
from .rows import param_rows
from .state import first_holder


def _kept(piece: torch.Tensor, layout, skip: set[str]) -> torch.Tensor:
    """A flat piece (elements [lo, hi) of `layout`) without the elements of tensors in
    `skip` (a tied weight another stage counts)."""
    cuts, offset = [], 0
    for name, n in zip(layout.names, layout.numels):
        a, b = max(layout.lo, offset), min(layout.hi, offset + n)
        if name in skip and a < b:
            cuts.append((a - layout.lo, b - layout.lo))
        offset += n
    if not cuts:
        return piece
    kept, start = [], 0
    for a, b in cuts:
        kept.append(piece[start:a])
        start = b
    kept.append(piece[start:])
    return torch.cat(kept)


def _grads(pm):
    """(pieces, their ZeRO group, regular, every gradient to scale): gradient pieces of a
    ZeRO-2/3 flat vector (each rank of the group holds one; summed over the group) and whole
    local gradients, each as (tensor, sharded over the plan unit), without a tied weight's
    copies on stages other than the lowest holding it."""
    rows = param_rows(pm)
    sharded = {row.name: row.sharded for row in rows}
    skip = {row.name for row in rows if not first_holder(pm, row.fqn)}
    flats = []                                  # (gradient piece, layout, sharded)
    if pm.zero is not None:
        flats = [(pm.zero.flat(u).grad, u.layout, sharded[u.layout.names[0]])
                 for u in pm.zero.units if u.trainable]
    elif pm._grad_shards is not None:
        flats = [(s.grad, s.layout, s.sharded) for s in pm._grad_shards.shards]
    flats = [f for f in flats if f[0] is not None]
    owner = pm.zero if pm.zero is not None else pm._grad_shards
    group = owner.group if owner is not None else None
    pieces = [(_kept(g, layout, skip), s) for g, layout, s in flats]
    regular, scale = [], [g for g, _, _ in flats]
    if pm.zero is None:
        for row in rows:
            grad = getattr(pm, row.name).grad
            if grad is not None:
                scale.append(grad)
                if row.name not in skip:
                    regular.append((grad, row.sharded))
    return pieces, group, regular, scale


def clip_grad_norm_(pm, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False) -> torch.Tensor:
    """Scale `pm`'s gradients in place so their global `norm_type` norm is at most `max_norm`;
    returns the norm before clipping (like torch.nn.utils.clip_grad_norm_). Every rank calls it.
    Under ZeRO-2/3 the pieces of each flat gradient are summed over the ZeRO group first, under
    a pipeline the stages' totals over the pipeline ranks."""
    norm_type = float(norm_type)
    pieces, zero_group, regular, scale = _grads(pm)
    device = pm.device
    inf = math.isinf(norm_type)

    def part(gs):
        gs = [g.detach() for g in gs if g.numel()]
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
    if pm.PIPE_RANKS > 1 and dist.is_initialized():
        dist.all_reduce(total, op=op,
                        group=pipe_group(pm.PLAN_NGPUS, pm.RUNTIME_NGPUS, pm.PIPE_RANKS)[0])
    if not inf:
        total = total ** (1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"the total norm of order {norm_type} of the gradients is "
                           f"{float(total)}; pass error_if_nonfinite=False to clip anyway")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in scale:
        g.detach().mul_(coef.to(g.device, g.dtype))
    return total
