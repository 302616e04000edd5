"""How a list of tensors is cut into equal pieces over a group of ranks.

Two layouts share one interface (runs, owned, padded, to_full, from_full, unflatten):

- FlatLayout (ZeRO-1/2 optimizer state and gradients): the tensors flattened into one vector
  and cut into `size` equal pieces; piece k holds elements [k*chunk, (k+1)*chunk):

      tensors a [3, 2], b [5]   size 2   ->   piece 0: a0 a1 a2 a3 a4 | piece 1: a5 b0 .. b4

- RowShardLayout (ZeRO-3 units): each tensor cut by rows, torch.chunk's way (Shard(0) of a
  DTensor), and a rank's piece is its rows of every tensor, each in a slot padded to the
  largest rank's rows:

      a [3, 2], b [5]   size 2   ->   piece 0: a[0:2] b[0:3] | piece 1: a[2:3] +pad  b[3:5] +pad

  so this rank's run of a tensor is a whole Shard(0) local tensor (a DTensor's local piece:
  runtime/store/module_views.py). The group still gathers a unit with one collective; the gathered
  pieces are copied out into the tensors' own order (`to_full`), and a full gradient copied
  in before its reduce-scatter (`from_full`), as FSDP2 does.

A layout's "full" vector is the tensors flattened one after the other (`unflatten` views
it); a "gathered" vector is the `size` pieces one after the other.
"""
from __future__ import annotations

import torch


