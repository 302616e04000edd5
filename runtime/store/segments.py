"""ZeRO-3's per-parameter segments, and the local name of any tensor the user hands pm.

Under ZeRO-3 a rank stores flat 1-D pieces of whole layers (zero.py). A *segment* is, per
parameter, the contiguous run of this rank's flat piece that holds its elements (possibly
empty): a Parameter viewing the flat storage whose `.grad` is a view of the flat gradient.
Optimizers step segments, each in the group its parameter was put in:

    before: AdamW([flat piece of h.0])                  one group, hyper-parameters lost
    after:  AdamW([{"params": [h0_attn_q_proj_weight's run, ...], "weight_decay": 0.1},
                   {"params": [h0_ln_1_bias's run, ...], "weight_decay": 0.0}])
"""
from __future__ import annotations

import weakref
from typing import Iterable

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .user_hooks import ours


def zero_stage(pm) -> str | None:
    """'ZeRO-3' etc. when pm's optimizer steps pieces of tensors, else None."""
    memory = pm.memory
    if memory.zero:
        return f"ZeRO-{memory.zero}" + (" with offload_optimizer" if memory.offload_optimizer
                                        else "")
    return "offload_optimizer" if memory.offload_optimizer else None


def cut(layout, piece: torch.Tensor) -> list[tuple[int, int, int, int]]:
    """Per tensor of `layout`: (start, stop) in the piece, (start, stop) in the tensor."""
    return [(at, at + e - s, s, e) for at, s, e in layout.runs()]


def segment_params(piece: torch.Tensor, layout, requires_grad: bool = True) -> list:
    """A Parameter per tensor of `layout` viewing its run of `piece`."""
    segs = []
    for i, (a, b, s, e) in enumerate(cut(layout, piece)):
        seg = torch.nn.Parameter(piece.detach()[a:b], requires_grad=requires_grad)
        seg._nnc_span = (layout.names[i], s, e, layout.numels[i])
        segs.append(seg)
    return segs


def zero3_segments(pm) -> dict[str, torch.nn.Parameter]:
    """{local name: segment} of pm's ZeRO-3 flat pieces (made once; their .grad follows the
    flat gradient after every backward)."""
    segs = pm.__dict__.get("_nnc_segments")
    if segs is not None:
        return segs
    segs = {}
    for unit in pm.zero.units:
        flat = pm.zero.flat(unit)
        parts = segment_params(flat, unit.layout, unit.trainable)
        for seg, (a, b, _, _) in zip(parts, cut(unit.layout, flat)):
            seg._nnc_flat = (flat, a, b)
            seg._nnc_pm = weakref.ref(pm)
            segs[seg._nnc_span[0]] = seg
        if unit.trainable:
            flat.register_hook(lambda g, parts=parts: follow_cleared(parts))
            flat.register_post_accumulate_grad_hook(      # ours: never deferred to the end
                ours(lambda f, parts=parts: refresh_grads(parts)))   # of a pipeline's schedule
    pm.__dict__["_nnc_segments"] = segs
    return segs


_LINKED = WeakIdKeyDictionary()    # segment -> the flat gradient its .grad was set to view


def _unlinked() -> None:
    return None


def follow_cleared(segs: list) -> None:
    """Before a gradient accumulates into a unit's flat gradient: the runs whose segment's
    `.grad` was cleared since (an optimizer's `zero_grad()` over segments) are cleared in the
    flat gradient too, so the new gradient does not add to the old one (all cleared: the flat
    gradient is dropped, as torch's zero_grad drops a parameter's)."""
    runs = [(seg, seg._nnc_flat) for seg in segs if getattr(seg, "_nnc_flat", None) is not None]
    if not runs or runs[0][1][0].grad is None:
        return
    flat = runs[0][1][0]
    cleared = [(a, b) for seg, (_, a, b) in runs      # a .grad refresh_grads set, gone since
               if seg.grad is None and _LINKED.get(seg, _unlinked)() is flat.grad]
    for seg, _ in runs:
        if seg.grad is None:
            _LINKED.pop(seg, None)
    if cleared and len(cleared) == len(runs):
        flat.grad = None
        return
    with torch.no_grad():
        for a, b in cleared:
            flat.grad[a:b].zero_()


def refresh_grads(segs: Iterable) -> None:
    """Point each ZeRO-3 segment's .grad at its run of the flat gradient (None without). A
    parameter frozen after parallelize (`p.requires_grad_(False)` on its handle) gets none, as
    on one device: its run of the flat gradient is zeroed (a clipping norm does not count it)
    and its segment's .grad is None (no optimizer steps or decays it)."""
    for seg in segs:
        info = getattr(seg, "_nnc_flat", None)
        if info is None:
            continue
        flat, a, b = info
        g = flat.grad
        pm = seg._nnc_pm()
        handle = pm._parameters.get(seg._nnc_span[0]) if pm is not None else None
        if g is not None and handle is not None and not handle.requires_grad:
            g.detach()[a:b].zero_()
            seg.grad = None
        elif g is None:
            seg.grad = None
        elif seg.grad is None or seg.grad.data_ptr() != g[a:b].data_ptr() or \
                seg.grad.numel() != b - a:
            seg.grad = g.detach()[a:b]
        if seg.grad is not None:
            _LINKED[seg] = weakref.ref(g)


def local_name(pm, p) -> str | tuple[str, ...] | None:
    """The local name of a tensor the user hands an optimizer for pm: pm's own parameter, a
    ZeRO-3 handle or segment, or a parameter of the module pm was built from (a tuple of
    names for an original parameter pm holds as several parts; see local_names)."""
    handle = getattr(p, "_nnc_handle", None) or getattr(p, "_nnc_origin", None)
    if handle is not None:
        return handle[1] if handle[0]() is pm else None
    span = getattr(p, "_nnc_span", None)
    if span is not None and any(s is p for s in pm.__dict__.get("_nnc_segments", {}).values()):
        return span[0]
    names = pm.__dict__.get("_nnc_names")
    if names is None:
        from .pieces import local_named_parameters, local_parameters
        names = {id(q): n for n, q in local_named_parameters(pm)}
        names.update({id(q): n for n, q in local_parameters(pm)})
        names.update(pm.__dict__.get("_nnc_orig_ids", {}))
        pm.__dict__["_nnc_names"] = names
    return names.get(id(p))


def local_names(pm, p) -> list[str]:
    """local_name as a list: [] for a tensor that is not pm's, one name per part of an
    original parameter pm holds as several parts (nncompile/rows.py)."""
    name = local_name(pm, p)
    if name is None:
        return []
    return list(name) if isinstance(name, tuple) else [name]


def segment_layout(params: list, ranks: list[int], zero_rank: int, stage: int) -> dict:
    """How segments (in optimizer index order) cut the local parameters: the form
    merge.py reads under "nncompile_zero" (one entry per segment), with the ZeRO stage."""
    shards = []
    for p in params:
        name, s, e, numel = p._nnc_span
        shards.append({"names": [name], "numels": [numel], "lo": s, "hi": e})
    return {"zero_rank": zero_rank, "zero_size": len(ranks), "ranks": list(ranks),
            "stage": stage, "shards": shards}
