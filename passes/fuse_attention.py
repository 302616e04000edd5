"""fuse_attention: attention runs on SDPA's fused forms, as the eager model does.

Traced, a Hugging Face causal LM hands `scaled_dot_product_attention` a causal mask it builds
as a compile-time constant, and a grouped-query model repeats k and v (`repeat_kv`) into full
copies; eagerly it passes `is_causal=True` and no mask, and SDPA takes `enable_gqa=True`.

Before:                                              After:
    # ---- constants ----                                # ---- forward ----
    mask = aten.le.Tensor(cols, rows)  # b8[B,1,T,T]     a = aten.scaled_dot_product_attention
    # ---- forward ----                                      .default(q, k, v, scale=s,
    k1 = aten.unsqueeze.default(k, 2)  # [B,Hkv,1,T,D]       is_causal=True, enable_gqa=True)
    k2 = aten.expand.default(k1, [B, Hkv, r, T, D])
    k3 = aten.reshape.default(k2, [B, Hkv * r, T, D])
    (v3 likewise)
    a = aten.scaled_dot_product_attention.default(
        q, k3, v3, mask, scale=s)

- A mask whose value is fixed at compile time (computed only from literals by ops that do not
  draw random numbers, not from an input, parameter or buffer) is evaluated on CPU. If it
  equals the causal mask `tril(ones(L, S))` (bool: True attends; float: 0 attends, -inf or
  finfo.min blocks) on every batch and head, the op gets `is_causal=True` and no mask; a mask
  that attends everywhere is dropped. A causal + sliding-window mask whose window covers the
  sequence is the causal mask; a narrower window, a padding mask (from an input) and any other
  mask stay.
- `unsqueeze(x, 2) -> expand([B, Hkv, r, T, D]) -> reshape([B, Hkv * r, T, D])` feeding k and v
  (only SDPA reads the copies) is folded into `enable_gqa=True` with the un-repeated x, where
  this PyTorch's SDPA takes `enable_gqa` and Hkv divides by the plan size (so tp still splits
  heads; with fewer k/v heads than ranks the repeated copies are what splits).
- Every other argument (dropout_p, scale) is kept; the mask's now-unused constant ops go (dce).
- Each SDPA op records what it runs in `op.attrs["attention"]` ("causal (is_causal=True,
  constant mask dropped), GQA 4->2 heads (enable_gqa)", "masked: mask depends on input
  'attention_mask'"): plan.json's "attention", `nncompile show` and a comment in the
  generated code above the call.

Precondition: none (runs after constant_fold and dce, before the plan). Idempotent: yes.
"""
from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree

from nncompile.custom_ops import is_custom_op
from nncompile.ir import PARAM, USER_INPUT, Graph, Op, Value
from nncompile.ir.interpret import run_ops
from nncompile.ir.printer import DEVICE, Symbol
from nncompile.modes import resolve
from nncompile.symbolic import Sym

from .constant_fold import _RANDOM
from .contract import contract
from .dce import dce
from .mask_intervals import Rows, mask_rows, rows_verdict

SDPA = torch.ops.aten.scaled_dot_product_attention.default
_NAMES = [a.name for a in SDPA._schema.arguments]     # query, key, value, attn_mask, ...
_POSITIONAL = [a.name for a in SDPA._schema.arguments if not a.kwarg_only]
GQA_SUPPORTED = "enable_gqa" in _NAMES                  # SDPA folds grouped k/v itself
_RESHAPES = {"reshape", "view", "_unsafe_view"}
_MAX_MASK_ELEMENTS = 1 << 30                            # evaluated on CPU at compile time
ATTENTION = "attention"                                 # the op.attrs key of the record


