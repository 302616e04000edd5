"""View and layout ops: a split follows the dim it lands on; partial sums pass through.

view/reshape map dims by grouping sizes: (B, T, C) -> (B, T, H, D) groups C with (H, D), so
S(2) in becomes S(2) out when H divides by n (a -1 in the size is already resolved in the
traced output shape). A split inside a group that is not on its first dim is a strided split
(StridedShard, under `strided_splits()`): merging batch and heads (B, H, T, D) S(1) ->
(B*H, T, D) gives S(0|B), each rank's heads strided through the merged dim, and the view back
(B*H, T, T) -> (B, H, T, T) gives S(1) again (DeBERTa's attention); `repeat` of a split dim
gives one too. Ops that map a dim onto an equal one element by element (transpose, slice,
elementwise, the batch of bmm, gather) carry a strided split as they carry a plain one.
Localize rewrites size arguments to local shapes.
"""
from __future__ import annotations

import torch

from ..ir import P, Op, Replicate, Shard, StridedShard, strided
from .registry import divisible, make, outers, register


def _groups(a: tuple[int, ...], b: tuple[int, ...]) -> list[tuple[list[int], list[int]]]:
    """Pair runs of dims of `a` and `b` with equal products (size-1 dims sit alone)."""
    groups, i, j = [], 0, 0
    while i < len(a) or j < len(b):
        if i < len(a) and a[i] == 1 and (j >= len(b) or b[j] != 1):
            i += 1
            continue
        if j < len(b) and b[j] == 1 and (i >= len(a) or a[i] != 1):
            j += 1
            continue
        ga, gb = [i], [j]
        pa, pb = a[i], b[j]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb:
                pa *= a[i]
                ga.append(i)
                i += 1
            else:
                pb *= b[j]
                gb.append(j)
                j += 1
        groups.append((ga, gb))
    return groups


def reshape_map(in_shape: tuple[int, ...], out_shape: tuple[int, ...], n: int) -> dict[int, int]:
    """Input dim -> output dim a plain split can follow through a reshape."""
    return {p.dim: q.dim for p, q in reshape_pairs(in_shape, out_shape, n)
            if type(p) is Shard and type(q) is Shard}


