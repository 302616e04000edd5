"""copy.deepcopy(pm): an independent ParallelModule on the same process groups.

`torch.optim.swa_utils.AveragedModel(pm)` and hand-written EMA code deep-copy the model, as
they do a DDP module. A copy of pm gets its own parameters and buffers (new storage, the same
values) and its own gradient reducer, and shares what belongs to the job: the process groups,
the module it was built from, the generated program. It runs forward (and trains) like pm:

    before: AveragedModel(pm)   -> TypeError: cannot pickle 'ProcessGroup' object
    after:  swa = AveragedModel(pm); swa.update_parameters(pm); swa(**batch)   # one device's

Every rank copies (the copy's forward runs the plan's collectives). Not yet for ZeRO-3 (its
parameters are handles over flat pieces) nor pipelines (their schedule holds the stages):
there a ConfigError says what to do instead.
"""
from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist

from nncompile.errors import ConfigError

# per-instance caches that name the original's tensors by id(): rebuilt by the copy on use
_NOT_COPIED = {"_reducer", "_nnc_names", "_nnc_orig_ids", "forward_impl", "forward_eval_impl",
               "_nnc_views"}          # the module's views show the original pm's pieces


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
    if pm.zero is not None:
        raise ConfigError(
            "copy.deepcopy of a ZeRO-3 ParallelModule (AveragedModel, an EMA copy) is not "
            "supported: its parameters are handles over flat pieces of layers; keep the "
            "average of pm.named_parameters() in tensors of your own (p.detach().clone() of "
            "pm.gather_params() values), or train with use_zero 0, 1 or 2")
    if pm.pipeline is not None:
        raise ConfigError(
            "copy.deepcopy of a pipelined ParallelModule is not supported: its schedule holds "
            "this rank's stages; build a second pm with nncompile.parallelize for the copy")
    found: dict[int, Any] = {}
    _job_objects(pm.__dict__, found, set())
    memo.update(found)                          # shared, never pickled
    original = pm.__dict__.get("_original_module")
    if original is not None:
        memo[id(original)] = original          # the module it was built from: shared
    new = type(pm).__new__(type(pm))
    memo[id(pm)] = new
    for key, value in pm.__dict__.items():
        if key not in _NOT_COPIED:
            new.__dict__[key] = copy.deepcopy(value, memo)
    new._reducer = new._build_reducer()
    options = pm.__dict__.get("compile_options")
    if options is not None:
        new.compile(**options)
    return new


__all__ = ["deepcopy_parallel_module"]
