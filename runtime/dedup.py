"""Deduped checkpoints: every distinct shard stored once across the job.

Ranks of different data-parallel units hold identical shards, and inside a unit a replicated
tensor is identical on every rank. So only the first unit stores anything, and in it a
replicated tensor is stored by plan rank 0 alone (state.is_owner):

    before (sharded, plan 2 x dp 2): every rank stores its shards         4 copies of "R" weights
    after  (deduped):                rank 0: its shards + replicated;  rank 1: its shards;
                                     ranks 2, 3: plan metadata only      1 copy of everything

Loading broadcasts each tensor from the rank that stored it to the ranks that hold the same
shard (the data-parallel group for a sharded tensor, the world for a replicated one).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from nncompile.ir.placement import Placement, Shard

from .rows import param_rows, state_rows
from .state import (check_same_plan, is_owner, load_local_optimizer_state,
                    local_optimizer_state, owner_rank, plan_info)


def deduped_state_dict(pm, optimizer=None) -> tuple[dict, dict | None]:
    """(model state dict, optimizer state dict) of this rank holding only what it owns. Every
    rank calls it (ZeRO state is gathered over its group first)."""
    return deduped_model_state(pm), \
        deduped_optimizer_state(pm, optimizer) if optimizer is not None else None


def deduped_model_state(pm) -> dict:
    full = pm.state_dict()
    owned = {row.name for row in state_rows(pm) if is_owner(pm, row.placement)}
    return {k: v for k, v in full.items() if k in owned or k == "_extra_state"}


def deduped_optimizer_state(pm, optimizer) -> dict:
    local = local_optimizer_state(pm, optimizer)
    placement = {row.name: row.placement for row in param_rows(pm)}
    local["state"] = {n: st for n, st in local["state"].items()
                      if is_owner(pm, placement[n])}
    return {**local, "nncompile": plan_info(pm)}


def _group(pm, placement: Placement):
    """The ranks holding the same copy, and whether any other rank does."""
    if isinstance(placement, Shard):
        return pm.dp_group, pm.dp_group is not None
    return dist.group.WORLD, dist.is_initialized() and dist.get_world_size() > 1


def load_deduped_state_dict(pm, model_sd: dict, optimizer=None,
                            optimizer_sd: dict | None = None) -> None:
    """Load this rank's deduped state dicts; what it did not store arrives from its owner."""
    load_deduped_model_state(pm, model_sd)
    if optimizer is not None:
        load_deduped_optimizer_state(pm, optimizer, optimizer_sd)


def load_deduped_model_state(pm, model_sd: dict) -> None:
    check_same_plan(model_sd.get("_extra_state", {}), pm, "the deduped state dict")
    local, dtypes = {}, _local_dtypes(pm)
    for row in state_rows(pm):
        if is_owner(pm, row.placement):
            t = model_sd[row.name].to(pm.device, dtypes[row.name]).contiguous().clone()
        else:
            t = torch.empty(row.local_shape, dtype=dtypes[row.name], device=pm.device)
        group, shared = _group(pm, row.placement)
        if shared:
            dist.broadcast(t, src=owner_rank(pm, row.placement), group=group)
        local[row.name] = t
    pm.load_local_tensors(local)


def _local_dtypes(pm) -> dict[str, torch.dtype]:
    """Each parameter's and buffer's dtype by local name (ZeRO-3: its flat piece's)."""
    out = {n: t.dtype for n, t in [*pm.named_parameters(), *pm.named_buffers()]}
    for unit in pm.zero.units if pm.zero is not None else []:
        out.update(dict.fromkeys(unit.layout.names, out[unit.attr]))
    return out


def load_deduped_optimizer_state(pm, optimizer, optimizer_sd: dict | None) -> None:
    mine = (optimizer_sd or {}).get("state", {})
    skeletons: list[Any] = [None] * (dist.get_world_size() if dist.is_initialized() else 1)
    skeleton = {n: {k: ("tensor", tuple(v.shape), v.dtype) if torch.is_tensor(v) else ("value", v)
                    for k, v in st.items()} for n, st in mine.items()}
    if dist.is_initialized():
        dist.all_gather_object(skeletons, skeleton)
    else:
        skeletons = [skeleton]
    state: dict[str, dict[str, Any]] = {}
    for row in param_rows(pm):
        name, src = row.name, owner_rank(pm, row.placement)
        for key, (kind, *spec) in sorted(skeletons[src].get(name, {}).items()):
            if kind == "value":
                value = spec[0]
            else:
                value = mine[name][key].to(pm.device) if name in mine else \
                    torch.empty(spec[0], dtype=spec[1], device=pm.device)
                group, shared = _group(pm, row.placement)
                if shared:
                    dist.broadcast(value, src=src, group=group)
            state.setdefault(name, {})[key] = value
    groups = (optimizer_sd or {}).get("param_groups", [])
    if dist.is_initialized():
        box = [groups]
        dist.broadcast_object_list(box, src=0)
        groups = box[0]
    load_local_optimizer_state(pm, optimizer, {"state": state, "param_groups": groups})
