"""copy.deepcopy(pm): an independent ParallelModule on the same process groups.

`torch.optim.swa_utils.AveragedModel(pm)` and hand-written EMA code deep-copy the model, as
they do a DDP module. A copy of pm gets its own parameters and buffers (new storage, the same
values) and its own gradient reducer, and shares what belongs to the job: the process groups,
the module it was built from, the generated program. It runs forward (and trains) like pm:

    before: AveragedModel(pm)   -> TypeError: cannot pickle 'ProcessGroup' object
    after:  swa = AveragedModel(pm); swa.update_parameters(pm); swa(**batch)   # one device's

Every rank copies (the copy's forward runs the plan's collectives). Under ZeRO-3 the copy gets
its own flat pieces (this rank's rows, cloned) and its own handles over them, with pm's ZeRO
group and layouts: `swa.update_parameters(pm)` edits the copy's runs with pm's. Where pm's
parameters are DTensor views, the copy's are views of its own pieces; a pipelined pm's copy
gets its own schedule over its own stages, on pm's pipeline groups.
"""
from __future__ import annotations

import copy
import dataclasses
from collections import OrderedDict
from typing import Any

import torch
import torch.distributed as dist

from nncompile.errors import ConfigError

from ..protocol.lockstep import register_copy
from ..store.pieces import pieces_of

# per-instance caches that name the original's tensors by id(): rebuilt by the copy on use
_NOT_COPIED = {"_reducer", "_nnc_names", "_nnc_orig_ids", "forward_impl", "forward_eval_impl",
               "_nnc_views",          # the module's views show the original pm's pieces
               "_nnc_segments"}       # ZeRO-3: views of the original's flat pieces


def _job_objects(obj: Any, found: dict[int, Any], seen: set[int]) -> None:
    """Collect the process groups reachable from `obj` (containers and object attributes)."""
    if id(obj) in seen or isinstance(obj, (torch.Tensor, str, bytes, int, float, type)):
        return
    seen.add(id(obj))
    if isinstance(obj, dist.ProcessGroup):
        found[id(obj)] = obj
        return
    if isinstance(obj, dict):
        items = list(obj.values())
    elif isinstance(obj, (list, tuple, set, frozenset)):
        items = list(obj)
    elif isinstance(obj, torch.nn.Module):
        return                  # submodules are copied; their groups are reached from pm's
    else:
        items = list(getattr(obj, "__dict__", {}).values())
    for item in items:
        _job_objects(item, found, seen)


def deepcopy_parallel_module(pm, memo: dict) -> Any:
    """What `copy.deepcopy(pm)` returns (ParallelModule.__deepcopy__)."""
    found: dict[int, Any] = {}
    _job_objects(pm.__dict__, found, set())
    memo.update(found)                          # shared, never pickled
    original = pm.__dict__.get("_original_module")
    if original is not None:
        memo[id(original)] = original          # the module it was built from: shared
    for key in ("_out_spec", "_eval_out_spec"):   # pytree specs: immutable, shared
        spec = pm.__dict__.get(key)
        if spec is not None:
            memo[id(spec)] = spec
    new = type(pm).__new__(type(pm))
    memo[id(pm)] = new
    skip = set(_NOT_COPIED) | {"pipeline"}     # the copy's schedule runs its own stages
    if pm.zero is not None:        # made below: the flat pieces, their handles, the runtime
        skip |= {"zero", "_parameters"} | {unit.attr for unit in pm.zero.units}
    pieces = pieces_of(pm)
    if pieces:                     # made below: DTensor views over the copy's own pieces
        skip |= {"_parameters", "_nnc_pieces"}
    for key, value in pm.__dict__.items():
        if key not in skip:
            new.__dict__[key] = copy.deepcopy(value, memo)
    if pm.zero is not None:
        _copy_zero3(pm, new, memo)
    if pieces:
        new.__dict__["_parameters"] = OrderedDict(
            (n, new.__dict__.pop(n) if n in pieces else copy.deepcopy(p, memo))
            for n, p in pm._parameters.items())
        for n, p in new._parameters.items():
            p.requires_grad_(pm._parameters[n].requires_grad)    # the flag the user set
    new._reducer = new._build_reducer()
    if pm.zero is not None:
        from ..store.zero3_views import view_pm_params
        view_pm_params(new)         # as pm's: DTensors over the copy's flat pieces
    if pieces:
        from ..store.module_views import view_pieces
        view_pieces(new, {n: n for n in pieces})
    new.pipeline = None
    if pm.pipeline is not None:
        from .pipeline import PipelineRuntime
        new.pipeline = PipelineRuntime(new)
    new.order_as_model()
    register_copy(new)                          # its own number in the lockstep exchange
    options = pm.__dict__.get("compile_options")
    if options is not None:
        new.compile(**options)
    return new


def _copy_zero3(pm, new, memo: dict) -> None:
    """The copy's ZeRO-3 runtime: pm's group and layouts, its own units' state, flat pieces
    (clones of this rank's) and handles over them (frozen where pm's are)."""
    from ..store.zero3_handles import make_handles
    zero = copy.copy(pm.zero)
    zero.pm = new
    zero.units = [dataclasses.replace(u, pending=None, again=None, live={})
                  for u in pm.zero.units]
    zero.by_attr = {u.attr: u for u in zero.units}
    zero._by_storage, zero._backward_queued = {}, False
    new.__dict__["zero"] = zero
    for unit in pm.zero.units:
        old = pm.zero.flat(unit)
        flat = torch.nn.Parameter(old.detach().clone(), requires_grad=old.requires_grad)
        flat._zero_attr = unit.attr
        new.__dict__[unit.attr] = flat
    new.__dict__["_parameters"] = OrderedDict()
    make_handles(new)
    made = new._parameters
    ordered = OrderedDict()
    for name, p in pm._parameters.items():            # pm's order: zip(swa, pm) pairs them
        if name in made:                              # a handle (or a view: made below)
            made[name].requires_grad_(p.requires_grad)
            ordered[name] = made[name]
        else:
            ordered[name] = copy.deepcopy(p, memo)
    new.__dict__["_parameters"] = ordered


__all__ = ["deepcopy_parallel_module"]
