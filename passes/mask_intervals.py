"""A constant attention mask as one interval of keys per query row, computed without building
the [..., L, S] mask (fuse_attention's verdict at long sequences).

A causal LM builds its mask from vectors: positions along the rows ([.., L, 1]) and along the
keys ([.., 1, S]) compared elementwise and and-ed together. Only those last elementwise ops
are L x S; at 131072 tokens that is 17 G elements, too many to evaluate at compile time.
When every large op is a comparison of a row vector with a sorted key vector, an `and` of
such masks or a view of one, each row attends to one interval of keys:

    le(kv[1, 1, 1, S], q[1, 1, L, 1])          ->  row i: keys [0, searchsorted(kv, q_i, right))
    eq(doc_kv, doc_q)                          ->  row i: keys [first == doc_i, last == doc_i]
    and(a, b)                                  ->  row i: [max(lo_a, lo_b), min(hi_a, hi_b))

so the mask is two integer vectors `lo`, `hi` ([..., L]) computed in O(L log S); row i
attends to key j iff lo_i <= j < hi_i. The vectors the comparisons read are small and are
evaluated on CPU as fuse_attention evaluates masks. Anything else (an `or`, a negation, a key
vector that is not sorted, a float mask) returns None and fuse_attention evaluates the mask
whole where it is small enough.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from nncompile.ir import Graph, Value
from nncompile.ir.interpret import run_ops

SMALL = 1 << 22         # ops with at most this many output elements are evaluated outright

_COMPARE = {"le", "lt", "ge", "gt", "eq"}
_MIRROR = {"le": "ge", "lt": "gt", "ge": "le", "gt": "lt", "eq": "eq"}   # swap the operands
_AND = {"__and__", "bitwise_and", "logical_and"}
_SAME = {"to", "_to_copy", "clone", "contiguous", "expand", "alias", "lift_fresh_copy"}
_FILLED = {"ones": True, "new_ones": True, "ones_like": True, "zeros": False,
           "new_zeros": False, "zeros_like": False}


@dataclass
class Rows:
    """Row i of a boolean [..., L, S] mask attends to keys lo[..., i] <= j < hi[..., i]."""
    lo: torch.Tensor
    hi: torch.Tensor


def mask_rows(g: Graph, mask: Value, need: set[int]) -> Rows | None:
    """The mask (computed by the ops `need`, ids of constant ops) as Rows, or None where its
    large ops are not comparisons, `and`s and views as above."""
    if mask.meta is None or mask.meta.dtype != torch.bool or len(mask.meta.shape) < 2:
        return None
    ops = [op for op in g.const_ops + g.ops if id(op) in need]
    big = {id(op) for op in ops if any(_large_matrix(v, mask) for v in op.outputs)}
    if not big:
        return None                              # small: evaluated whole
    env: dict[int, Any] = {}
    S = mask.meta.shape[-1]
    try:
        with torch.no_grad():
            for op in ops:
                if id(op) not in big:
                    if any(id(x) in env and isinstance(env[id(x)], Rows)
                           for x in op.inputs()):
                        return None              # a small result of a large mask
                    run_ops([op], env)
                    continue
                out = _large(op, env, S)
                if out is None:
                    return None
                env[id(op.outputs[0])] = out
    except Exception:                            # noqa: BLE001 - fall back to evaluating
        return None
    out = env.get(id(mask))
    return out if isinstance(out, Rows) else None


def _large_matrix(v: Value, mask: Value) -> bool:
    """Whether `v` is a large boolean matrix shaped like the mask (not a vector of rows or
    keys, nor positions [batch, seq]: those are evaluated)."""
    shape, want = (v.meta.shape if v.meta is not None else ()), mask.meta.shape
    return len(shape) == len(want) and shape[-2:] == want[-2:] and v.meta.numel > SMALL \
        and v.meta.dtype == torch.bool


def _large(op, env: dict[int, Any], S: int) -> Rows | None:
    """The Rows of one large op's output, or None."""
    name = getattr(op.target, "_opname", "")
    if len(op.outputs) != 1 or op.outputs[0].meta.shape[-1] != S:
        return None
    vals = [env.get(id(x), x) if isinstance(x, Value) else x for x in op.args]
    if name in _SAME:
        src = vals[0]
        if name == "to" or name == "_to_copy":
            if op.outputs[0].meta.dtype != torch.bool:
                return None
        return src if isinstance(src, Rows) else _as_rows(src, S)
    if name in _FILLED:                          # every key of every row, or none
        return _as_rows(torch.tensor(_FILLED[name]), S)
    if name in _AND:
        a, b = (x if isinstance(x, Rows) else _as_rows(x, S) for x in vals[:2])
        if a is None or b is None:
            return None
        lo, hi = torch.maximum(a.lo, b.lo), torch.minimum(a.hi, b.hi)
        return Rows(lo, torch.maximum(hi, lo))
    if name in _COMPARE:
        return _compare(name, vals[0], vals[1], S)
    return None


