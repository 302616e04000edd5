"""A torch optimizer over pm's parameters steps what pm stores.

Grouping code (nanoGPT's `configure_optimizers`, Hugging Face's Trainer) builds
`torch.optim.AdamW(groups)` over `pm.parameters()` or over the module's parameters from
before `parallelize`. Where those are not what pm computes with (a released original, a
ZeRO-3 handle), the optimizer *adopts* pm's tensors before its first step, and again after
parameters are added (torch's global step pre-hook): each is swapped for pm's shard or ZeRO-3
segment (segments.py), any state moved with it; the checkpoint formats adopt first too.
Optimizers that are not element-wise are refused there: they would see pieces
(elementwise.py).

    before: torch.optim.AdamW(model.parameters())   built before parallelize: steps released
                                                    tensors pm never reads
    after:  its first step swaps them for pm's (the state, if resumed, cut to match)
"""
from __future__ import annotations

import threading
import warnings

import torch

from nncompile.errors import ConfigError
from .elementwise import check_elementwise, check_pieces
from ..store.pieces import _LIVE
from ..store.segments import local_names, refresh_grads, segment_layout, zero3_segments, zero_stage


def warn_unsharded(opt) -> None:
    """A plain torch optimizer over the parameters of a pm whose ComputeConfig asks the
    optimizer to shard or offload (ZeRO-1/2, offload_optimizer) steps whole tensors on the
    device: right numbers, none of the memory saved. Say so once, naming the fix."""
    if opt.__dict__.get("_nnc_warned"):        # set by ZeroOptimizer, which does shard
        return
    owner = {id(q): pm for pm in list(_LIVE)
             if pm.memory.zero in (1, 2) or pm.memory.offload_optimizer for q in pm.parameters()}
    for g in opt.param_groups:
        for p in g["params"]:
            pm = owner.get(id(p))
            if pm is None:
                continue
            opt.__dict__["_nnc_warned"] = True
            warnings.warn(
                f"this {type(opt).__name__} steps pm's whole parameters on every rank, so "
                f"{zero_stage(pm)} (ComputeConfig) saves no memory for it: the state is "
                "neither sharded nor offloaded. Build it with "
                "nncompile.build_optimizer(pm, optimizer), which keeps its groups, "
                "hyper-parameters and state", UserWarning, stacklevel=3)
            return


def split_groups(params) -> list[dict]:
    """What an optimizer's constructor accepts (tensors or group dicts) as group dicts."""
    if isinstance(params, torch.Tensor):
        params = [params]
    params = list(params)
    if not params:
        return []
    if isinstance(params[0], dict):
        out = []
        for g in params:
            ps = g["params"]
            out.append({**g, "params": [ps] if isinstance(ps, torch.Tensor) else list(ps)})
        return out
    return [{"params": params}]


def groups_by_name(pm, params) -> list[dict]:
    """Group dicts with local names instead of tensors (unknown tensors refused)."""
    out = []
    for g in split_groups(params):
        names = []
        for p in g["params"]:
            found = [p] if isinstance(p, str) else local_names(pm, p)
            if not found:
                shape = list(p.shape) if isinstance(p, torch.Tensor) else type(p).__name__
                raise ConfigError(
                    f"the optimizer was given a tensor {shape} that is not a parameter of "
                    f"this ParallelModule (nor of the module it was built from); pass "
                    f"pm.parameters() / pm.named_parameters() (or groups of them)")
            names += [n for n in found if n not in names]
        out.append({**g, "params": names})
    return out


_LOCK = threading.Lock()


def _targets(p, opt_cls) -> list[tuple[str, torch.Tensor]] | None:
    """What an optimizer steps instead of handle/original `p`, by local name (several for an
    original parameter pm holds as parts); None: keep p."""
    ref = getattr(p, "_nnc_handle", None) or getattr(p, "_nnc_origin", None)
    if ref is None:
        return None
    pm = ref[0]()
    if pm is None:
        raise ConfigError("the optimizer holds a parameter of a ParallelModule that no longer "
                          "exists; build the optimizer over the live module's parameters")
    if getattr(p, "_nnc_view", False):
        return None             # a DTensor over pm's piece: stepped as it is (global meaning)
    names = ref[1] if isinstance(ref[1], tuple) else (ref[1],)
    if pm.zero is not None:
        check_elementwise(opt_cls, "ZeRO-3")
        return [(n, zero3_segments(pm)[n]) for n in names]
    return [(n, getattr(pm, n)) for n in names]


