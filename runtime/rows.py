"""The rows of a generated class's PARAMS, BUFFERS and CONSTS tables, as named tuples.

A generated file prints each row as a plain tuple, and a checkpoint's plan_info stores it as a
list; both read back into a row whose placement is parsed (nncompile/ir/placement.py):

    PARAMS   ("h0_mlp_fc_weight", "h.0.mlp_fc.weight", (128, 32), "S(0)", ((0, 64), (0, 32)), False)
    -> ParamRow(name="h0_mlp_fc_weight", fqn="h.0.mlp_fc.weight", shape=(128, 32),
                placement=Shard(dim=0), slices=((0, 64), (0, 32)), partial_grad=False)

Read rows only through param_rows / buffer_rows / state_rows / const_rows, which take a
ParallelModule, its class, or a saved plan_info dict, and use the fields by name.
"""
from __future__ import annotations

import functools
from typing import Any, NamedTuple, Sequence

from nncompile.ir.placement import Placement, Shard, parse_placement

Slices = tuple[tuple[int, int], ...]


@functools.lru_cache(maxsize=None)
def _parse(text: str) -> Placement:
    return parse_placement(text)


def _placement(p: str | Placement) -> Placement:
    return _parse(p) if isinstance(p, str) else p


def _slices(slices: Sequence[Sequence[int]]) -> Slices:
    return tuple((int(a), int(b)) for a, b in slices)


# shared by the three row types (a NamedTuple cannot inherit methods)
def _local_shape(row) -> tuple[int, ...]:
    return tuple(b - a for a, b in row.slices)


def _sharded(row) -> bool:
    return isinstance(row.placement, Shard)


def _plain(row) -> tuple:
    """As a generated file prints it (placement as text)."""
    return tuple(repr(x) if isinstance(x, Placement) else x for x in row)


class ParamRow(NamedTuple):
    """A parameter: its local (attribute) name, original FQN, full shape, placement, the
    [start, stop) per dimension this rank holds, and whether its gradient is a partial sum."""
    name: str
    fqn: str
    shape: tuple[int, ...]
    placement: Placement
    slices: Slices
    partial_grad: bool = False

    @classmethod
    def of(cls, row: Sequence[Any]) -> ParamRow:
        """From a generated tuple or a saved list (old plan_infos may lack partial_grad)."""
        if isinstance(row, cls):
            return row
        name, fqn, shape, placement, slices, *partial = row
        return cls(name, fqn, tuple(shape), _placement(placement), _slices(slices),
                   bool(partial and partial[0]))

    local_shape = property(_local_shape)
    sharded = property(_sharded)
    plain = _plain


class BufferRow(NamedTuple):
    """A persistent buffer: local name, original FQN, full shape, placement, this rank's slices."""
    name: str
    fqn: str
    shape: tuple[int, ...]
    placement: Placement
    slices: Slices

    @classmethod
    def of(cls, row: Sequence[Any]) -> BufferRow:
        if isinstance(row, cls):
            return row
        name, fqn, shape, placement, slices, *_ = row
        return cls(name, fqn, tuple(shape), _placement(placement), _slices(slices))

    local_shape = property(_local_shape)
    sharded = property(_sharded)
    plain = _plain


class ConstRow(NamedTuple):
    """A constant computed at load time from full buffers: local name, full shape, placement,
    this rank's slices (not saved in checkpoints)."""
    name: str
    shape: tuple[int, ...]
    placement: Placement
    slices: Slices

    @classmethod
    def of(cls, row: Sequence[Any]) -> ConstRow:
        if isinstance(row, cls):
            return row
        name, shape, placement, slices = row
        return cls(name, tuple(shape), _placement(placement), _slices(slices))

    local_shape = property(_local_shape)
    plain = _plain


def param_rows(src: Any) -> list[ParamRow]:
    """PARAMS of a ParallelModule (or its class), or "params" of a saved plan_info dict."""
    raw = src.get("params", []) if isinstance(src, dict) else src.PARAMS
    return [ParamRow.of(r) for r in raw]


def buffer_rows(src: Any) -> list[BufferRow]:
    """BUFFERS of a ParallelModule (or its class), or "buffers" of a saved plan_info dict."""
    raw = src.get("buffers", []) if isinstance(src, dict) else src.BUFFERS
    return [BufferRow.of(r) for r in raw]


def state_rows(src: Any) -> list[ParamRow | BufferRow]:
    """Every parameter, then every persistent buffer: what a checkpoint holds, in order."""
    return [*param_rows(src), *buffer_rows(src)]


def const_rows(src: Any) -> list[ConstRow]:
    return [ConstRow.of(r) for r in src.CONSTS]
