"""The rows of a generated class's PARAMS, BUFFERS and CONSTS tables, as named tuples.

A generated file prints each row as a plain tuple, and a checkpoint's plan_info stores it as a
list; both read back into a row whose placement is parsed (nncompile/ir/placement.py):

    PARAMS   ("h0_mlp_fc_weight", "h.0.mlp_fc.weight", (128, 32), "S(0)", ((0, 64), (0, 32)), False)
    -> ParamRow(name="h0_mlp_fc_weight", fqn="h.0.mlp_fc.weight", shape=(128, 32),
                placement=Shard(dim=0), slices=((0, 64), (0, 32)), partial_grad=False, part=None)

A *part* row is a piece of one original (fused) parameter that the compiler holds as its own
parameter: `fqn` is a unique key ("c_attn.weight[0/3]"), `shape` the part's full shape, and
`part` = (source FQN, source shape, view); `slices` is then this rank's box in `view`
coordinates, so the local tensor is `source.reshape(view)[slices].reshape(local_shape)`:

    ("attn_w_0", "c_attn.weight[0/3]", (32, 32), "S(0)", ((0, 16), (0, 32)), False,
     ("c_attn.weight", (96, 32), (96, 32)))     # rows 0:16 of c_attn.weight on rank 0 of 2

Map rows to and from the original module's tensors only with `row.source`, `take` and `put`.

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


def _part(part: Sequence[Any] | None) -> tuple | None:
    if part is None:
        return None
    source, source_shape, view = part
    return (str(source), tuple(int(d) for d in source_shape), tuple(int(d) for d in view))


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


# shared by the three row types (a NamedTuple cannot inherit methods)
def _local_shape(row) -> tuple[int, ...]:
    box = tuple(b - a for a, b in row.slices)
    if getattr(row, "part", None) is None:
        return box
    shape = tuple(row.shape)
    if not isinstance(row.placement, Shard):
        return shape
    d = row.placement.dim
    rest = _numel(shape[:d]) * _numel(shape[d + 1:])
    return (*shape[:d], _numel(box) // rest if rest else 0, *shape[d + 1:])


def _sharded(row) -> bool:
    return isinstance(row.placement, Shard)


def _plain(row) -> tuple:
    """As a generated file prints it (placement as text); an ordinary parameter's row
    without its `part` (None), as 6 fields."""
    out = tuple(repr(x) if isinstance(x, Placement) else x for x in row)
    return out[:6] if len(out) == 7 and out[6] is None else out


class ParamRow(NamedTuple):
    """A parameter: its local (attribute) name, original FQN (or a part's unique key), full
    shape, placement, the [start, stop) per dimension this rank holds, whether its gradient
    is a partial sum, and for a part of an original parameter (source FQN, source shape, view)."""
    name: str
    fqn: str
    shape: tuple[int, ...]
    placement: Placement
    slices: Slices
    partial_grad: bool = False
    part: tuple | None = None

    @classmethod
    def of(cls, row: Sequence[Any]) -> ParamRow:
        """From a generated tuple or a saved list (old plan_infos may lack partial_grad/part)."""
        if isinstance(row, cls):
            return row
        name, fqn, shape, placement, slices, *rest = row
        return cls(name, fqn, tuple(shape), _placement(placement), _slices(slices),
                   bool(rest and rest[0]), _part(rest[1] if len(rest) > 1 else None))

    @property
    def source(self) -> str:
        """The FQN of the original parameter this row is (a part of)."""
        return self.part[0] if self.part is not None else self.fqn

    @property
    def source_shape(self) -> tuple[int, ...]:
        """The full shape of the original parameter (the row's shape for an ordinary one)."""
        return self.part[1] if self.part is not None else tuple(self.shape)

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

    part = None                              # as a ParamRow's: a buffer is never a part
    source = property(lambda self: self.fqn)
    source_shape = property(lambda self: tuple(self.shape))
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


def _index(slices: Slices) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in slices)


def take(row: ParamRow | BufferRow | ConstRow, full: Any) -> Any:
    """This rank's local tensor of `row` from the original full tensor (shape row.source_shape
    for a parameter): `full[slices]`, or for a part `full.reshape(view)[slices].reshape(local)`.
    Returns a view of `full` where torch can (clone it to keep it)."""
    part = getattr(row, "part", None)
    if part is None:
        return full[_index(row.slices)]
    return full.reshape(part[2])[_index(row.slices)].reshape(row.local_shape)


def put(row: ParamRow | BufferRow, full: Any, local: Any) -> Any:
    """Write this rank's local tensor of `row` into the original full tensor `full` (in
    place, the inverse of `take`); returns `full`."""
    part = getattr(row, "part", None)
    if part is None:
        full[_index(row.slices)] = local
        return full
    box = tuple(b - a for a, b in row.slices)
    if full.is_contiguous():
        full.view(part[2])[_index(row.slices)] = local.reshape(box)
    else:
        tmp = full.contiguous()
        tmp.view(part[2])[_index(row.slices)] = local.reshape(box)
        full.copy_(tmp)
    return full


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
