"""Process groups for nnScaler's rank layout.

With plan_ngpus = n and runtime_ngpus = N, ranks r1 and r2 are in one plan unit when
r1 // n == r2 // n (tensor-parallel collectives run there) and hold the same shard when
r1 % n == r2 % n (gradients are averaged there, like DDP). Every rank must create every group
in the same order, so groups are made for all units at once and cached.
"""
from __future__ import annotations

import torch.distributed as dist

_CACHE: dict[tuple[int, int], tuple[list, list]] = {}


def unit_ranks(rank: int, plan: int) -> list[int]:
    start = rank // plan * plan
    return list(range(start, start + plan))


def shard_ranks(rank: int, plan: int, runtime: int) -> list[int]:
    return list(range(rank % plan, runtime, plan))


def get_groups(plan: int, runtime: int):
    """(plan group, data-parallel group) of this rank; None where the group has one rank."""
    if not dist.is_initialized():
        return None, None
    key = (plan, runtime)
    if key not in _CACHE:
        units = [dist.new_group(list(range(u * plan, (u + 1) * plan)))
                 if plan > 1 else None for u in range(runtime // plan)]
        shards = [dist.new_group(list(range(s, runtime, plan)))
                  if runtime // plan > 1 else None for s in range(plan)]
        _CACHE[key] = (units, shards)
    units, shards = _CACHE[key]
    rank = dist.get_rank()
    return units[rank // plan], shards[rank % plan]