@contract()
def fuse_attention(graph: Graph, plan_ngpus: int = 1) -> Graph:
    """The pass; `plan_ngpus`: k/v heads that do not divide by it keep their repeat_kv copies
    (FuseAttention: the pipeline's form, which knows the plan size)."""
    if not any(op.target is SDPA for op in graph.ops):
        return graph
    g = graph.clone()
    users = g.users()
    outputs = {id(v) for v in g.outputs if isinstance(v, Value)}
    evaluated: dict[int, Any] = {}
    changed = False
    for op in g.ops:
        if op.target is not SDPA:
            continue
        kw = _bind(op)
        q, k, v = kw["query"], kw["key"], kw["value"]
        notes, mask = [], kw.get("attn_mask")
        if isinstance(mask, Value):
            verdict = _mask_verdict(g, mask, q, k, evaluated)
            if verdict in ("causal", "full") and not kw.get("is_causal"):
                del kw["attn_mask"]
                if verdict == "causal":
                    kw["is_causal"] = True
                    notes.append("causal (is_causal=True, constant mask dropped)")
                else:
                    notes.append("full (constant all-attending mask dropped)")
            else:
                notes.append(f"masked: {verdict}" if verdict not in ("causal", "full")
                             else "causal (is_causal=True) and a constant mask")
        elif kw.get("is_causal"):
            notes.append("causal (is_causal=True)")
        else:
            notes.append("full (no mask)")
        folded = [_repeat_kv_source(t, users, outputs) for t in (k, v)]
        if all(folded) and folded[0][1] == folded[1][1] and q.meta.shape[-3] == k.meta.shape[-3]:
            kv_heads = folded[0][0].meta.shape[-3]
            if not GQA_SUPPORTED:
                notes.append(f"GQA {q.meta.shape[-3]}->{kv_heads} heads kept repeated "
                             "(this PyTorch's SDPA has no enable_gqa)")
            elif kv_heads % plan_ngpus:
                notes.append(f"GQA {q.meta.shape[-3]}->{kv_heads} heads kept repeated: "
                             f"{kv_heads} k/v heads do not split over plan_ngpus={plan_ngpus}")
            else:
                kw["key"], kw["value"] = folded[0][0], folded[1][0]
                if folded[0][1] > 1:
                    kw["enable_gqa"] = True
        if kw.get("enable_gqa") and kw["key"].meta.shape[-3] != q.meta.shape[-3]:
            notes.append(f"GQA {q.meta.shape[-3]}->{kw['key'].meta.shape[-3]} heads "
                         "(enable_gqa)")
        p = resolve(kw.get("dropout_p"))            # a mode argument: its training value
        if isinstance(p, (int, float)) and p:
            notes.append(f"dropout_p {p:g}" + (" in training" if isinstance(
                kw.get("dropout_p"), Symbol) else ""))
        if kw != _bind(op):             # a mask dropped or k/v folded: the call is rewritten
            op.args, op.kwargs = _unbind(kw)
            changed = True
            op.attrs[ATTENTION] = ", ".join(notes)
        else:                           # unchanged: a record from an earlier run stands
            op.attrs.setdefault(ATTENTION, ", ".join(notes))
    return dce(g) if changed else g


class FuseAttention:
    """fuse_attention for a plan of `plan_ngpus` ranks: under tp the heads split, so k/v
    heads that do not divide by it keep repeat_kv's copies (their heads do divide)."""
    name = "fuse_attention"
    requires = produces = ()

    def __init__(self, plan_ngpus: int = 1):
        self.plan_ngpus = plan_ngpus

    def __call__(self, graph: Graph) -> Graph:
        return fuse_attention(graph, self.plan_ngpus)


def attention_rows(graph: Graph) -> list[dict[str, str]]:
    """What attention each SDPA op runs (module path, op name, form), in program order."""
    return [{"module": op.module_path, "op": op.name, "form": op.attrs[ATTENTION]}
            for op in graph.ops if ATTENTION in op.attrs]


def _bind(op: Op) -> dict[str, Any]:
    """SDPA's arguments by name (those the call gives)."""
    kw = dict(zip(_POSITIONAL, op.args))
    kw.update(op.kwargs)
    return kw


