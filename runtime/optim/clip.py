"""Gradient clipping by the true global norm of a ParallelModule's gradients.

After backward, a sharded parameter's gradient is split across the plan unit (each piece
counted once: summed over the plan group), a replicated one is identical on every rank of the
unit (counted once, locally), and every data-parallel unit holds the same reduced gradients
(nothing to sum across units). Under a pipeline each stage's total is summed over the
pipeline ranks, a tied weight counted on the lowest stage holding it only (its copies are
equal). So the norm equals the single-device norm of the same model.

torch's own `torch.nn.utils.clip_grad_norm_(pm.parameters(), max_norm)` would take the norm of
this rank's local gradients only (under tp each rank's shards: a smaller norm, a different clip
on every rank). Importing nncompile routes that function through `torch_clip_grad_norm_`: the
parameters of a ParallelModule whose gradients are split across ranks count by the global norm
above (all of that module's trainable parameters must be given), anything else is torch's:

    before: torch.nn.utils.clip_grad_norm_(pm.parameters(), 1.0)   # tp 2: |local shard grads|
    after:  the same call                                          # |all gradients|, as 1 GPU

torch.nn.utils.get_total_norm over all of such a module's gradients is routed the same way
(`torch_get_total_norm`), so get_total_norm + clip_grads_with_norm_ clip alike.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from nncompile.errors import ConfigError

from ..protocol.groups import pipe_group
from ..store.pieces import local_named_parameters, pieces_of
from nncompile.rows import param_rows
from ..store.holders import first_holder, split_axes
from nncompile.compat import wrap_once
from ..store.pieces import _LIVE, _tagged_owner


def _kept(piece: torch.Tensor, layout, skip: set[str]) -> torch.Tensor:
    """A flat piece cut by `layout` without the elements of tensors in `skip` (a tied weight
    another stage counts)."""
    cuts = sorted((at, at + e - s) for name, (at, s, e) in zip(layout.names, layout.runs())
                  if name in skip and s < e)
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
                    regular.append((grad, (row.sharded, split_axes(pm, row))))
    return pieces, group, regular, scale


def _partial_norm(pm, norm_type: float) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(sum of |g|^p over pm's gradients, or their max for the inf norm, taken over the whole
    model: the plan unit, the ZeRO group and the pipeline; the gradients to scale)."""
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
    totals = []
    kinds = {(True, ()), (False, ())} | {(row.sharded, split_axes(pm, row))   # alike on
                                         for row in param_rows(pm)}      # every rank
    for sharded, axes in sorted(kinds):      # (split over the plan, other axes split along)
        local = part([g for g, s in pieces if s == sharded and not axes])
        if zero_group is not None and not axes:
            dist.all_reduce(local, op=op, group=zero_group)
        local = _combine(local, part([g for g, k in regular if k == (sharded, axes)]), inf)
        if sharded and pm.plan_group is not None:
            dist.all_reduce(local, op=op, group=pm.plan_group)
        for axis in axes:                    # an expert weight's pieces along "ep"
            if pm.axis_group(axis) is not None:
                dist.all_reduce(local, op=op, group=pm.axis_group(axis))
        totals.append(local)
    total = totals[0]
    for t in totals[1:]:
        total = _combine(total, t, inf)
    if pm.PIPE_RANKS > 1 and dist.is_initialized():
        dist.all_reduce(total, op=op,
                        group=pipe_group(pm.PLAN_NGPUS, pm.RUNTIME_NGPUS, pm.PIPE_RANKS,
                                         pm.mesh_axes)[0])
    return total, scale


def _combine(a: torch.Tensor, b: torch.Tensor, inf: bool) -> torch.Tensor:
    return torch.maximum(a, b.to(a.device)) if inf else a + b.to(a.device)


def _finish(total: torch.Tensor, scale: list[torch.Tensor], max_norm: float, norm_type: float,
            error_if_nonfinite: bool) -> torch.Tensor:
    """The p-th root of the combined parts, the nonfinite check, and the scaling."""
    if not math.isinf(norm_type):
        total = total ** (1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"the total norm of order {norm_type} of the gradients is "
                           f"{float(total)}; pass error_if_nonfinite=False to clip anyway")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in scale:
        g.detach().mul_(coef.to(g.device, g.dtype))
    return total


def clip_grad_norm_(pm, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False) -> torch.Tensor:
    """Scale `pm`'s gradients in place so their global `norm_type` norm is at most `max_norm`;
    returns the norm before clipping (like torch.nn.utils.clip_grad_norm_). Every rank calls it.
    Under ZeRO-2/3 the pieces of each flat gradient are summed over the ZeRO group first, under
    a pipeline the stages' totals over the pipeline ranks."""
    norm_type = float(norm_type)
    total, scale = _partial_norm(pm, norm_type)
    return _finish(total, scale, max_norm, norm_type, error_if_nonfinite)


# ---- torch.nn.utils.clip_grad_norm_ over a ParallelModule's parameters ------------------------
_TORCH_CLIP = None                                # torch's own clip_grad_norm_


def _needs_global(pm) -> bool:
    """Whether pm's local gradients are not the whole model's: split over the plan unit, kept
    as ZeRO-2/3 pieces, or one pipeline stage's."""
    if not dist.is_initialized():
        return False
    return pm.zero is not None or pm._grad_shards is not None or pm.PIPE_RANKS > 1 or \
        (pm.plan_group is not None and any(row.sharded for row in param_rows(pm))) or \
        bool(pm.PARAM_AXES)


