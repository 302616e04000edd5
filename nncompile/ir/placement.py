"""Sharding vocabulary, in DTensor's words: one placement per mesh axis.

A value carries its placement along the plan axis (`Value.placement`) and, along the other
axes a plan places values on (Graph.axes: cp, ep, ...), one per axis (`Value.axes`);
`Value.placements(mesh)` is the tuple, outermost axis first.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Replicate:
    def __repr__(self) -> str:
        return "R"


@dataclass(frozen=True)
class Shard:
    dim: int

    def __repr__(self) -> str:
        return f"S({self.dim})"


@dataclass(frozen=True)
class Partial:
    reduce_op: str = "sum"

    def __repr__(self) -> str:
        return "P"


@dataclass(frozen=True)
class StridedShard(Shard):
    """A split of dim `dim` read as (outer, dim // outer): each rank holds, for every outer
    index, its contiguous 1/n of the inner factor (DTensor's `_StridedShard`). It arises where
    a split dim is merged after another one, (B, H, T, D) S(1) -> (B*H, T, D) S(0|B): heads
    split, batch whole. Shard(d) is the case outer == 1 (`strided` returns it so)."""
    outer: int = 1

    def __repr__(self) -> str:
        return f"S({self.dim}|{self.outer})"


def strided(dim: int, outer: int) -> Shard:
    """Shard(dim) when outer == 1, else StridedShard(dim, outer)."""
    return Shard(dim) if outer == 1 else StridedShard(dim, outer)


Placement = Replicate | Shard | Partial
R = Replicate()
P = Partial()


def parse_placement(text: str) -> Placement:
    """Inverse of repr: 'R', 'P', 'S(2)', 'S(0|4)'."""
    text = text.strip()
    if text == "R":
        return R
    if text == "P":
        return P
    if text.startswith("S(") and text.endswith(")"):
        dim, _, outer = text[2:-1].partition("|")
        return strided(int(dim), int(outer)) if outer else Shard(int(dim))
    raise ValueError(f"not a placement: {text!r}")


def local_shape(shape: tuple[int, ...], placement: Placement, n: int) -> tuple[int, ...]:
    """Shape of one rank's piece of a tensor of `shape` placed with `placement` on n ranks."""
    if isinstance(placement, Shard):
        dims = list(shape)
        if dims[placement.dim] % n:
            raise ValueError(f"dim {placement.dim} of {shape} is not divisible by {n}")
        dims[placement.dim] //= n
        return tuple(dims)
    return tuple(shape)


def shard_slices(shape: tuple[int, ...], placement: Placement, index: int, n: int) -> list[list[int]]:
    """[start, stop) per dimension of the piece that shard `index` of n holds."""
    if isinstance(placement, StridedShard):
        raise ValueError(f"{placement!r} holds no box of {shape} (a strided split)")
    out = [[0, s] for s in shape]
    if isinstance(placement, Shard):
        size = shape[placement.dim] // n
        out[placement.dim] = [index * size, (index + 1) * size]
    return out


def piece_of(x, placement: Placement, index: int, n: int):
    """The piece of the full tensor `x` that shard `index` of n holds (a view; R and P: x)."""
    if isinstance(placement, StridedShard):
        d, o = placement.dim % x.dim(), placement.outer
        return x.unflatten(d, (o, x.shape[d] // o)).chunk(n, dim=d + 1)[index].flatten(d, d + 1)
    if isinstance(placement, Shard):
        return x.chunk(n, dim=placement.dim)[index]
    return x


def join_pieces(pieces: list, placement: Shard):
    """The full tensor whose shards are `pieces` (inverse of piece_of for a split)."""
    import torch
    d = placement.dim % pieces[0].dim()
    if isinstance(placement, StridedShard):
        o = placement.outer
        return torch.cat([p.unflatten(d, (o, -1)) for p in pieces], d + 1).flatten(d, d + 1)
    return torch.cat(pieces, d)


def part_slices(part, shape: tuple[int, ...], placement: Placement, index: int,
                n: int) -> tuple[tuple[int, int], ...]:
    """The box, in `part.view` coordinates, that shard `index` of n of a parameter part
    (nncompile.ir.graph.ParamPart) of full `shape` holds: the part's box when replicated; for
    Shard(d), the range [index*s/n, (index+1)*s/n) of dim d mapped onto the view dims merged
    into it (`part.groups[d]`). That range must be a box (outer view dims fixed, one ranged,
    inner ones whole); ValueError when it is not."""
    box = [tuple(b) for b in part.box]
    if not isinstance(placement, Shard):
        return tuple(box)
    if getattr(placement, "outer", 1) != 1:
        raise ValueError(f"{placement!r} of part {shape} is a strided split: not a box of "
                         f"view {part.view}")
    d = placement.dim % len(shape)
    dims = part.groups[d]
    sizes = [box[j][1] - box[j][0] for j in dims]
    total = 1
    for s in sizes:
        total *= s
    if total != shape[d] or shape[d] % n:
        raise ValueError(f"dim {d} of part {shape} (view dims {dims} of {part.view}) does "
                         f"not split into {n} equal pieces")
    chunk, start = shape[d] // n, index * (shape[d] // n)
    inner = 1
    for k in range(len(dims) - 1, -1, -1):        # the innermost dim the chunk ranges over
        if inner * sizes[k] >= chunk or k == 0:
            break
        inner *= sizes[k]
    if chunk % inner or start % inner or (start // inner) % sizes[k] + chunk // inner > sizes[k]:
        raise ValueError(f"shard {index} of {n} of dim {d} of part {shape} is not a box of "
                         f"view {part.view} (view dims {dims}, box {part.box})")
    lo = (start // inner) % sizes[k]
    outer = start // (inner * sizes[k])
    for j, size in zip(reversed(dims[:k]), reversed(sizes[:k])):   # fixed outer indices
        a = box[j][0] + outer % size
        box[j] = (a, a + 1)
        outer //= size
    a = box[dims[k]][0] + lo
    box[dims[k]] = (a, a + chunk // inner)
    return tuple(box)


def nbytes(v: "Value", placement: Placement | None = None, n: int = 1) -> float:
    """Bytes of `v` on one rank under `placement` (full size when None or not a Shard)."""
    if not v.is_tensor:
        return 0.0
    p = placement if placement is not None else Replicate()
    shape = local_shape(v.meta.shape, p, n) if isinstance(p, Shard) else v.meta.shape
    return float(math.prod(shape)) * v.meta.dtype.itemsize