def _as_rows(t: Any, S: int) -> Rows | None:
    """A small boolean tensor broadcast over [..., L, S] as Rows: constant along the keys
    (all or none of them per row), or one run of True keys shared by every row."""
    if isinstance(t, bool):
        t = torch.tensor(t)
    if not isinstance(t, torch.Tensor) or t.dtype != torch.bool:
        return None
    if t.dim() < 2:
        t = t.reshape((1,) * (2 - t.dim()) + tuple(t.shape))
    if t.shape[-1] == 1:                              # the same for every key of a row
        row = t[..., 0].to(torch.int64)
        return Rows(torch.zeros_like(row), row * S)
    if t.shape[-2] != 1 or any(d != 1 for d in t.shape[:-2]):
        return None
    keys = t.reshape(-1)
    idx = keys.nonzero().flatten()
    if idx.numel() == 0:
        return Rows(torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64))
    lo, hi = int(idx[0]), int(idx[-1]) + 1
    if hi - lo != idx.numel():
        return None                                   # two runs of keys: not one interval
    return Rows(torch.tensor([lo]), torch.tensor([hi]))


def _compare(name: str, x: Any, y: Any, S: int) -> Rows | None:
    """cmp(x, y) with one operand varying along the keys ([..., 1, S], sorted) and the other
    along the rows ([..., L, 1]) or constant."""
    if isinstance(x, Rows) or isinstance(y, Rows):
        return None
    x, y = (torch.as_tensor(v) for v in (x, y))
    if x.dim() >= 1 and x.shape[-1] == S and S > 1:
        keys, rows = x, y
    elif y.dim() >= 1 and y.shape[-1] == S and S > 1:
        keys, rows, name = y, x, _MIRROR[name]
    else:
        return None
    if keys.dim() < 2 or keys.shape[-2] != 1 or (rows.dim() >= 1 and rows.shape[-1] != 1):
        return None
    if keys.is_floating_point() or keys.is_complex() or rows.is_floating_point() or \
            rows.is_complex():
        return None
    a = keys[..., 0, :]                                   # [..., S]
    b = rows[..., 0] if rows.dim() >= 1 else rows.reshape(1)   # [..., L]
    lead = torch.broadcast_shapes(a.shape[:-1], b.shape[:-1])
    a = a.expand(lead + a.shape[-1:]).contiguous()
    b = b.expand(lead + b.shape[-1:]).contiguous()
    if not bool((a[..., 1:] >= a[..., :-1]).all()):
        return None                                       # not sorted along the keys
    left = torch.searchsorted(a, b, right=False)
    right = torch.searchsorted(a, b, right=True)
    zero, end = torch.zeros_like(left), torch.full_like(left, S)
    lo, hi = {"le": (zero, right),               # keys a_j <= b_i: a prefix
              "lt": (zero, left),
              "ge": (left, end),                  # a_j >= b_i: a suffix
              "gt": (right, end),
              "eq": (left, right)}[name]
    return Rows(lo, hi)


def rows_verdict(r: Rows, lead: tuple, L: int, S: int) -> str:
    """fuse_attention's verdict on a mask given as Rows, broadcast to [*lead, L, S]."""
    try:
        shape = torch.broadcast_shapes(tuple(r.lo.shape), tuple(lead) + (L,))
    except RuntimeError:
        return f"constant mask rows {list(r.lo.shape)} do not broadcast to [..., {L}]"
    if len(r.lo.shape) > len(lead) + 1:
        return f"constant mask rows {list(r.lo.shape)} do not broadcast to [..., {L}]"
    lo, hi = r.lo.expand(shape), r.hi.expand(shape)
    empty = hi <= lo
    lo, hi = torch.where(empty, 0, lo), torch.where(empty, 0, hi)
    if bool((lo == 0).all() and (hi == S).all()):
        return "full"
    i = torch.arange(L)
    causal_hi = torch.clamp(i + 1, max=S)
    if bool((lo == 0).all() and (hi == causal_hi).all()):
        return "causal"
    window = int((hi[..., -1] - lo[..., -1]).max())
    if L == S and bool((hi == i + 1).all() and (lo == torch.clamp(i + 1 - window, min=0)).all()):
        return f"sliding window {window} < sequence {S}"
    return "constant mask that is not causal"


__all__ = ["Rows", "mask_rows", "rows_verdict", "SMALL"]
