"""Resharding checkpoints through torch.distributed.checkpoint (DCP).

Each shard is described to DCP as a DTensor on a (data-parallel, plan) device mesh, keyed by the
original FQN, so DCP stores every distinct piece once and, on load, reads whatever pieces the
new plan's shards overlap:

    saved under tp, plan 2 x dp 1:   "model.h.0.mlp_fc.weight"  DTensor [128, 32], (R, S(0))
    loaded under dp, plan 1 x dp 4:  each rank reads the full [128, 32] from both pieces

Under a pipeline the mesh is (dp, pp, plan) and a rank describes only its stages' tensors,
replicated along "pp" (DCP stores one copy of what several ranks describe alike, e.g. a tied
weight held by two stages); the checkpoint holds the union, and any plan reads from it.

Optimizer state tensors shaped like their parameter are sharded the same way; other entries
(AdamW's step) are plain tensors. ZeRO state is gathered over its group before saving.

A parameter the plan holds as parts (nncompile/rows.py: nanoGPT's fused `c_attn.weight` as q, k,
v rows split by heads) is no box of the original, so no one DTensor describes it: its parts are
assembled over the plan unit (runtime/store/parts.py) and stored whole, replicated, under the
original FQN, so any plan reads it; a plan with parts reads it whole and takes its parts:

    saved under tp with parts:  "model.h.0.attn.c_attn.weight"  DTensor [96, 32], (R, R)

Reading never runs code from the checkpoint: DCP's reader unpickles `.metadata` with plain
pickle and its planner loads non-tensor items with torch.load(weights_only=False), so
nncompile reads through `SafeReader` (an unpickler that only builds DCP's own metadata
classes, torch dtypes/sizes and paths) and `SafeLoadPlanner` (weights_only=True). A truncated
or corrupted checkpoint is a CheckpointError.
"""
from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import StorageMeta, TensorStorageMetadata
from torch.distributed.tensor import DTensor

from nncompile.errors import CheckpointError

from ..store.parts import assemble_sources, sources_of
from nncompile.rows import buffer_rows, param_rows, state_rows, take
from .state import load_local_optimizer_state, local_optimizer_state
from ..store.dtensors import _dtensor, _whole

_SAFE_GLOBALS = {
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath",
                "PureWindowsPath"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "slice", "complex"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata classes, torch dtypes/layouts/sizes and paths; nothing else."""

    def find_class(self, module: str, name: str):
        obj = None
        if module == dcp_metadata.__name__:
            obj = getattr(dcp_metadata, name, None)
            obj = obj if isinstance(obj, (type, dict)) else None
        elif name in _SAFE_GLOBALS.get(module, ()):
            obj = super().find_class(module, name)
        elif module == "torch" and isinstance(getattr(torch, name, None),
                                              (torch.dtype, torch.layout, torch.memory_format)):
            obj = getattr(torch, name)
        if obj is None:
            raise pickle.UnpicklingError(f"{module}.{name} is not checkpoint metadata")
        return obj


class SafeReader(dcp.FileSystemReader):
    """FileSystemReader whose metadata is read by _MetadataUnpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any):
        path = Path(str(self.path)) / ".metadata"
        if not path.exists():
            raise CheckpointError(f"{path.parent} has no DCP metadata (.metadata); it is not a "
                                  "complete dcp checkpoint")
        try:
            metadata = _MetadataUnpickler(io.BytesIO(path.read_bytes())).load()
        except Exception as e:  # noqa: BLE001 - truncated, corrupted or crafted
            raise CheckpointError(f"{path} is unreadable ({type(e).__name__}: {e}); the "
                                  "checkpoint is truncated, corrupted or not a DCP "
                                  "checkpoint") from e
        if not isinstance(metadata, dcp_metadata.Metadata):
            raise CheckpointError(f"{path} does not hold DCP metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """Non-tensor items load with torch.load(weights_only=True)."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def read_metadata(directory: str | Path) -> dict:
    """{key: storage metadata} of a DCP checkpoint, read safely."""
    return SafeReader(str(directory)).read_metadata().state_dict_metadata


def load_state(state: dict, directory: str | Path, no_dist: bool = False) -> None:
    """dcp.load through SafeReader/SafeLoadPlanner; a failure on any rank is a CheckpointError
    on every rank (DCP gathers the ranks' exceptions)."""
    try:
        dcp.load(state, storage_reader=SafeReader(str(directory)),
                 planner=SafeLoadPlanner(), no_dist=no_dist)
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - any rank's read error
        first = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"could not read the dcp checkpoint in {directory}: {first}; "
                              "it is truncated or corrupted: load an earlier one") from e


def _model_state(pm, gather: bool = True) -> dict[str, DTensor]:
    """By FQN: this rank's shards as DTensors, a parameter held as parts whole (assembled over
    the plan unit when `gather`, else zeros to load into)."""
    local = pm.local_tensors()
    rows = state_rows(pm)
    parts = sources_of(param_rows(pm))
    if gather:
        full = assemble_sources(pm, param_rows(pm), local)
    else:
        full = {src: local[rs[0].name].new_zeros(rs[0].source_shape) for src, rs in parts.items()}
    out = {}
    for row in rows:
        if row.part is None:
            out[row.fqn] = _dtensor(pm, local[row.name].detach(), row)
        elif row.source not in out:
            out[row.source] = _whole(pm, full[row.source].detach())
    return out