class FlatLayout:
    """Tensors of `numels` elements flattened into one vector, cut into `size` equal pieces
    of `chunk` elements; piece `rank` holds elements [lo, hi) (the end is padding)."""

    def __init__(self, names: list[str], shapes: list[tuple], rank: int, size: int):
        self.names, self.shapes = list(names), [tuple(s) for s in shapes]
        self.numels = [int(torch.Size(s).numel()) for s in self.shapes]
        self.total = sum(self.numels)
        self.size, self.rank = size, rank
        self.chunk = max(1, -(-self.total // size))
        self.lo = min(rank * self.chunk, self.total)
        self.hi = min(self.lo + self.chunk, self.total)

    def run_of(self, i: int, rank: int) -> tuple[int, int, int]:
        """(offset in piece `rank`, start, stop): the elements [start, stop) of tensor i's
        flattening that piece holds, at that offset (start == stop: none)."""
        offset = sum(self.numels[:i])
        lo, hi = min(rank * self.chunk, self.total), min((rank + 1) * self.chunk, self.total)
        a = min(max(lo, offset), offset + self.numels[i])
        b = max(min(hi, offset + self.numels[i]), a)
        at = min(max(a - lo, 0), hi - lo)
        return at, a - offset, b - offset

    def runs(self) -> list[tuple[int, int, int]]:
        """run_of(i, this rank) for every tensor i."""
        return [self.run_of(i, self.rank) for i in range(len(self.names))]

    def spans(self) -> list[tuple[int, int, int]]:
        """(index, start, stop) within each tensor of the elements this piece owns."""
        return [(i, s, e) for i, (_, s, e) in enumerate(self.runs()) if s < e]

    def owned(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """This rank's piece of the flattened `tensors` (copying only what it holds)."""
        pieces = [t.reshape(-1)[s:e] for t, (_, s, e) in zip(tensors, self.runs()) if s < e]
        if not pieces:
            return tensors[0].new_zeros(0)
        return torch.cat(pieces)

    def place(self, runs: list[torch.Tensor]) -> torch.Tensor:
        """This rank's piece from its run of each tensor (in order)."""
        return torch.cat(runs) if runs else torch.zeros(0)

    def padded(self, local: torch.Tensor) -> torch.Tensor:
        """A piece of hi - lo elements as `chunk` elements (zeros after)."""
        if local.numel() == self.chunk:
            return local
        out = local.new_zeros(self.chunk)
        out[:local.numel()] = local
        return out

    def to_full(self, gathered: torch.Tensor) -> torch.Tensor:
        """The gathered pieces as the full vector: the same (the pieces are its cuts)."""
        return gathered

    def from_full(self, full: torch.Tensor) -> torch.Tensor:
        """The full vector as the pieces one after the other (padded)."""
        if full.numel() == self.chunk * self.size:
            return full
        out = full.new_zeros(self.chunk * self.size)
        out[:full.numel()] = full
        return out

    def ranked(self, tensors) -> torch.Tensor:
        """from_full of the tensors joined (None: zeros)."""
        like = next(t for t in tensors if t is not None)
        return self.from_full(torch.cat([
            (t if t is not None else like.new_zeros(s)).reshape(-1)
            for t, s in zip(tensors, self.shapes)]))

    def unflatten(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of the full flat vector shaped like the tensors."""
        return [t.view(s) for t, s in zip(flat[:self.total].split(self.numels), self.shapes)]


class RowShardLayout(FlatLayout):
    """Each tensor's rows cut over `size` ranks as torch.chunk cuts them (a 0-d tensor is one
    row); piece `rank` is its rows of every tensor, each tensor in a slot of `per_rank[i]`
    rows (see the module docstring)."""

    def __init__(self, names: list[str], shapes: list[tuple], rank: int, size: int):
        self.names, self.shapes = list(names), [tuple(s) for s in shapes]
        self.numels = [int(torch.Size(s).numel()) for s in self.shapes]
        self.total = sum(self.numels)
        self.size, self.rank = size, rank
        self.rows = [s[0] if len(s) else 1 for s in self.shapes]
        self.widths = [n // r if r else 0 for n, r in zip(self.numels, self.rows)]
        self.per_rank = [-(-rows // size) for rows in self.rows]
        slots = [c * w for c, w in zip(self.per_rank, self.widths)]
        self.offsets = [sum(slots[:i]) for i in range(len(slots))]
        self.slots = slots
        self.chunk = max(1, sum(slots))

    def run_of(self, i: int, rank: int) -> tuple[int, int, int]:
        c, w = self.per_rank[i], self.widths[i]
        r0 = min(rank * c, self.rows[i])
        r1 = min(r0 + c, self.rows[i])
        return self.offsets[i], r0 * w, r1 * w

    def local_rows(self, i: int, rank: int | None = None) -> int:
        """How many rows of tensor i piece `rank` (this rank's) holds."""
        _, s, e = self.run_of(i, self.rank if rank is None else rank)
        return (e - s) // self.widths[i] if self.widths[i] else 0

    def owned(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        out = tensors[0].new_zeros(self.chunk) if tensors else torch.zeros(self.chunk)
        for t, (at, s, e) in zip(tensors, self.runs()):
            out[at:at + e - s] = t.reshape(-1)[s:e]
        return out

    def place(self, runs: list[torch.Tensor]) -> torch.Tensor:
        out = runs[0].new_zeros(self.chunk) if runs else torch.zeros(self.chunk)
        for r, (at, s, e) in zip(runs, self.runs()):
            out[at:at + e - s] = r.reshape(-1)[:e - s]
        return out

    def to_full(self, gathered: torch.Tensor) -> torch.Tensor:
        """Copy-out: the gathered pieces [size * chunk] -> the tensors one after the other
        [total] (one copy)."""
        pieces = gathered.view(self.size, self.chunk)
        out = gathered.new_empty(self.total)
        for t, at, slot, c, w, rows in zip(self.unflatten(out), self.offsets, self.slots,
                                           self.per_rank, self.widths, self.rows):
            if not w:
                continue
            src = pieces[:, at:at + slot].view(self.size, c, w)      # [rank, its rows, w]
            t = t.view(rows, w)
            k, rest = divmod(rows, c) if c else (0, 0)
            t[:k * c].view(k, c, w).copy_(src[:k])
            if rest:
                t[k * c:].copy_(src[k, :rest])
        return out

    def from_full(self, full: torch.Tensor) -> torch.Tensor:
        """Copy-in: the tensors one after the other -> the pieces one after the other, each
        tensor's slots padded with zeros."""
        return self.ranked(self.unflatten(full))

    def ranked(self, tensors) -> torch.Tensor:
        """Copy-in of the tensors themselves (None: zeros), straight into the pieces' order."""
        like = next(t for t in tensors if t is not None)
        out = like.new_empty(self.size, self.chunk)
        for t, at, slot, c, w, rows in zip(tensors, self.offsets, self.slots, self.per_rank,
                                           self.widths, self.rows):
            if not w:
                continue
            into = out[:, at:at + slot].view(self.size, c, w)     # [rank, its rows, w]
            if t is None:
                into.zero_()
                continue
            t = t.reshape(rows, w)
            k, rest = divmod(rows, c) if c else (0, 0)
            into[:k].copy_(t[:k * c].view(k, c, w))
            if k < self.size:                             # a partial rank, then padding
                into[k, :rest].copy_(t[k * c:])
                into[k, rest:].zero_()
                into[k + 1:].zero_()
        if sum(self.slots) < self.chunk:
            out[:, sum(self.slots):].zero_()
        return out.view(-1)


__all__ = ["FlatLayout", "RowShardLayout"]
