"""torch.amp.GradScaler over a ParallelModule's parameters: one skip decision for the job.

torch's GradScaler unscales the gradients an optimizer holds and skips the step when one of
them is not finite. Two things differ under nncompile:

- Under tp, ZeRO or a pipeline each rank holds another part of the gradients, so each rank
  would decide from its own part: an overflow in one rank's shard skips the step there only,
  the scales part (65536 vs 32768) and so do the replicas. The found-inf flags are therefore
  all-reduced (MAX) over the world, one collective per unscale, as torch's ShardedGradScaler
  does for FSDP.
- A ZeroOptimizer's own parameters (segments) get their gradients inside `step`, from pm's
  `.grad` and the ZeRO-2 pieces, so torch found none to unscale ("No inf checks were recorded
  for this optimizer"). The unscale reads exactly those gradients, once, so the step uses the
  unscaled values and skips as torch's would. ZeRO-3 segments of a plain optimizer get their
  views of the flat gradient first.

Importing nncompile routes `torch.amp.GradScaler._unscale_grads_` (what `unscale_` and `step`
call) through `unscale_grads_`; optimizers that step no ParallelModule's tensors are torch's:

    before: scaler.step(opt)   # tp 2, overflow in rank 1's shard: rank 0 steps, rank 1 skips
    after:  the same call      # both skip, both scales halve, as on one device
"""
from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist

from ..store.pieces import pieces_of
from nncompile.compat import wrap_once

_TORCH_UNSCALE = None                             # torch's own GradScaler._unscale_grads_


def _tagged(p) -> bool:
    return any(getattr(p, a, None) is not None
               for a in ("_nnc_handle", "_nnc_origin", "_nnc_flat"))


def _parallel_modules(optimizer) -> list:
    """The ParallelModules whose tensors `optimizer` steps (none: a plain optimizer)."""
    pm = getattr(optimizer, "pm", None)
    if pm is not None and hasattr(optimizer, "shards"):          # a ZeroOptimizer
        return [pm]
    from ..store.pieces import _LIVE, _tagged_owner
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if not params or not _LIVE:
        return []
    if any(_tagged(p) for p in params):
        from .adoption import _pre_step  # swap handles, point segments at grads
        _pre_step(optimizer, (), {})
        params = [p for g in optimizer.param_groups for p in g["params"]]
    owner_of = {id(p): pm for pm in list(_LIVE)
                for p in [*pm.parameters(), *pieces_of(pm).values()]}
    found = []
    for p in params:
        pm = owner_of.get(id(p)) or _tagged_owner(p)
        if pm is not None and pm not in found:
            found.append(pm)
    return found


def _step_grads(optimizer) -> list[torch.Tensor]:
    """The gradients a ZeroOptimizer's step reads (its segments have none yet, or ZeRO-3
    views of these): the ZeRO-3 flat gradients, else pm's `.grad` and the ZeRO-2 pieces."""
    if not hasattr(optimizer, "shards"):
        return []
    out, seen = [], set()
    for s in optimizer.shards:
        if s.flat is not None:
            grads = [s.flat.grad]
        else:
            grads = [p.grad for p in s.params] + [s.grad]
        for g in grads:
            if g is not None and id(g) not in seen:
                seen.add(id(g))
                out.append(g)
    return out


def _unscale(grads: list, inv_scale, found_inf, allow_fp16: bool) -> dict:
    """torch's check-and-unscale of `grads` in place; {device: found-inf flag}."""
    from torch.amp.grad_scaler import _MultiDeviceReplicator
    per_inv, per_found = _MultiDeviceReplicator(inv_scale), _MultiDeviceReplicator(found_inf)
    by = defaultdict(lambda: defaultdict(list))
    for g in grads:
        if not allow_fp16 and g.dtype == torch.float16:
            raise ValueError("Attempting to unscale FP16 gradients.")
        by[g.device][g.dtype].append(g)
    with torch.no_grad():
        for device, per_dtype in by.items():
            for gs in per_dtype.values():
                torch._amp_foreach_non_finite_check_and_unscale_(
                    gs, per_found.get(device), per_inv.get(device))
    return per_found._per_device_tensors


def unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
    """GradScaler._unscale_grads_: torch's, plus (for an optimizer over a ParallelModule's
    tensors) the gradients a ZeroOptimizer's step reads and one found-inf for the world."""
    pms = _parallel_modules(optimizer)
    if not pms:
        return _TORCH_UNSCALE(self, optimizer, inv_scale, found_inf, allow_fp16)
    if hasattr(optimizer, "shards"):          # a ZeroOptimizer: what its step reads, once
        found = dict(_unscale(_step_grads(optimizer), inv_scale, found_inf, allow_fp16))
    else:
        found = dict(_TORCH_UNSCALE(self, optimizer, inv_scale, found_inf, allow_fp16))
    found.setdefault(found_inf.device, found_inf)     # step needs one recorded check
    if dist.is_initialized() and dist.get_world_size() > 1:
        device = pms[0].device
        total = sum(f.to(device, torch.float32) for f in found.values())
        dist.all_reduce(total, op=dist.ReduceOp.MAX)
        for flag in found.values():
            flag.copy_(total.to(flag.device, flag.dtype))
    return found


def install() -> None:
    """Route torch.amp.GradScaler._unscale_grads_ through unscale_grads_ (once)."""
    global _TORCH_UNSCALE
    from torch.amp.grad_scaler import GradScaler
    original = wrap_once(GradScaler, "_unscale_grads_", unscale_grads_)
    if original is not None:
        _TORCH_UNSCALE = original

install()
