"""The original module's full state dict, and its optimizer's, from any one rank.

A DDP script checkpoints on rank 0 alone:

    if master_process:
        checkpoint = {'model': raw_model.state_dict(), 'optimizer': optimizer.state_dict(), ...}
        torch.save(checkpoint, path)

Under a plan that shards weights or optimizer state (tp, ZeRO-1/2/3) rank 0 holds only its
pieces, so those two calls become

        checkpoint = {'model': nncompile.full_state_dict(model),
                      'optimizer': nncompile.full_optimizer_state_dict(model, optimizer), ...}

which return what the single-device module and a torch optimizer over its parameters would
return (full tensors by the module's names; the optimizer's state by parameter index, in its
groups): the script's resume path, `model.load_state_dict(...)` before parallelize and
`optimizer.load_state_dict(...)` on the optimizer it built, loads them unchanged, under any
plan or none. Every rank of the group that holds the pieces may call them together, or one
rank alone while the others wait at their next forward (runtime/protocol/lockstep.py): they send it
their pieces there. Under ZeRO-1/2 the optimizer state is spread over the data-parallel
replicas, whose forwards exchange nothing, so every rank calls `full_optimizer_state_dict`
(as torch's `ZeroRedundancyOptimizer.consolidate_state_dict`); `full_state_dict` needs no
other rank there (each holds the whole model). The pieces travel as CPU objects to the calling rank, which merges them
(runtime/checkpoints/merge.py); the other ranks get None when one rank called alone.
"""
from __future__ import annotations


import torch
import torch.distributed as dist

from nncompile.errors import ConfigError

from ..protocol.lockstep import _group, _state_group, run_together, service


def _index(pm, optimizer) -> int:
    for i, ref in enumerate(pm.__dict__.get("_nnc_optimizers", ())):
        if ref() is optimizer:
            return i
    raise ConfigError("full_optimizer_state_dict needs the optimizer nncompile.build_optimizer("
                      "pm, ...) returned for this module (each rank finds its own by it); "
                      "build it with build_optimizer(pm, optimizer) after parallelize")


def full_state_dict(pm) -> dict[str, torch.Tensor] | None:
    """The original module's state dict with full tensors (every rank's pieces merged), as
    `module.state_dict()` on one device returns it; None on the ranks that only sent theirs."""
    out = run_together(pm, "full_state", None)
    return None if out is None else out[0]


def full_optimizer_state_dict(pm, optimizer, to: int | None = None) -> dict | None:
    """The optimizer's state dict as a torch optimizer over the original module's parameters
    (in this optimizer's groups) holds it, every rank's pieces merged; None on the ranks that
    only sent theirs. Called by every rank, `to` (a rank, e.g. 0) is the one that merges and
    gets it, as torch's `ZeroRedundancyOptimizer.consolidate_state_dict(to=0)`: the others
    send their pieces and get None, instead of each holding the whole state (a rank whose
    group does not hold `to`, another data-parallel unit under tp, gets its own copy)."""
    out = run_together(pm, "full_state", _index(pm, optimizer), whole_state=True, to=to)
    return None if out is None else out[1]


def _cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cpu(v) for v in obj)
    return obj


@service("full_state")
def _full_state(pm, index: int | None, leader: int | None):
    """Each rank's (pm.local_state_dict(), optimizer.state_dict()) to `leader` (None: to
    all), then merged there."""
    optimizer = None
    if index is not None:
        optimizer = pm.__dict__["_nnc_optimizers"][index]()
    from .state import with_members  # (state imports the optimizer, which us)
    mine = (_cpu(pm.local_state_dict()), None if optimizer is None else
            _cpu(with_members(pm, optimizer, optimizer.state_dict())))
    group = _group(pm) if index is None else _state_group(pm)   # the model's pieces, or
    if group is None:                                           # the optimizer state's too
        states = [mine]
    elif leader is None:
        states = [None] * dist.get_world_size(group)
        dist.all_gather_object(states, mine, group=group)
    else:
        states = [None] * dist.get_world_size(group) if dist.get_rank() == leader else None
        dist.gather_object(mine, states, dst=leader, group=group)
        if states is None:
            return None
    from .merge import merge_state_dicts  # (merge imports the optimizer, which us)
    model, opt = merge_state_dicts([m for m, _ in states],
                                   None if index is None else [o for _, o in states])
    return model, opt
