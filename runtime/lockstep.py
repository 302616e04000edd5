"""Ranks whose forwards communicate run each forward together; a forward one rank runs alone
(rank-0-only evaluation) is joined by the others.

Under a plan that splits the model over a unit (tp, context or expert parallelism) or gathers
ZeRO-3 weights, each forward is a sequence of collectives that every rank of the unit (or of the
ZeRO-3 group) must enter together. DDP scripts often evaluate on rank 0 alone (nanoGPT's
`if iter_num % eval_interval == 0 and master_process: losses = estimate_loss()`), which is
right under dp and ZeRO-1/2, whose forwards communicate nothing. Here rank 0's eval forward
would meet the other ranks' next training forward, mix their collectives and die in the
transport, or hang. Instead, before each forward the ranks exchange (forward count, training
mode, grad mode) over a CPU (gloo) group of the ranks involved, a 24-byte all-gather with no
device synchronisation:

    before: rank 0 eval forward gathers weights with rank 1's training forward
            -> "Connection reset by peer" (gloo), a hang (NCCL)
    after:  rank 1, waiting at its training forward, receives rank 0's inputs and runs rank
            0's forward with it (in rank 0's modes, its output dropped), as often as rank 0
            evaluates; then both run the training forward. DDP's script, unchanged, prints
            DDP's numbers.

One rank may run forwards alone this way: the rank without gradients while the others have
them (or in eval mode while they train). Anything else (two ranks evaluating alone, the same
modes but different counts is fine) raises one ConfigError on every rank that says which rank
ran what. `ComputeConfig(check_lockstep=False)` turns the exchange off.
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


def _leader(rows: list[tuple[int, int, int]]) -> int | None:
    """The index of the one rank running a forward the others are not (no gradients while
    they have them, or eval mode while they train); None when there is no such single rank."""
    for field in (2, 1):                     # grad mode first, then training mode
        values = {row[field] for row in rows}
        if len(values) == 2:
            alone = [i for i, row in enumerate(rows) if row[field] == 0]
            others_agree = len({row[1:] for i, row in enumerate(rows) if i not in alone}) == 1
            return alone[0] if len(alone) == 1 and others_agree else None
    return None


def agree(pm, inputs: list[torch.Tensor]) -> None:
    """Before each forward: returns when this rank's forward may run. A rank waiting here while
    one other rank of its group runs a forward alone runs that forward with it (its inputs
    received from it), then waits again; anything else is one ConfigError on every rank."""
    group = pm.__dict__.get("_lockstep_group", False)
    if group is False:
        group = pm.__dict__["_lockstep_group"] = lockstep_group(pm)
    if group is None or pm.__dict__.get("_serving"):
        return
    count = pm.__dict__.get("_forward_count", 0) + 1
    pm.__dict__["_forward_count"] = count
    mine = torch.tensor([count, int(pm.training), int(torch.is_grad_enabled())],
                        dtype=torch.int64)
    ranks = dist.get_process_group_ranks(group)
    me = ranks.index(dist.get_rank())
    while True:
        seen = [torch.empty_like(mine) for _ in ranks]
        dist.all_gather(seen, mine, group=group)
        rows = [tuple(t.tolist()) for t in seen]
        if len({row[1:] for row in rows}) == 1:
            return
        leader = _leader(rows)
        if leader is None:
            _refuse(ranks, rows)
        box = [[x.detach().cpu() for x in inputs] if leader == me else None]
        dist.broadcast_object_list(box, src=ranks[leader], group=group)
        if leader == me:
            return
        _serve(pm, box[0], rows[leader])


def _serve(pm, inputs: list[torch.Tensor], row: tuple[int, int, int]) -> None:
    """Run another rank's forward with it: its inputs, its modes; the output is dropped."""
    training, grad = bool(row[1]), bool(row[2])
    was = pm.training
    pm.__dict__["_serving"] = True
    try:
        pm.training = training
        with torch.set_grad_enabled(grad):
            pm._run([x.to(pm.device) for x in inputs])
    finally:
        pm.training = was
        pm.__dict__["_serving"] = False


def _refuse(ranks: list[int], rows: list[tuple[int, int, int]]) -> None:
    lines = [f"rank {r}: forward #{c} in {_mode(bool(t), bool(g))}"
             for r, (c, t, g) in zip(ranks, rows)]
    raise ConfigError(
        "the ranks of a plan unit (or of a ZeRO-3 group) ran different forwards: "
        + "; ".join(lines) + ". Under this plan each forward is computed by all of them "
        "together (its collectives split the model or gather its weights). One rank may "
        "evaluate alone (without gradients, or in eval mode, while the others wait at their "
        "training forward), but not several, nor forwards in the same modes on some ranks "
        "only. Evaluate on every rank and print or log on rank 0, or on one rank only.")