def adopt(opt, groups: list[dict] | None = None) -> bool:
    """Swap handles and released originals in `opt`'s groups (or `groups`) for what pm steps,
    moving any state; returns whether any were swapped."""
    check_pieces(opt, opt.param_groups if groups is None else groups)
    swapped = False
    for g in (opt.param_groups if groups is None else groups):
        params = g["params"]
        if isinstance(params, torch.Tensor):
            params = g["params"] = [params]
        elif not isinstance(params, list):
            params = g["params"] = list(params)
        out = []
        for p in params:
            targets = _targets(p, type(opt)) if isinstance(p, torch.Tensor) else None
            if targets is None:
                out.append(p)
                if groups is None and (_zero3_view(p) or getattr(p, "_nnc_flat", None) is not None):
                    _watch(opt)          # its state_dict() records the runs' layout
                continue
            swapped = True
            st = opt.state.pop(p, None) if groups is None else None
            for name, new in targets:     # parts of one original parameter: each in its place
                out.append(new)
                if st:                    # a resumed optimizer's moments: cut to what pm steps
                    from .carry_state import adopted_state
                    opt.state[new] = adopted_state(p, new, st, name)
                if getattr(new, "_nnc_flat", None) is not None:
                    _watch(opt)
        params[:] = out
    return swapped


def watch_segments(opt) -> None:
    """An optimizer built over ZeRO-3 segments (build_optimizer's inner one): watched from
    the start."""
    if any(getattr(p, "_nnc_flat", None) is not None for g in opt.param_groups
           for p in g["params"]):
        _watch(opt)


def _watch(opt) -> None:
    """Once per optimizer stepping ZeRO-3 segments: its steps refresh the segments'
    gradients, and its state_dict records how the segments cut the parameters (a gradient it
    clears clears the run of the flat one: segments.follow_cleared)."""
    if opt.__dict__.get("_nnc_watched"):
        return
    opt.__dict__["_nnc_watched"] = True
    opt.register_state_dict_post_hook(_layout_hook)


def _zero3_view(p) -> bool:
    """Whether `p` is one of pm's ZeRO-3 DTensor parameters (runtime/store/zero3_views.py)."""
    tag = getattr(p, "_nnc_handle", None)
    pm = tag[0]() if tag is not None and getattr(p, "_nnc_view", False) else None
    return pm is not None and pm.zero is not None


def _layout_hook(opt, sd: dict) -> dict:
    """An optimizer over ZeRO-3 segments or DTensor parameters (whose local tensors are the
    same runs; their state stays torch's DTensors): the layout merge.py reads."""
    params = [p for g in opt.param_groups for p in g["params"]]
    if not params:
        return sd
    first = params[0]
    pm = first._nnc_pm() if getattr(first, "_nnc_flat", None) is not None else \
        first._nnc_handle[0]() if _zero3_view(first) else None
    if pm is None:
        return sd
    segs = zero3_segments(pm)
    runs = [p if getattr(p, "_nnc_flat", None) is not None else
            segs.get(p._nnc_handle[1]) if _zero3_view(p) else None for p in params]
    if any(r is None for r in runs):
        return sd
    sd["nncompile_zero"] = segment_layout(runs, pm.zero.ranks, pm.zero.rank, 3)
    return sd


def _pre_step(opt, args, kwargs) -> None:
    """Before every optimizer step: adopt what was added since, refresh segment grads."""
    groups = opt.param_groups
    count = sum(len(g["params"]) for g in groups)
    if opt.__dict__.get("_nnc_count") != count:
        with _LOCK:
            adopt(opt)
        opt.__dict__["_nnc_count"] = count
        warn_unsharded(opt)
    if opt.__dict__.get("_nnc_watched"):
        for g in groups:
            refresh_grads(g["params"])


_INSTALLED: list = []                # the hook's handle, once per process


def install() -> None:
    """Once per process: the step pre-hook (torch's own registry; nothing of torch replaced)."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook
    if not _INSTALLED:
        _INSTALLED.append(register_optimizer_step_pre_hook(_pre_step))


install()
