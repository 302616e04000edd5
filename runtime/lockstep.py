"""Ranks whose forwards communicate run each forward together, or every one of them says so.

Under a plan that splits the model over a unit (tp, context or expert parallelism) or gathers
ZeRO-3 weights, each forward is a sequence of collectives that every rank of the unit (or of the
ZeRO-3 group) must enter together. DDP scripts often evaluate on rank 0 alone (nanoGPT's
`if master_process: estimate_loss()`), which is right under dp and ZeRO-1/2, whose forwards
communicate nothing. Here rank 0's eval forward would meet the other ranks' next training
forward, mix their collectives and die in the transport, or hang:

    before: rank 0 eval forward #3 gathers weights with rank 1's training forward #3
            -> "Connection reset by peer" (gloo), a hang (NCCL)
    after:  every rank raises ConfigError at that forward: which rank ran what, and the fix
            (evaluate on every rank, print on rank 0)

Before each forward the ranks exchange (forward count, training mode, grad mode) over a CPU
(gloo) group of the ranks involved: one 24-byte all-gather, no device synchronisation.
`ComputeConfig(check_lockstep=False)` turns it off.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from nncompile.errors import ConfigError
from nncompile.mesh import DP, PP

from .groups import _CACHE, default_timeout, group_along


def lockstep_group(pm):
    """The CPU group of the ranks that share pm's forward collectives (None: no other rank,
    or the check is off)."""
    if not dist.is_initialized() or pm.PIPELINE is not None or \
            not pm.compute_config.check_lockstep:
        return None
    mesh = pm.mesh
    dims = tuple(n for n in mesh.names if n not in (DP, PP) and mesh.size(n) > 1)
    if pm.zero is not None and pm.memory.zero == 3 and len(pm.zero.ranks) > 1:
        dims += (DP,)
    if not dims:
        return None
    group = group_along(dims, pm.PLAN_NGPUS, pm.RUNTIME_NGPUS, pm.PIPE_RANKS, pm.mesh_axes)
    if group is None:
        return None
    if "gloo" in str(dist.get_backend(group)).lower():
        return group
    ranks = dist.get_process_group_ranks(group)      # NCCL: a gloo twin, made once per set
    cache = _CACHE.setdefault(dist.distributed_c10d._get_default_group(), {})
    key = ("lockstep", tuple(sorted(dims)), pm.PLAN_NGPUS, pm.RUNTIME_NGPUS, pm.PIPE_RANKS,
           tuple(pm.mesh_axes))
    if key not in cache:
        mesh_groups = mesh.groups_along(tuple(dims)) if len(dims) < len(mesh.names) else \
            [list(range(dist.get_world_size()))]
        cache[key] = [(r, dist.new_group(r, backend="gloo", timeout=default_timeout()))
                      for r in mesh_groups]
    return next(g for r, g in cache[key] if sorted(r) == sorted(ranks))


def _mode(training: bool, grad: bool) -> str:
    return f"{'training' if training else 'eval'} mode {'with' if grad else 'without'} gradients"


def check_lockstep(pm, training: bool) -> None:
    """Called before each forward: every rank of the group agrees on the forward's count and
    modes, or all of them raise the same ConfigError."""
    group = pm.__dict__.get("_lockstep_group", False)
    if group is False:
        group = pm.__dict__["_lockstep_group"] = lockstep_group(pm)
    if group is None:
        return
    count = pm.__dict__.get("_forward_count", 0) + 1
    pm.__dict__["_forward_count"] = count
    mine = torch.tensor([count, int(training), int(torch.is_grad_enabled())], dtype=torch.int64)
    ranks = dist.get_process_group_ranks(group)
    seen = [torch.empty_like(mine) for _ in ranks]
    dist.all_gather(seen, mine, group=group)
    rows = [tuple(t.tolist()) for t in seen]
    if len(set(rows)) == 1:
        return
    lines = [f"rank {r}: forward #{c} in {_mode(bool(t), bool(g))}"
             for r, (c, t, g) in zip(ranks, rows)]
    raise ConfigError(
        "the ranks of a plan unit (or of a ZeRO-3 group) ran different forwards: "
        + "; ".join(lines) + ". Under this plan each forward is computed by all of them "
        "together (its collectives split the model or gather its weights), so a forward "
        "on some ranks only, such as evaluating on rank 0 alone (`if master_process: "
        "estimate_loss()`), cannot run. Evaluate on every rank and print or log on rank 0 "
        "only; dp and ZeRO-1/2 plans, whose forwards communicate nothing, allow rank-0-only "
        "evaluation.")