def _owned_by(params: list) -> tuple[dict, list]:
    """{pm: its parameters among `params`} for ParallelModules whose gradients need the global
    norm, and the other parameters."""
    owner_of = {}
    for pm in list(_LIVE):
        if _needs_global(pm):
            for p in [*pm.parameters(), *pieces_of(pm).values()]:
                owner_of[id(p)] = pm
    owned: dict = {}
    rest = []
    for p in params:
        pm = owner_of.get(id(p)) or _tagged_owner(p)
        if pm is not None and pm in _LIVE and _needs_global(pm):
            owned.setdefault(pm, []).append(p)
        else:
            rest.append(p)
    return owned, rest


def _check_all_given(pm, given: list) -> None:
    ids = {id(p) for p in given}
    names = set()
    for n in (_local_name(pm, p) for p in given):      # a tuple: an original held as parts
        names.update(n if isinstance(n, tuple) else () if n is None else (n,))
    missing = [n for n, p in local_named_parameters(pm) if p.requires_grad and id(p) not in ids
               and n not in names
               and (p.grad is not None or pm.zero is not None or pm._grad_shards is not None)]
    if missing:
        raise ConfigError(
            f"torch.nn.utils.clip_grad_norm_ got {len(given)} parameters of a ParallelModule "
            f"whose gradients are split across ranks, without {missing[:3]}"
            f"{' ...' if len(missing) > 3 else ''}: its global norm is taken over all of its "
            f"parameters; pass pm.parameters() (or call nncompile.clip_grad_norm_(pm, "
            f"max_norm)), or clip a subset before parallelizing")


def _local_name(pm, p):
    try:
        from ..store.segments import local_name
    except ImportError:
        return None
    return local_name(pm, p)


def torch_clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0,
                          error_if_nonfinite: bool = False, foreach=None) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_, exact for a ParallelModule's parameters: those of a
    module whose gradients are split across ranks count by the global norm
    (nncompile.clip_grad_norm_), any others by their local gradients as torch counts them;
    everything else is torch's own function, untouched."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    owned, rest = _owned_by(params) if _LIVE else ({}, params)
    if not owned:
        return _TORCH_CLIP(params, max_norm, norm_type, error_if_nonfinite, foreach)
    norm_type = float(norm_type)
    inf = math.isinf(norm_type)
    total, scale = None, []
    for pm, given in owned.items():
        _check_all_given(pm, given)
        part, grads = _partial_norm(pm, norm_type)
        total = part if total is None else _combine(total, part, inf)
        scale += grads
    grads = [p.grad.detach() for p in rest if p.grad is not None]
    for g in grads:
        part = g.abs().max().float() if inf else g.float().norm(norm_type) ** norm_type
        total = _combine(total, part, inf)
    with torch.no_grad():
        return _finish(total, scale + grads, max_norm, norm_type, error_if_nonfinite)


def torch_get_total_norm(tensors, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                         foreach=None) -> torch.Tensor:
    """torch.nn.utils.get_total_norm, exact for the gradients of a ParallelModule whose
    gradients are split across ranks (all of them given: `[p.grad for p in pm.parameters()]`),
    so get_total_norm + clip_grads_with_norm_ clip as clip_grad_norm_ does; anything else is
    torch's own function."""
    ts = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    owned, rest = {}, ts
    if _LIVE:
        grad_of = {}
        for pm in list(_LIVE):
            if _needs_global(pm):
                for p in pm.parameters():
                    if p.grad is not None:
                        grad_of[id(p.grad)] = pm
        owned, rest = {}, []
        for t in ts:
            pm = grad_of.get(id(t))
            if pm is None:
                rest.append(t)
            else:
                owned.setdefault(pm, set()).add(id(t))
    if not owned:
        return _TORCH_TOTAL(ts, norm_type, error_if_nonfinite, foreach)
    norm_type = float(norm_type)
    inf = math.isinf(norm_type)
    total = None
    for pm, given in owned.items():
        missing = [n for n, p in local_named_parameters(pm)
                   if p.requires_grad and p.grad is not None and id(p.grad) not in given]
        if missing or pm.zero is not None or pm._grad_shards is not None:
            raise ConfigError(
                f"torch.nn.utils.get_total_norm got some gradients of a ParallelModule whose "
                f"gradients are split across ranks (without {missing[:3]}, or kept as ZeRO "
                f"pieces): its global norm needs all of them; call "
                f"torch.nn.utils.clip_grad_norm_(pm.parameters(), max_norm) or "
                f"nncompile.clip_grad_norm_(pm, max_norm)")
        part, _ = _partial_norm(pm, norm_type)
        total = part if total is None else _combine(total, part, inf)
    for g in rest:
        g = g.detach()
        total = _combine(total, g.abs().max().float() if inf else
                         g.float().norm(norm_type) ** norm_type, inf)
    if not inf:
        total = total ** (1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"the total norm of order {norm_type} of the gradients is "
                           f"{float(total)}; pass error_if_nonfinite=False")
    return total


_TORCH_TOTAL = None                               # torch's own get_total_norm


def install() -> None:
    """Route torch.nn.utils.clip_grad_norm_ and torch.nn.utils.get_total_norm through the
    functions above (once; torch's own internals keep calling torch's)."""
    global _TORCH_CLIP, _TORCH_TOTAL
    import torch.nn.utils as utils
    import torch.nn.utils.clip_grad as clip_grad
    original = wrap_once(clip_grad, "clip_grad_norm_", torch_clip_grad_norm_, also=(utils,))
    if original is None:
        return
    _TORCH_CLIP = original
    if getattr(utils, "get_total_norm", None) is not None:
        _TORCH_TOTAL = wrap_once(utils, "get_total_norm", torch_get_total_norm)

install()