def _land(shape: tuple[int, ...], dims: list[int], block: int, n: int) -> Shard | None:
    """The split of the group `dims` of `shape` into `block` outer blocks, each cut into n
    contiguous pieces: the dim the cut lands on, strided by the blocks before it there."""
    before = 1
    for j in dims:
        if block % before == 0 and shape[j] % (block // before) == 0 \
                and (shape[j] // (block // before)) % n == 0:
            return strided(j, block // before)
        before *= shape[j]
    return None


def reshape_pairs(in_shape: tuple[int, ...], out_shape: tuple[int, ...], n: int
                  ) -> list[tuple[Shard, Shard]]:
    """(input split, output split) pairs a reshape carries: a split of an input dim, strided
    by `o` (o == 1: plain), cuts its group's elements into `before * o` outer blocks, each
    in n contiguous pieces; the output split is where those cuts land (`_land`)."""
    pairs = []
    for ga, gb in _groups(tuple(in_shape), tuple(out_shape)):
        before = 1
        for i in ga:
            for o in [1] + outers(in_shape[i], n):
                if (in_shape[i] // o) % n:
                    continue
                q = _land(out_shape, gb, before * o, n)
                if q is not None:
                    pairs.append((strided(i, o), q))
            before *= in_shape[i]
    return pairs


def _same(x, i: int, out, j: int) -> bool:
    return x.meta.shape[i] == out.meta.shape[j]


def _follow(op: Op, dim_map: dict[int, int], n: int, partial: bool = True):
    """Input dim i -> output dim j for each pair of dim_map: a split of i is one of j, and a
    strided split too where the dims are equal (the op maps them element by element)."""
    x, out = op.args[0], op.outputs
    strategies = []
    for i, j in sorted(dim_map.items()):
        if divisible(x, i, n) and all(divisible(o, j, n) for o in out):
            strategies.append(make(op, {x: Shard(i)}, [Shard(j)] * len(out), f"split dim {i}"))
            if all(_same(x, i, o, j) for o in out):
                strategies += [make(op, {x: StridedShard(i, k)}, [StridedShard(j, k)] * len(out),
                                    f"split dim {i} strided") for k in outers(x.meta.shape[i], n)]
    if partial and x.meta.dtype.is_floating_point:
        strategies.append(make(op, {x: P}, [P] * len(out), "keep partial"))
    return strategies


def _pairs(op: Op, pairs: list[tuple[Shard, Shard]]):
    x = op.args[0]
    found = [make(op, {x: p}, [q], f"split dim {p.dim}" + (
        "" if type(p) is Shard and type(q) is Shard else " strided")) for p, q in pairs]
    if x.meta.dtype.is_floating_point:
        found.append(make(op, {x: P}, [P], "keep partial"))
    return found


@register("view", "reshape", "_unsafe_view", "flatten")
def reshape(op: Op, n: int):
    x, out = op.args[0], op.outputs[0]
    return _pairs(op, reshape_pairs(x.meta.shape, out.meta.shape, n))


@register("transpose", "swapaxes")
def transpose(op: Op, n: int):
    x = op.args[0]
    r = len(x.meta.shape)
    d0, d1 = op.args[1] % r, op.args[2] % r
    return _follow(op, {i: (d1 if i == d0 else d0 if i == d1 else i) for i in range(r)}, n)


@register("t", "numpy_T")
def t(op: Op, n: int):
    r = len(op.args[0].meta.shape)
    return _follow(op, {i: r - 1 - i for i in range(r)}, n)


@register("permute")
def permute(op: Op, n: int):
    dims = [d % len(op.args[0].meta.shape) for d in op.args[1]]
    return _follow(op, {src: dst for dst, src in enumerate(dims)}, n)


@register("unsqueeze")
def unsqueeze(op: Op, n: int):
    r = len(op.args[0].meta.shape)
    d = op.args[1] % (r + 1)
    return _follow(op, {i: i if i < d else i + 1 for i in range(r)}, n)


@register("squeeze")
def squeeze(op: Op, n: int):
    x, out = op.args[0], op.outputs[0]
    return _pairs(op, reshape_pairs(x.meta.shape, out.meta.shape, n))


@register("expand")
def expand(op: Op, n: int):
    x, out = op.args[0], op.outputs[0]
    off = len(out.meta.shape) - len(x.meta.shape)
    keep = {i: i + off for i, s in enumerate(x.meta.shape) if s == out.meta.shape[i + off]}
    found = _follow(op, keep, n)
    # a size-1 dim broadcast into a split one (MLA's shared rotary key to the local heads):
    # each rank expands its whole copy to its part; the gradient, a sum over it, is partial
    for i, s in enumerate(x.meta.shape):
        if s == 1 and out.meta.shape[i + off] != 1 and divisible(out, i + off, n):
            found.append(make(op, {x: Replicate()}, [Shard(i + off)],
                              f"broadcast into split dim {i + off}"))
            found += [make(op, {x: Replicate()}, [StridedShard(i + off, k)],
                           f"broadcast into split dim {i + off} strided")
                      for k in outers(out.meta.shape[i + off], n)]
    return found


@register("new_empty")
def new_empty(op: Op, n: int):
    """An uninitialized tensor shaped like its input on the dims it keeps: split alike."""
    x, out = op.args[0], op.outputs[0]
    if len(x.meta.shape) != len(out.meta.shape):
        return []
    return [make(op, {x: Shard(d)}, [Shard(d)], f"split dim {d}")
            for d in range(len(x.meta.shape))
            if x.meta.shape[d] == out.meta.shape[d] and divisible(x, d, n)]


@register("slice_scatter")
def slice_scatter(op: Op, n: int):
    """`z[..., a:b] = y`: z and y split alike on a dim other than the sliced one."""
    x, src = op.args[0], op.args[1]
    cut = _cut_dim(op, 2)
    found = [make(op, {x: Shard(d), src: Shard(d)}, [Shard(d)], f"split dim {d}")
             for d in range(len(x.meta.shape))
             if d != cut and divisible(x, d, n) and divisible(src, d, n)]
    if x.meta.dtype.is_floating_point:
        found.append(make(op, {x: P, src: P}, [P], "keep partial"))
    return found


def _cut_dim(op: Op, pos: int = 1, default: int = 0) -> int:
    x = op.args[0] if not isinstance(op.args[0], list) else op.args[0][0]
    d = op.args[pos] if len(op.args) > pos else op.kwargs.get("dim", default)
    return d % len(x.meta.shape)


@register("split", "split_with_sizes", "chunk", "unsafe_split")
def split(op: Op, n: int):
    x = op.args[0]
    cut = _cut_dim(op, 2)
    return _follow(op, {i: i for i in range(len(x.meta.shape)) if i != cut}, n)


@register("slice", "narrow")
def slice_(op: Op, n: int):
    x = op.args[0]
    cut = _cut_dim(op, 1)
    return _follow(op, {i: i for i in range(len(x.meta.shape)) if i != cut}, n)


@register("select")
def select(op: Op, n: int):
    x = op.args[0]
    cut = _cut_dim(op, 1)
    return _follow(op, {i: (i if i < cut else i - 1) for i in range(len(x.meta.shape))
                        if i != cut}, n)


@register("unbind")
def unbind(op: Op, n: int):
    """`x.unbind(d)`: every part keeps x's other dims, so a split on one of them follows
    (Falcon's `qkv.unflatten(-2, (heads, 3)).unbind(-2)` keeps its heads split)."""
    x = op.args[0]
    cut = _cut_dim(op, 1)
    return _follow(op, {i: (i if i < cut else i - 1) for i in range(len(x.meta.shape))
                        if i != cut}, n)


@register("cat")
def cat(op: Op, n: int):
    """Every part split alike on a dim other than the cut, or all partial. A 1-D empty part
    (torch.cat skips it whatever the other parts' shapes: Hugging Face's key/value cache
    starts as one) stays replicated: it holds nothing to split."""
    tensors = [t for t in op.args[0] if t.meta.shape != (0,)]
    out = op.outputs[0]
    cut = (op.args[1] if len(op.args) > 1 else op.kwargs.get("dim", 0)) % len(out.meta.shape)
    strategies = []
    for d in range(len(out.meta.shape)):
        if d == cut or not tensors or not all(divisible(t, d, n) for t in tensors):
            continue
        strategies.append(make(op, {t: Shard(d) for t in tensors}, [Shard(d)], f"split dim {d}"))
    if out.meta.dtype.is_floating_point and tensors:
        strategies.append(make(op, {t: P for t in tensors}, [P], "keep partial"))
    return strategies


@register("view_as_complex")
def view_as_complex(op: Op, n: int):
    """(..., 2) real -> (...) complex (the rotary of Meta's and torchtitan's Llama): every dim
    but the last pair follows."""
    x = op.args[0]
    return _follow(op, {i: i for i in range(len(x.meta.shape) - 1)}, n, partial=False)


@register("view_as_real")
def view_as_real(op: Op, n: int):
    """(...) complex -> (..., 2) real: every dim follows; the new last pair stays whole."""
    x = op.args[0]
    return _follow(op, {i: i for i in range(len(x.meta.shape))}, n, partial=False)


@register("index.Tensor")
def index(op: Op, n: int):
    """x[i] / x[:, i]: the dims no index tensor reads follow (index tensors replicate). Swin's
    relative position bias `table[index]` ([(2W-1)^2, heads] table) keeps its heads split.
    Index tensors on dims that are not next to each other put the result's dims first in
    torch: not split."""
    x, indices = op.args[0], op.args[1]
    used = [i for i, t in enumerate(indices) if t is not None]
    if not used or used != list(range(used[0], used[-1] + 1)) or any(
            indices[i].meta.dtype in (torch.bool, torch.uint8) for i in used):
        return []                       # a boolean mask reads as many dims as it has
    p, q = used[0], used[-1] + 1
    rank = len(x.meta.shape)
    gathered = len(op.outputs[0].meta.shape) - (rank - (q - p))
    dim_map = {i: i for i in range(p)}
    dim_map.update({i: i - (q - p) + gathered for i in range(q, rank)})
    return _follow(op, dim_map, n)


@register("repeat_interleave.self_int")
def repeat_interleave(op: Op, n: int):
    """x.repeat_interleave(r, dim): every dim follows; a split of `dim` itself too, since each
    element's r copies stay next to each other (GQA's kv heads -> query heads)."""
    x = op.args[0]
    dim = op.args[2] if len(op.args) > 2 else op.kwargs.get("dim")
    if dim is None or len(op.args) > 3 or op.kwargs.get("output_size") is not None:
        return []
    return _follow(op, {i: i for i in range(len(x.meta.shape))}, n)


@register("repeat")
def repeat(op: Op, n: int):
    """x.repeat(r0, r1, ...): out dim d is r copies of x's dim, one after another, so a split
    of x's dim is, in each copy, a split strided by r (S(d) -> S(d|r)); dims repeated once
    follow as they are; new leading dims stay whole. Linear: partial sums pass."""
    x = op.args[0]
    reps = list(op.args[1])
    off = len(reps) - len(x.meta.shape)
    found = []
    for i, size in enumerate(x.meta.shape):
        r = reps[i + off]
        if r < 1:
            continue
        for o in [1] + outers(size, n):
            if size % (o * n):
                continue
            src = strided(i, o)
            dst = strided(i + off, o * r)
            found.append(make(op, {x: src}, [dst], f"split dim {i}" + (
                "" if type(dst) is Shard else " strided")))
    if x.meta.dtype.is_floating_point:
        found.append(make(op, {x: P}, [P], "keep partial"))
    return found


@register("gather")
def gather(op: Op, n: int):
    """torch.gather(x, dim, index): out has index's shape, out[.., i, ..] reads x along `dim`
    at the same other coordinates. index split on `dim` with x whole splits out alike; x and
    index split alike on another dim where their sizes agree (strided too: element by
    element); linear in x, so a partial x with a whole index stays partial."""
    x, dim, index = op.args[:3]
    out = op.outputs[0]
    rank = len(out.meta.shape)
    if not rank or not hasattr(index, "meta"):
        return []
    dim %= rank
    found = []
    for d in range(rank):
        if not divisible(index, d, n):
            continue
        if d == dim:                    # each rank gathers its own columns from the whole x
            found.append(make(op, {index: Shard(d)}, [Shard(d)], f"split index dim {d}"))
        elif x.meta.shape[d] == index.meta.shape[d]:
            found.append(make(op, {x: Shard(d), index: Shard(d)}, [Shard(d)], f"split dim {d}"))
            found += [make(op, {x: StridedShard(d, k), index: StridedShard(d, k)},
                           [StridedShard(d, k)], f"split dim {d} strided")
                      for k in outers(index.meta.shape[d], n)]
    if x.meta.dtype.is_floating_point:
        found.append(make(op, {x: P, index: Replicate()}, [P], "keep partial"))
    return found
