"""Sharding vocabulary, in DTensor's words: one placement per plan-mesh dimension.

The plan mesh is 1-D for now, so a value carries one placement.
"""
from __future__ import annotations

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


Placement = Replicate | Shard | Partial
R = Replicate()
P = Partial()


def parse_placement(text: str) -> Placement:
    """Inverse of repr: 'R', 'P', 'S(2)'."""
    text = text.strip()
    if text == "R":
        return R
    if text == "P":
        return P
    if text.startswith("S(") and text.endswith(")"):
        return Shard(int(text[2:-1]))
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
    out = [[0, s] for s in shape]
    if isinstance(placement, Shard):
        size = shape[placement.dim] // n
        out[placement.dim] = [index * size, (index + 1) * size]
    return out
