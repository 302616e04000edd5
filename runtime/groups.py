"""Process groups along the dimensions of the job's mesh (nncompile/mesh.py).

With plan_ngpus = n and runtime_ngpus = N the mesh is ("dp", N // n) x ("plan", n): ranks r1
and r2 are in one plan unit (the group along "plan", where tensor-parallel collectives run)
when r1 // n == r2 // n, and hold the same shard (the group along "dp", where gradients are
averaged, like DDP) when r1 % n == r2 % n. ZeRO splits each shard group into
`zero_ngroups` consecutive groups and shards optimizer state inside each. Every rank must
create every group in the same order, so groups are made for all units at once and cached.
New groups take the default group's timeout (torch would otherwise give them its own default).
"""
from __future__ import annotations

import datetime
import weakref

import torch
import torch.distributed as dist

from nncompile.mesh import DP, PLAN, Mesh

_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # default group -> groups


def shard_ranks(rank: int, plan: int, runtime: int) -> list[int]:
    """The ranks holding the same shard as `rank`: its group along "dp"."""
    return Mesh.of(plan, runtime).ranks_along((DP,), rank)


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
    mesh = Mesh.of(plan, runtime)
    return (_cached(("unit", plan, runtime), mesh.groups_along((PLAN,))),
            _cached(("shard", plan, runtime), mesh.groups_along((DP,))))


def group_along(dims: tuple[str, ...], plan: int, runtime: int):
    """This rank's group along mesh `dims` (the default group for all of them)."""
    if set(dims) == {DP, PLAN}:
        return dist.group.WORLD
    unit, shard = get_groups(plan, runtime)
    return unit if dims == (PLAN,) else shard


def get_zero_group(plan: int, runtime: int, ngroups: int):
    """(group, ranks) this rank shards optimizer state over; group is None for one rank."""
    if not dist.is_initialized():
        return None, [0]
    groups = sorted({tuple(zero_ranks(r, plan, runtime, ngroups)) for r in range(runtime)})
    ranks = zero_ranks(dist.get_rank(), plan, runtime, ngroups)
    return _cached(("zero", plan, runtime, ngroups), [list(g) for g in groups]), ranks