def _unbind(kw: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """q, k, v positional; the rest by name, in schema order (a dropped mask is not passed)."""
    args = (kw["query"], kw["key"], kw["value"])
    rest = {n: kw[n] for n in _NAMES[3:] if n in kw and not (n == "attn_mask" and kw[n] is None)}
    return args, rest


# ---- the mask ---------------------------------------------------------------------------
def _mask_verdict(g: Graph, mask: Value, q: Value, k: Value, evaluated: dict[int, Any]) -> str:
    """'causal', 'full' (attends everywhere), or why the mask stays. The mask is evaluated once
    (a value many layers share), as key intervals per row where it is large
    (mask_intervals.py), and each verdict is kept per shape."""
    L, S = q.meta.shape[-2], k.meta.shape[-2]
    key = (id(mask), tuple(q.meta.shape[:-2]), L, S)
    if key not in evaluated:
        if id(mask) not in evaluated:
            evaluated[id(mask)] = _evaluate(g, mask)
        evaluated[key] = _verdict_of(evaluated[id(mask)], q, L, S)
    return evaluated[key]


def _verdict_of(t: Any, q: Value, L: int, S: int) -> str:
    if isinstance(t, str):
        return t
    if isinstance(t, Rows):
        return rows_verdict(t, tuple(q.meta.shape[:-2]), L, S)
    try:
        t = t.expand(torch.broadcast_shapes(t.shape, tuple(q.meta.shape[:-2]) + (L, S)))
    except RuntimeError:
        return f"constant mask {list(t.shape)} does not broadcast to [..., {L}, {S}]"
    if t.dtype == torch.bool:
        attend = t
    elif t.dtype.is_floating_point:
        attend = t == 0
        if not bool((attend | torch.isneginf(t) | (t == torch.finfo(t.dtype).min)).all()):
            return "constant additive mask with values other than 0 and -inf"
    else:
        return f"constant {t.dtype} mask"
    if bool(attend.all()):
        return "full"
    causal = torch.ones(L, S, dtype=torch.bool).tril()
    if bool((attend == causal).all()):
        return "causal"
    window = int(attend[..., -1, :].sum(-1).max())
    if L == S and bool((attend == (causal & torch.ones(L, S, dtype=torch.bool).triu(
            1 - window))).all()):
        return f"sliding window {window} < sequence {S}"
    return "constant mask that is not causal"


def _evaluate(g: Graph, mask: Value) -> Any:
    """The mask's value, computed on CPU by the ops it depends on; or why it cannot be."""
    need: set[int] = set()
    stack = [mask]
    while stack:
        v = stack.pop()
        op = v.producer
        if op is None:
            what = {USER_INPUT: "input", PARAM: "parameter"}.get(v.kind, "buffer")
            return f"mask depends on {what} {v.fqn or v.name!r}"
        if id(op) in need:
            continue
        if isinstance(op.target, str) or is_custom_op(op.target) or op.is_inplace \
                or getattr(op.target, "_opname", "") in _RANDOM \
                or torch.Tag.nondeterministic_seeded in getattr(op.target, "tags", ()):
            return f"mask is computed by {op.target_name} at run time"
        for x in pytree.tree_leaves((op.args, op.kwargs)):
            if isinstance(x, Sym) or (isinstance(x, Symbol) and x != DEVICE):
                return f"mask depends on {x} at run time"
        need.add(id(op))
        stack.extend(op.inputs())
    rows = mask_rows(g, mask, need)
    if rows is not None:
        return rows
    if mask.meta is not None and mask.meta.numel > _MAX_MASK_ELEMENTS:
        return f"constant mask of {mask.meta.numel:,} elements (not evaluated)"
    env: dict[int, Any] = {}
    try:
        with torch.no_grad():
            run_ops([op for op in g.const_ops + g.ops if id(op) in need], env)
    except Exception as e:                # e.g. an op without a CPU kernel: the mask stays
        return f"constant mask not evaluated at compile time ({type(e).__name__})"
    t = env[id(mask)]
    return t if isinstance(t, torch.Tensor) else "mask is not a tensor"


# ---- repeat_kv --------------------------------------------------------------------------
def _repeat_kv_source(t: Value, users: dict, outputs: set[int]) -> tuple[Value, int] | None:
    """(x, r) when t = reshape(expand(unsqueeze(x, 2), [B, H, r, T, D]), [B, H * r, T, D])
    and only SDPA ops read t as key or value."""
    chain = []
    for name in ("reshape", "expand", "unsqueeze"):
        op = (chain[-1].args[0] if chain else t).producer
        if op is None or (getattr(op.target, "_opname", None) not in
                          (_RESHAPES if name == "reshape" else {name})):
            return None
        chain.append(op)
    x = chain[-1].args[0]
    if not isinstance(x, Value) or x.meta is None or len(x.meta.shape) != 4:
        return None
    dim = chain[-1].args[1] if len(chain[-1].args) > 1 else chain[-1].kwargs.get("dim")
    if not isinstance(dim, int) or dim % 5 != 2:
        return None
    B, H, T, D = x.meta.shape
    e = chain[1].outputs[0]
    if len(e.meta.shape) != 5 or e.meta.shape[:2] != (B, H) or e.meta.shape[3:] != (T, D):
        return None
    r = e.meta.shape[2]
    if tuple(t.meta.shape) != (B, H * r, T, D) or id(t) in outputs:
        return None
    for u in users.get(t, []):
        if u.target is not SDPA:
            return None
        kw = _bind(u)
        if any(val is t for n, val in kw.items() if n not in ("key", "value")):
            return None
    return x, r


__all__ = ["fuse_attention", "FuseAttention", "attention_rows", "GQA_SUPPORTED", "ATTENTION"]
