"""Process groups for nnScaler's rank layout.

With plan_ngpus = n and runtime_ngpus = N, ranks r1 and r2 are in one plan unit when
r1 // n == r2 // n (tensor-parallel collectives run there) and hold the same shard when
r1 % n == r2 % n (gradients are averaged there, like DDP). ZeRO splits each shard group into
`zero_ngroups` consecutive groups and shards optimizer state inside each. Every rank must
create every group in the same order, so groups are made for all units at once and cached.
New groups take the default group's timeout (torch would otherwise give them its own default).
"""
from __future__ import annotations

import datetime
import weakref

import torch
import torch.distributed as dist

_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # default group -> groups


def unit_ranks(rank: int, plan: int) -> list[int]:
    start = rank // plan * plan
    return list(range(start, start + plan))


def shard_ranks(rank: int, plan: int, runtime: int) -> list[int]:
    return list(range(rank % plan, runtime, plan))


def zero_ranks(rank: int, plan: int, runtime: int, ngroups: int) -> list[int]:
    """The ranks this rank shards optimizer state with (a slice of its shard group)."""
    ranks = shard_ranks(rank, plan, runtime)
    size = len(ranks) // ngroups
    i = ranks.index(rank) // size
    return ranks[i * size:(i + 1) * size]


def default_timeout() -> datetime.timedelta | None:
    """The default process group's timeout (None when it cannot be read)."""
    try:
        pg = dist.distributed_c10d._get_default_group()
        return pg._get_backend(torch.device("cpu")).options._timeout
    except Exception:     # a backend without readable options: let torch pick
        return None


def _new_group(ranks: list[int]):
    if len(ranks) == 1:
        return None
    return dist.new_group(ranks, timeout=default_timeout())


def _cached(key: tuple, all_ranks: list[list[int]]) -> list:
    # per default group: a new process group (or a simulated rank's thread, see
    # nncompile.simulate) gets groups of its own
    cache = _CACHE.setdefault(dist.distributed_c10d._get_default_group(), {})
    if key not in cache:
        cache[key] = [(ranks, _new_group(ranks)) for ranks in all_ranks]
    rank = dist.get_rank()
    return next(g for ranks, g in cache[key] if rank in ranks)


def get_groups(plan: int, runtime: int):
    """(plan group, data-parallel group) of this rank; None where the group has one rank."""
    if not dist.is_initialized():
        return None, None
    units = [list(range(u * plan, (u + 1) * plan)) for u in range(runtime // plan)]
    shards = [list(range(s, runtime, plan)) for s in range(plan)]
    return _cached(("unit", plan, runtime), units), _cached(("shard", plan, runtime), shards)


def get_zero_group(plan: int, runtime: int, ngroups: int):
    """(group, ranks) this rank shards optimizer state over; group is None for one rank."""
    if not dist.is_initialized():
        return None, [0]
    groups = sorted({tuple(zero_ranks(r, plan, runtime, ngroups)) for r in range(runtime)})
    ranks = zero_ranks(dist.get_rank(), plan, runtime, ngroups)
    return _cached(("zero", plan, runtime, ngroups), [list(g) for g in groups]), ranks
