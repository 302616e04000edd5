"""Deduped checkpoints: every distinct shard stored once across the job.

Ranks of different data-parallel units hold identical shards, and inside a unit a replicated
tensor is identical on every rank. So only the first unit stores anything, and in it a
replicated tensor is stored by plan rank 0 alone (state.owner_rank):

    before (sharded, plan 2 x dp 2): every rank stores its shards         4 copies of "R" weights
    after  (deduped):                rank 0: its shards + replicated;  rank 1: its shards;
                                     ranks 2, 3: plan metadata only      1 copy of everything

Under a pipeline each stage's ranks store their stages' tensors, and a tied weight (equal on
every stage holding it) is stored by the lowest pipeline rank holding it.

Loading broadcasts each tensor from the rank that stored it to the ranks of its stage that
hold the same shard (along "dp" for a sharded tensor, along "dp" and "plan" for a replicated
one), then a tied weight from its lowest stage to the others (the tie groups).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from nncompile.ir.placement import Shard
from nncompile.mesh import PP, replica_dims

from ..protocol.groups import group_along, tie_group
from ..store.pieces import local_named_buffers, local_named_parameters
from nncompile.rows import param_rows, state_rows
from .state import check_same_plan, load_local_optimizer_state, local_optimizer_state
from ..store.holders import (first_holder, holders, is_owner, mesh_of, owner_rank, plan_info,
                             split_axes, tied_pipes)


def deduped_state_dict(pm, optimizer=None) -> tuple[dict, dict | None]:
    """(model state dict, optimizer state dict) of this rank holding only what it owns. Every
    rank calls it (ZeRO state is gathered over its group first)."""
    return deduped_model_state(pm), \
        deduped_optimizer_state(pm, optimizer) if optimizer is not None else None


def deduped_model_state(pm) -> dict:
    full = pm.local_state_dict()
    owned = {row.name for row in state_rows(pm) if is_owner(pm, row)}
    return {k: v for k, v in full.items() if k in owned or k == "_extra_state"}


def deduped_optimizer_state(pm, optimizer) -> dict:
    local = local_optimizer_state(pm, optimizer)
    rows = {row.name: row for row in param_rows(pm)}
    local["state"] = {n: st for n, st in local["state"].items() if is_owner(pm, rows[n])}
    return {**local, "nncompile": plan_info(pm)}


def _groups(pm) -> dict:
    """{"shard": the ranks of this stage holding this rank's shards (along "dp" and "cp"),
    "stage": those holding its replicated tensors (every dim but "pp"), fqn: the tie group of a tied weight};
    a value is None where the group has one rank. Every rank calls it (creating groups is
    collective)."""
    if not dist.is_initialized():
        return {"shard": None, "stage": None}
    args = (pm.PLAN_NGPUS, pm.RUNTIME_NGPUS, pm.PIPE_RANKS, pm.mesh_axes)
    mesh = pm.mesh
    out = {"shard": group_along(replica_dims(mesh), *args),
           "stage": group_along(tuple(d for d in mesh.names if d != PP), *args)}
    for split in sorted({tuple(axes) for axes in pm.PARAM_AXES.values()}):  # expert weights
        out["shard", split] = group_along(replica_dims(mesh, split), *args)
        out["stage", split] = group_along(tuple(d for d in mesh.names
                                                if d != PP and d not in split), *args)
    if out["stage"] is dist.group.WORLD and dist.get_world_size() == 1:
        out["stage"] = None
    for fqn, pipes in tied_pipes(pm).items():
        out[fqn] = tie_group(tuple(pipes), *args)
    return out


def _spread(pm, groups: dict, rows: list, fill) -> None:
    """Broadcast each of `rows`' tensors from the rank that stored it: `fill(row, src)` gives
    the (owner's or empty) tensors of a row, a list filled in place. First inside each stage,
    then a tied weight from its lowest stage to the others."""
    for row in rows:
        if not first_holder(pm, row.fqn):
            continue
        kind = "shard" if isinstance(row.placement, Shard) else "stage"
        split = split_axes(pm, row)
        group = groups[(kind, split) if split else kind]
        src = owner_rank(pm, row)
        for t in fill(row, src):
            if group is not None:
                dist.broadcast(t, src=src, group=group)
    if pm.PIPE_RANKS == 1:
        return
    mesh = mesh_of(pm)
    for row in rows:
        if groups.get(row.fqn) is None:
            continue
        src = mesh.rank_of({**mesh.coords(pm.RANK), PP: holders(pm, row.fqn)[0]})
        for t in fill(row, owner_rank(pm, row)):
            dist.broadcast(t, src=src, group=groups[row.fqn])


def load_deduped_state_dict(pm, model_sd: dict, optimizer=None,
                            optimizer_sd: dict | None = None) -> None:
    """Load this rank's deduped state dicts; what it did not store arrives from its owner."""
    load_deduped_model_state(pm, model_sd)
    if optimizer is not None:
        load_deduped_optimizer_state(pm, optimizer, optimizer_sd)


def load_deduped_model_state(pm, model_sd: dict) -> None:
    check_same_plan(model_sd.get("_extra_state", {}), pm, "the deduped state dict")
    local, dtypes = {}, _local_dtypes(pm)

    def fill(row, src):
        if row.name not in local:
            local[row.name] = model_sd[row.name].to(pm.device, dtypes[row.name]).contiguous() \
                .clone() if src == pm.RANK else \
                torch.empty(row.local_shape, dtype=dtypes[row.name], device=pm.device)
        return [local[row.name]]
    _spread(pm, _groups(pm), state_rows(pm), fill)
    pm.load_local_tensors(local)


def _local_dtypes(pm) -> dict[str, torch.dtype]:
    """Each parameter's and buffer's dtype by local name (ZeRO-3: its handle's, the flat
    piece's)."""
    return {n: t.dtype for n, t in [*local_named_parameters(pm), *local_named_buffers(pm)]}


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

    def fill(row, src):
        if row.name not in state:
            state[row.name] = {}
            for key, (kind, *spec) in sorted(skeletons[src].get(row.name, {}).items()):
                state[row.name][key] = spec[0] if kind == "value" else \
                    mine[row.name][key].to(pm.device) if src == pm.RANK else \
                    torch.empty(spec[0], dtype=spec[1], device=pm.device)
        return [v for _, v in sorted(state[row.name].items()) if torch.is_tensor(v)]
    _spread(pm, _groups(pm), param_rows(pm), fill)
    state = {n: st for n, st in state.items() if st}
    groups = (optimizer_sd or {}).get("param_groups", [])
    if dist.is_initialized():
        box = [groups]
        dist.broadcast_object_list(box, src=0)
        groups = box[0]
    load_local_optimizer_state(pm, optimizer, {"state": state, "param_groups": groups})
