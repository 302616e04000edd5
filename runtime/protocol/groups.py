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

from nncompile.errors import ConfigError
from nncompile.mesh import DP, PLAN, PP, Mesh, replica_dims

# What the runtime makes once per job (its process groups, lockstep's modules, DCP's meshes),
# kept per default group: a simulated rank (nncompile.tools.simulate) has a default group of
# its own. Dropped when the job's default group is destroyed (forget_job): a value that refers
# back to its key keeps a weak key alive, and each gloo group holds threads of its own.
_JOB_CACHES: list[weakref.WeakKeyDictionary] = []


def job_cache() -> weakref.WeakKeyDictionary:
    """A new cache keyed by the default group, emptied with the job (forget_job)."""
    cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
    _JOB_CACHES.append(cache)
    return cache


def forget_job() -> None:
    """Drop every cache's entry for this job's default group (dist.destroy_process_group()
    does this before torch destroys the groups, so they and their threads are freed)."""
    if dist.is_initialized():
        default = dist.distributed_c10d._get_default_group()
        for cache in _JOB_CACHES:
            cache.pop(default, None)


_CACHE = job_cache()                # default group -> groups


def cpu_backend() -> str | None:
    """The backend of a group that exchanges host tensors (the lockstep checks): gloo, or the
    default group's own where the ranks are simulated threads (whose groups move tensors
    between threads; a gloo group there would add threads of its own)."""
    return None if "threaded" in str(dist.get_backend()).lower() else "gloo"


def shard_ranks(rank: int, plan: int, runtime: int, pipe: int = 1, axes: tuple = ()
                ) -> list[int]:
    """The ranks holding the same parameters as `rank`: its group along "dp" and "cp"
    (nncompile.mesh.replica_dims). `axes`: the mesh's other axes as ((name, size), ...) (a
    file's MESH_AXES)."""
    mesh = Mesh.of(plan, runtime, pipe, dict(axes))
    return mesh.ranks_along(replica_dims(mesh), rank)


def zero_ranks(rank: int, plan: int, runtime: int, ngroups: int, pipe: int = 1,
               axes: tuple = ()) -> list[int]:
    """The ranks this rank shards optimizer state with (a slice of its shard group)."""
    ranks = shard_ranks(rank, plan, runtime, pipe, axes)
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
    # nncompile.tools.simulate) gets groups of its own
    cache = _CACHE.setdefault(dist.distributed_c10d._get_default_group(), {})
    if key not in cache:
        cache[key] = [(ranks, _new_group(ranks)) for ranks in all_ranks]
    rank = dist.get_rank()
    return next(g for ranks, g in cache[key] if rank in ranks)


def get_groups(plan: int, runtime: int, pipe: int = 1, axes: tuple = ()):
    """(plan group, data-parallel group) of this rank; None where the group has one rank.
    Under a pipeline (pipe > 1) the plan group is one stage's tensor-parallel ranks."""
    if not dist.is_initialized():
        return None, None
    mesh = Mesh.of(plan, runtime, pipe, dict(axes))
    return (_cached(("unit", plan, runtime, pipe, axes), mesh.groups_along((PLAN,))),
            _cached(("shard", plan, runtime, pipe, axes), mesh.groups_along((DP,))))


def group_along(dims: tuple[str, ...], plan: int, runtime: int, pipe: int = 1,
                axes: tuple = ()):
    """This rank's group along mesh `dims` (the default group for all of them)."""
    mesh = Mesh.of(plan, runtime, pipe, dict(axes))
    if set(dims) == set(mesh.names):
        return dist.group.WORLD
    if dims in ((PLAN,), (DP,)):
        unit, shard = get_groups(plan, runtime, pipe, axes)
        return unit if dims == (PLAN,) else shard
    return _cached(("along", tuple(sorted(dims)), plan, runtime, pipe, axes),
                   mesh.groups_along(tuple(dims)))


RUNTIME_AXES = ("cp", "ep")      # mesh axes beyond dp, pp and plan the runtime makes groups for


def axis_groups(rank: int, plan: int, runtime: int, pipe: int, axes: tuple) -> dict:
    """{axis: this rank's group along it} for a file's MESH_AXES (None without a process
    group); a ConfigError for an axis the runtime makes no group for."""
    unknown = sorted(set(dict(axes)) - set(RUNTIME_AXES))
    if unknown:
        raise ConfigError(
            f"this program (rank {rank}) places values along mesh axes {unknown} beyond dp, "
            f"pp, plan and {', '.join(RUNTIME_AXES)}, whose process groups this runtime does "
            "not make: compile without them (a policy that sets graph.axes)")
    return {axis: group_along((axis,), plan, runtime, pipe, axes) if dist.is_initialized()
            else None for axis, _ in axes}


def pipe_group(plan: int, runtime: int, pipe: int, axes: tuple = ()):
    """(group, ranks) of this rank's pipeline: its unit's stages with its tensor-parallel
    shard (and context rank, `axes`), in pipeline order."""
    mesh = Mesh.of(plan, runtime, pipe, dict(axes))
    ranks = mesh.ranks_along((PP,), dist.get_rank())
    return _cached(("pipe", plan, runtime, pipe, axes), mesh.groups_along((PP,))), ranks


def tie_group(pipe_ranks: tuple[int, ...], plan: int, runtime: int, pipe: int,
              axes: tuple = ()):
    """The group of the pipeline ranks `pipe_ranks` sharing a tied weight (with this rank's
    unit, tensor-parallel shard and context rank), or None when this rank is not one of
    them. Every rank calls it for every tie, in the same order (creating groups is
    collective)."""
    mesh = Mesh.of(plan, runtime, pipe, dict(axes))
    groups = [[mesh.moved(r, pp=p) for p in sorted(set(pipe_ranks))]
              for r in range(mesh.world) if mesh.coord(r, PP) == 0]
    key = ("tie", tuple(sorted(set(pipe_ranks))), plan, runtime, pipe, axes)
    cache = _CACHE.setdefault(dist.distributed_c10d._get_default_group(), {})
    if key not in cache:
        cache[key] = [(ranks, _new_group(ranks)) for ranks in groups]
    rank = dist.get_rank()
    return next((g for ranks, g in cache[key] if rank in ranks), None)


def get_zero_group(plan: int, runtime: int, ngroups: int, pipe: int = 1, axes: tuple = ()):
    """(group, ranks) this rank shards optimizer state over; group is None for one rank."""
    if not dist.is_initialized():
        return None, [0]
    groups = sorted({tuple(zero_ranks(r, plan, runtime, ngroups, pipe, axes))
                     for r in range(runtime)})
    ranks = zero_ranks(dist.get_rank(), plan, runtime, ngroups, pipe, axes)
    return _cached(("zero", plan, runtime, ngroups, pipe, axes), [list(g) for g in groups]), \
        ranks
