"""The job's device mesh, with named dimensions, and where each tensor lives on it.

A job of `runtime_ngpus` ranks is a 2-D mesh, outermost first:

    ("dp", runtime_ngpus // plan_ngpus)   data-parallel units (each runs the whole model)
    ("plan", plan_ngpus)                  the ranks of one plan unit (tensor parallelism)

rank = dp_index * plan_ngpus + plan_index. A pipelined plan adds ("pp", S) between them: a unit
is S pipeline ranks (stages) of plan_ngpus tensor-parallel ranks each, and every collective of
the generated code runs along "plan" inside one stage. A tensor's placement is one Placement per mesh
dimension, DTensor-style. Plans place values along "plan"; along "dp" every parameter is
Replicate (each unit holds the whole plan) and every activation is Shard(0) (each unit sees
its own batch). ZeRO-3 and pipeline stages are later placements along these dimensions.

The rule for which ranks sum a gradient lives here and nowhere else (`grad_reduction`): a
gradient that is a partial sum over the plan unit is summed over "plan" (and "dp" when there
is more than one unit, one all-reduce over the world), every other gradient over "dp"; all of
them are then scaled by 1 / dp, the data-parallel average.
"""
from __future__ import annotations

from dataclasses import dataclass

from nncompile.errors import ConfigError
from nncompile.ir.placement import Placement, Replicate, Shard

DP, PP, PLAN = "dp", "pp", "plan"


@dataclass(frozen=True)
class Mesh:
    """Named mesh dimensions, outermost first: ((name, size), ...)."""
    dims: tuple[tuple[str, int], ...]

    @classmethod
    def of(cls, plan_ngpus: int, runtime_ngpus: int, pipe_ranks: int = 1,
           axes: dict[str, int] | None = None) -> "Mesh":
        """plan_ngpus: the ranks of one (stage's) tensor-parallel plan; with pipe_ranks > 1 a
        unit is pipe_ranks stages of plan_ngpus ranks: ("dp", "pp", "plan"). `axes`: further
        axes a plan places values on (Graph.axes, e.g. {"cp": 2}), between "pp" and "plan"."""
        inner = tuple((axes or {}).items()) + ((PLAN, plan_ngpus),)
        unit = 1
        for _, size in inner:
            unit *= size
        if pipe_ranks > 1:
            return cls(((DP, runtime_ngpus // (unit * pipe_ranks)), (PP, pipe_ranks)) + inner)
        return cls(((DP, runtime_ngpus // unit),) + inner)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.dims)

    @property
    def world(self) -> int:
        out = 1
        for _, size in self.dims:
            out *= size
        return out

    def size(self, dim: str) -> int:
        return dict(self.dims)[dim]

    def coords(self, rank: int) -> dict[str, int]:
        """{dim: this rank's index along it}: the one place a rank's (dp, pp, plan) position
        is computed; everything else asks the mesh."""
        if not 0 <= rank < self.world:
            raise ConfigError(f"rank {rank} is not on the mesh {dict(self.dims)} "
                             f"({self.world} ranks: 0..{self.world - 1})")
        out = {}
        for name, size in reversed(self.dims):
            rank, out[name] = divmod(rank, size)
        return dict(reversed(list(out.items())))

    def rank_of(self, coords: dict[str, int]) -> int:
        """The rank at `coords` (every dimension named), the inverse of `coords`."""
        rank = 0
        for name, size in self.dims:
            if not 0 <= coords[name] < size:
                raise ConfigError(f"coordinate {name}={coords[name]} is off the mesh "
                                 f"{dict(self.dims)}")
            rank = rank * size + coords[name]
        return rank

    def coord(self, rank: int, dim: str) -> int:
        """`rank`'s index along `dim`; 0 along a dimension the mesh lacks (a mesh without
        "pp" is one pipeline rank)."""
        return self.coords(rank).get(dim, 0)

    def unit_of(self, rank: int) -> int:
        """The data-parallel unit (plan unit) `rank` belongs to: its index along "dp"."""
        return self.coord(rank, DP)

    def shard_of(self, rank: int) -> int:
        """`rank`'s tensor-parallel shard inside its plan unit (or stage): its index along
        "plan"."""
        return self.coord(rank, PLAN)

    def pipe_of(self, rank: int) -> int:
        """`rank`'s pipeline rank inside its unit (0 without a pipeline)."""
        return self.coord(rank, PP)

    def moved(self, rank: int, **coords: int) -> int:
        """The rank with `rank`'s coordinates except those given, e.g. the rank of the same
        unit and shard at pipeline rank 1: `mesh.moved(rank, pp=1)`."""
        unknown = set(coords) - set(self.names)
        if unknown:
            raise ConfigError(f"mesh {dict(self.dims)} has no dimension {sorted(unknown)}")
        return self.rank_of({**self.coords(rank), **coords})

    def ranks_along(self, dims: tuple[str, ...], rank: int) -> list[int]:
        """The ranks that share every coordinate of `rank` except those along `dims` (the
        group a collective over `dims` runs in), in rank order."""
        fixed = {k: v for k, v in self.coords(rank).items() if k not in dims}
        return [r for r in range(self.world)
                if all(self.coords(r)[k] == v for k, v in fixed.items())]

    def groups_along(self, dims: tuple[str, ...]) -> list[list[int]]:
        """Every group of ranks along `dims`, each once, in order of their first rank."""
        seen, out = set(), []
        for r in range(self.world):
            ranks = self.ranks_along(dims, r)
            if ranks[0] not in seen:
                seen.add(ranks[0])
                out.append(ranks)
        return out


CP = "cp"
EP = "ep"


def replica_dims(mesh: Mesh, sharded: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The dimensions along which every rank holds the same parameters: "dp" and, when the
    plan splits the sequence, "cp" (context parallelism splits activations only), or the
    batch across expert-parallel ranks, "ep" (their experts excepted). ZeRO shards
    parameters, gradients and optimizer state over the ranks along these. `sharded`: the
    axes one parameter is split along (an expert weight's "ep"), left out."""
    return (DP,) + tuple(a for a in (CP, EP) if a in mesh.names and mesh.size(a) > 1
                         and a not in sharded)


def param_placements(plan_placement: Placement) -> dict[str, Placement]:
    """A parameter's placement per mesh dimension (replicated across data-parallel units)."""
    return {DP: Replicate(), PLAN: plan_placement}


def activation_placements(plan_placement: Placement) -> dict[str, Placement]:
    """An activation's placement per mesh dimension (each unit has its own batch rows)."""
    return {DP: Shard(0), PLAN: plan_placement}


@dataclass(frozen=True)
class GradReduction:
    """How the runtime reduces one parameter's gradient: summed over `dims`, times `scale`."""
    dims: tuple[str, ...]
    scale: float


def grad_reduction(mesh: Mesh, partial_sum: bool, trainable: bool = True,
                   partial_axes: tuple[str, ...] = ()) -> GradReduction | None:
    """The reduction a gradient needs (None: it is complete on every rank as it is).
    `partial_axes`: other mesh axes (cp) over which it is a partial sum too."""
    dp = mesh.size(DP)
    if not trainable:
        return None
    dims = tuple(a for a in partial_axes if mesh.size(a) > 1)
    if partial_sum and mesh.size(PLAN) > 1:
        dims += (PLAN,)
    if dp > 1:
        dims = (DP,) + dims
    return GradReduction(dims, 1.0 / dp) if dims else None
