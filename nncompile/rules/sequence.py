"""Rules that hold along the sequence (context-parallel) axis only.

Splitting the sequence is splitting a dim like any other for token-wise ops (the ordinary
rules), but two ops need more than their rule offers:

- attention: each rank keeps its own query rows and needs every key and value. `rows`
  splits q (and a mask's rows) along L and reads k and v whole (insert_comm gathers them;
  the gather's backward reduce-scatters their gradients); comm.attention_rows runs the rank's
  rows, shifting a causal mask by the rows before them:

      q: [B, H, L, D] S(2)   k, v: [B, Hkv, S, D] R   ->   out: [B, H, L, D] S(2)

- the loss over a flattened (batch x sequence) split: logits [B*T, V] hold, per rank, its
  T/C tokens of every batch row, StridedShard(0, B); the row-wise mean loss splits rows in
  that same order (comm.cross_entropy_rows: local sum / global count).

Offered by `sequence_strategies(op, n)`, which the context_parallel pass adds to the
ordinary ones; the tensor-parallel plan never sees them.
"""
from __future__ import annotations

from ..ir import P, Op, Replicate, Shard, StridedShard
from .registry import divisible, make
from ..modes import resolve

SDPA = ("scaled_dot_product_attention",)


def _arg(op: Op, i: int, name: str, default):
    return resolve(op.args[i] if len(op.args) > i else op.kwargs.get(name, default))


def attention_rows(op: Op, n: int) -> list:
    """q's rows split, k and v whole (see the module docstring); not with attention
    dropout (its draws are over the whole score matrix)."""
    q, k, v = op.args[:3]
    mask = _arg(op, 3, "attn_mask", None)
    if _arg(op, 4, "dropout_p", 0.0) or not divisible(q, len(q.meta.shape) - 2, n):
        return []
    d = len(q.meta.shape) - 2
    places = {q: Shard(d), k: Replicate(), v: Replicate()}
    if mask is not None and hasattr(mask, "meta"):
        a = d - (len(q.meta.shape) - len(mask.meta.shape))
        if a >= 0 and mask.meta.shape[a] > 1:
            if not divisible(mask, a, n):
                return []
            places[mask] = Shard(a)
    return [make(op, places, [Shard(d)], "rows: split q's rows, k and v whole",
                 local_target="comm.attention_rows")]


def strided_loss_rows(op: Op, n: int) -> list:
    """cross_entropy over rows split as StridedShard(0, o), the order a sequence split of
    [B, T, V] flattened to [B*T, V] leaves (o = B), targets split alike."""
    logits, target = op.args[:2]
    have = logits.placement
    reduction = _arg(op, 3, "reduction", 1)
    weight = _arg(op, 2, "weight", None)
    if not isinstance(have, StridedShard) or weight is not None or \
            _arg(op, 5, "label_smoothing", 0.0) or len(target.meta.shape) != 1 or \
            target.meta.dtype.is_floating_point or logits.meta.shape[0] % (have.outer * n):
        return []
    places = {logits: have, target: have}
    if reduction == 0:
        return [make(op, places, [have], "split rows (strided)")]
    if reduction == 2:
        return [make(op, places, [P], "split rows (strided)")]
    return [make(op, places, [P], "split rows (strided)",
                 local_target="comm.cross_entropy_rows")]


def sequence_strategies(op: Op, n: int) -> list:
    """The strategies only the sequence axis offers for `op` (none for most ops)."""
    name = getattr(op.target, "_opname", "")
    if name in SDPA:
        return attention_rows(op, n)
    if name == "cross_entropy_loss":
        return strided_loss_rows(op, n)
    return []
