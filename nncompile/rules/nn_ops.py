"""Model-level ops: embedding, attention, reductions and the loss."""
from __future__ import annotations

from ..ir import P, Op, Replicate, Shard
from .registry import divisible, make, register


@register("embedding")
def embedding(op: Op, n: int):
    weight, idx = op.args[:2]
    out = op.outputs[0]
    last = len(out.meta.shape) - 1
    strategies = []
    if divisible(weight, 1, n):
        strategies.append(make(op, {weight: Shard(1), idx: Replicate()}, [Shard(last)],
                               "split embedding dim"))
    for d in range(len(idx.meta.shape)):
        if divisible(idx, d, n):
            strategies.append(make(op, {idx: Shard(d)}, [Shard(d)], f"split dim {d}"))
    return strategies


@register("scaled_dot_product_attention")
def sdpa(op: Op, n: int):
    """Split batch or heads; q, k, v and the mask follow (a size-1 mask dim replicates): an
    additive or boolean mask with a heads dim (a per-head bias, Swin's relative position bias
    [1, H, L, S] or [nW, H, L, S] under 5-D q) splits with the heads.
    With `enable_gqa=True` k and v have fewer heads than q (a group of q heads per k/v head):
    splitting heads gives each rank q's and k/v's heads in the same contiguous chunks, so both
    head counts must divide by n and every rank keeps whole groups. One k/v head (multi-query,
    broadcast or grouped) stays whole on every rank while q's heads split. `is_causal` needs no
    placement (the causal mask is over L and S, never split)."""
    q, k, v = op.args[:3]
    mask = op.args[3] if len(op.args) > 3 else op.kwargs.get("attn_mask")
    gqa = bool(op.args[7] if len(op.args) > 7 else op.kwargs.get("enable_gqa", False))
    strategies = []
    rank = len(q.meta.shape)
    for d in range(rank - 2):
        places = {q: Shard(d), k: Shard(d), v: Shard(d)}
        if d == rank - 3 and k.meta.shape[d] == v.meta.shape[d] == 1 < q.meta.shape[d] \
                and divisible(q, d, n):
            places = {q: Shard(d), k: Replicate(), v: Replicate()}   # multi-query: k/v whole
        elif not all(divisible(t, d, n) for t in (q, k, v)):
            continue
        elif d == rank - 3 and k.meta.shape[d] != q.meta.shape[d] and not (
                gqa and q.meta.shape[d] % k.meta.shape[d] == 0):
            continue                    # heads that broadcast, not grouped: not split
        if mask is not None and hasattr(mask, "meta"):
            a = d - (len(q.meta.shape) - len(mask.meta.shape))
            if a >= 0 and mask.meta.shape[a] > 1:
                if not divisible(mask, a, n):
                    continue
                places[mask] = Shard(a)
            else:
                places[mask] = Replicate()
        note = "split heads" if d == rank - 3 and rank >= 4 else f"split dim {d}"
        if isinstance(places[k], Replicate):
            note += f" (q {q.meta.shape[d]} heads, one k/v head whole: multi-query)"
        elif d == rank - 3 and k.meta.shape[d] != q.meta.shape[d]:
            note += f" (q {q.meta.shape[d]} / kv {k.meta.shape[d]} heads, grouped)"
        strategies.append(make(op, places, [Shard(d)], note))
    return strategies


def _reduced_dims(op: Op) -> tuple[list[int], bool]:
    x = op.args[0]
    rank = len(x.meta.shape)
    dims = op.args[1] if len(op.args) > 1 else op.kwargs.get("dim")
    if dims is None or dims == []:
        return list(range(rank)), False
    if isinstance(dims, int):
        dims = [dims]
    keep = op.args[2] if len(op.args) > 2 else op.kwargs.get("keepdim", False)
    return [d % rank for d in dims], bool(keep)


@register("sum", "mean", "amax", "amin", "var", "std")
def reduction(op: Op, n: int):
    """Split a kept dim (follows), or a summed dim (sum only: leaves a partial sum)."""
    x, out = op.args[0], op.outputs[0]
    if not x.is_tensor or not x.meta.shape:
        return []
    reduced, keep = _reduced_dims(op)
    name = op.target._opname
    strategies = []
    j = 0
    for i in range(len(x.meta.shape)):
        if i in reduced:
            if name == "sum" and divisible(x, i, n):
                strategies.append(make(op, {x: Shard(i)}, [P], f"split summed dim {i}"))
            if keep:
                j += 1
            continue
        if divisible(x, i, n) and divisible(out, j, n):
            strategies.append(make(op, {x: Shard(i)}, [Shard(j)], f"split dim {i}"))
        j += 1
    if name in ("sum", "mean") and x.meta.dtype.is_floating_point:
        strategies.append(make(op, {x: P}, [P], "keep partial"))
    return strategies


@register("cross_entropy_loss")
def cross_entropy(op: Op, n: int):
    """Split rows: 'none' stays split, 'sum' leaves a partial sum, 'mean' divides each rank's
    sum by the global count of counted targets (comm.cross_entropy_rows)."""
    logits, target = op.args[:2]
    weight = op.args[2] if len(op.args) > 2 else op.kwargs.get("weight")
    reduction = op.args[3] if len(op.args) > 3 else op.kwargs.get("reduction", 1)
    smoothing = op.args[5] if len(op.args) > 5 else op.kwargs.get("label_smoothing", 0.0)
    if weight is not None or smoothing or not divisible(logits, 0, n) \
            or target.meta.dtype.is_floating_point or len(target.meta.shape) != 1:
        return []
    places = {logits: Shard(0), target: Shard(0)}
    if reduction == 0:
        return [make(op, places, [Shard(0)], "split rows")]
    if reduction == 2:
        return [make(op, places, [P], "split rows")]
    return [make(op, places, [P], "split rows", local_target="comm.cross_entropy_rows")]


# Batch norm's rule (conv.py) splits channels only in training (each channel's statistics stay
# whole, its running statistics split with it), never the batch: a batch split would normalize
# each rank with its own rows' statistics. A plan that splits its batch gathers it first, so
# the statistics (and the running statistics written back) are the unit's whole batch's.