def _optimizer_state(pm, local: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """By FQN: each parameter's optimizer state, tensors shaped like the parameter as DTensors
    (a parameter held as parts: whole, assembled over the plan unit; a collective)."""
    optim: dict[str, dict[str, Any]] = {}
    rows = param_rows(pm)
    for row in rows:
        if row.part is None:
            optim[row.fqn] = {k: _dtensor(pm, v, row)
                              if torch.is_tensor(v) and tuple(v.shape) == row.local_shape
                              and v.dim() else v
                              for k, v in local.get(row.name, {}).items()}
    for source, parts in sources_of(rows).items():
        first = local.get(parts[0].name, {})
        entry: dict[str, Any] = {}
        for k, v in first.items():
            if torch.is_tensor(v) and v.dim() and tuple(v.shape) == parts[0].local_shape:
                full = assemble_sources(pm, parts, {r.name: local.get(r.name, {}).get(k)
                                                    for r in parts})[source]
                if full is not None:
                    entry[k] = _whole(pm, full)
            else:
                entry[k] = v            # a per-parameter scalar (step): the same for every part
        optim[source] = entry
    return optim


def dcp_state(pm, optimizer=None, snapshot_buffers: bool = False) -> dict[str, Any]:
    """This rank's part of the job's state, as the DTensors DCP saves: views of the live
    tensors (DCP writes them, or copies them before the next step changes them). With
    snapshot_buffers, buffers are copied now: a forward updates them (BatchNorm statistics)
    while a background copy of the rest runs."""
    model = _model_state(pm)
    if snapshot_buffers:
        for row in buffer_rows(pm):
            if row.fqn in model:
                t = model[row.fqn]
                model[row.fqn] = DTensor.from_local(
                    t.to_local().clone(), t.device_mesh, t.placements, run_check=False,
                    shape=t.shape, stride=t.stride())
    state: dict[str, Any] = {"model": model}
    if optimizer is not None:
        local = local_optimizer_state(pm, optimizer, copy=False)["state"]
        state["optim"] = _optimizer_state(pm, local)
    return state


def save_planner() -> DefaultSavePlanner:
    # a tensor several ranks hold alike is stored from the lowest of them: data-parallel units'
    # buffers (BatchNorm statistics) may differ, and the checkpoint keeps the first unit's
    return DefaultSavePlanner(dedup_save_to_lowest_rank=True)


def save_dcp(directory: str, pm, optimizer=None) -> None:
    """Write this job's state into `directory` (every rank calls it)."""
    dcp.save(dcp_state(pm, optimizer), checkpoint_id=directory, planner=save_planner())


def load_dcp(directory: str, pm, optimizer=None) -> None:
    """Fill this rank's shards (and optimizer state) from a DCP checkpoint of any plan."""
    metadata = read_metadata(directory)
    model = _model_state(pm, gather=False)
    missing = [f"model.{k}" for k in model if f"model.{k}" not in metadata]
    if missing:
        raise CheckpointError(f"the checkpoint in {directory} has no {missing[:3]}; it was saved "
                              f"from another model")
    state: dict[str, Any] = {"model": model}
    if optimizer is not None:
        optim: dict[str, dict[str, Any]] = {}
        for row in param_rows(pm):
            if row.part is not None and row.source in optim:
                continue                        # a parameter held as parts: read once, whole
            prefix = f"optim.{row.source}."
            for key, md in metadata.items():
                if not key.startswith(prefix) or not isinstance(md, TensorStorageMetadata):
                    continue
                entry = key[len(prefix):]
                if tuple(md.size) == row.source_shape and len(md.size):
                    target = _whole(pm, torch.zeros(row.source_shape, dtype=md.properties.dtype,
                                                    device=pm.device)) \
                        if row.part is not None else \
                        _dtensor(pm, torch.zeros(row.local_shape, dtype=md.properties.dtype,
                                                 device=pm.device), row)
                else:
                    target = torch.zeros(tuple(md.size), dtype=md.properties.dtype)
                optim.setdefault(row.source, {})[entry] = target
        state["optim"] = optim
    load_state(state, directory)
    pm.load_local_tensors({row.name: _mine(row, state["model"][row.source])
                           for row in state_rows(pm)})
    if optimizer is not None:
        local = {}
        for row in param_rows(pm):
            if row.source in state["optim"]:
                local[row.name] = {k: _mine(row, v) if isinstance(v, DTensor) else
                                   v.clone() if row.part is not None and torch.is_tensor(v)
                                   else v for k, v in state["optim"][row.source].items()}
        load_local_optimizer_state(pm, optimizer, {"state": local, "param_groups": []})


def _mine(row, t: DTensor) -> torch.Tensor:
    """This rank's local tensor of `row` from what DCP read (a part: from the whole)."""
    t = t.to_local()
    return take(row, t).clone() if row.part is not None else t
