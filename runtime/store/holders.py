"""Which ranks hold which parameter: the plan a rank's shards belong to, pipeline ranks and
tied weights, the mesh axes a tensor is split along, and the rank that stores each shard once.

Under a pipelined plan a rank holds only its stages' parameters (its PARAMS rows), and a tied
weight (GPT's wte / lm_head) is held, equal, by every stage that uses it. plan_info records the
pipeline (`pipe_ranks`, this rank's `pipe_rank`, `tied`: {FQN: pipeline ranks holding it}), so
a tied weight is stored, counted and merged once: by the lowest pipeline rank holding it
(`first_holder`).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from nncompile.mesh import PLAN, PP, Mesh, replica_dims
from nncompile.ir.placement import Shard, parse_placement
from nncompile.pipeline_config import PipelineConfig
from nncompile.rows import buffer_rows, param_rows

from .zero import all_gather_along


def plan_info(pm) -> dict[str, Any]:
    """The plan a rank's shards belong to; stored with every per-rank state dict."""
    return {"fingerprint": pm.FINGERPRINT, "policy": pm.POLICY, "rank": pm.RANK,
            "plan_ngpus": pm.PLAN_NGPUS, "runtime_ngpus": pm.RUNTIME_NGPUS,
            "params": [list(r.plain()) for r in param_rows(pm)],
            "buffers": [list(r.plain()) for r in buffer_rows(pm)],
            "param_order": list(pm.PARAM_ORDER), "frozen": list(pm.FROZEN),
            "state_keys": [list(k) for k in pm.STATE_KEYS], "pipe_ranks": pm.PIPE_RANKS,
            **({"mesh_axes": dict(pm.MESH_AXES)} if pm.MESH_AXES else {}),
            **({"pipeline": {"pipe_rank": pipe_rank(pm), "tied": tied_pipes(pm)}}
               if pm.PIPELINE is not None else {}),
            **({"zero3": zero3_layout(pm)} if pm.zero is not None else {})}


def pipe_ranks(src) -> int:
    """S, the pipeline ranks per plan unit, of a ParallelModule or a plan_info (1: none)."""
    return src.get("pipe_ranks", 1) if isinstance(src, dict) else src.PIPE_RANKS


def mesh_of(src) -> Mesh:
    """The job's mesh (nncompile/mesh.py) of a ParallelModule or a plan_info."""
    get = src.get if isinstance(src, dict) else lambda k: getattr(src, k.upper())
    return Mesh.of(get("plan_ngpus"), get("runtime_ngpus"), pipe_ranks(src),
                   get("mesh_axes") or {})


def pipe_rank(src) -> int:
    """This rank's pipeline rank (0 without a pipeline)."""
    rank = src["rank"] if isinstance(src, dict) else src.RANK
    return mesh_of(src).coords(rank).get(PP, 0)


def tied_pipes(src) -> dict[str, list[int]]:
    """{FQN: the pipeline ranks holding it} for weights shared by stages on several pipeline
    ranks (empty without a pipeline)."""
    if isinstance(src, dict):
        return {k: list(v) for k, v in src.get("pipeline", {}).get("tied", {}).items()}
    info = src.PIPELINE
    if info is None:
        return {}
    cfg = PipelineConfig(info["ranks"], info["schedule"], info["microbatches"],
                         info["stages_per_rank"])
    pipe_of = {s: p for p in range(info["ranks"]) for s in cfg.stage_ids(p, info["ranks"])}
    out = {fqn: sorted({pipe_of[s] for s in stages}) for fqn, stages in info["tied"].items()}
    return {fqn: pipes for fqn, pipes in out.items() if len(pipes) > 1}


def holders(src, fqn: str) -> list[int]:
    """The pipeline ranks holding parameter `fqn` (this rank's alone unless it is tied)."""
    return tied_pipes(src).get(fqn) or [pipe_rank(src)]


def first_holder(src, fqn: str) -> bool:
    """Whether this rank's stage is the lowest pipeline rank holding `fqn`: the one whose copy
    of a tied weight is stored, counted in norms and merged."""
    return holders(src, fqn)[0] == pipe_rank(src)


def zero3_layout(pm) -> dict[str, Any]:
    """Under ZeRO-3: how pm.parameters() (the flat pieces, in order) cut the local tensors, so
    a plain optimizer's indexed state over them can be merged (merge.py)."""
    z = pm.zero
    return {"zero_rank": z.rank, "zero_size": z.size,
            "ranks": list(z.ranks),
            "flats": [{"attr": u.attr, "names": u.layout.names, "numels": u.layout.numels,
                       "runs": [list(r) for r in u.layout.runs()], "trainable": u.trainable}
                      for u in z.units]}


def split_axes(pm, row) -> tuple[str, ...]:
    """The mesh axes beyond "plan" that `row`'s tensor is split along (an expert weight's
    "ep": the generated file's PARAM_AXES), in mesh order."""
    return tuple(getattr(pm, "PARAM_AXES", {}).get(row.name, {}))


def gather_split_axes(pm, row, t: torch.Tensor) -> torch.Tensor:
    """`t` (this rank's piece of `row` along the plan) all-gathered along the other axes the
    row is split on (split_axes), innermost first (a collective over each axis's group)."""
    for axis, text in reversed(getattr(pm, "PARAM_AXES", {}).get(row.name, {}).items()):
        p, group = parse_placement(text), pm.axis_group(axis)
        if isinstance(p, Shard) and group is not None:
            t = all_gather_along(t, p.dim, dist.get_world_size(group), group)
    return t


def owner_rank(pm, row) -> int:
    """The global rank that stores this rank's shard of `row` in a deduped checkpoint: in the
    first data-parallel unit (and context rank), on the lowest pipeline rank holding it, this rank's
    tensor-parallel index for a sharded tensor, index 0 for a replicated one."""
    mesh = mesh_of(pm)
    coords = mesh.coords(pm.RANK)
    for dim in replica_dims(mesh, split_axes(pm, row)):    # "dp", "cp", "ep": the same
        coords[dim] = 0
    if PP in coords:
        coords[PP] = holders(pm, row.fqn)[0]
    if not isinstance(row.placement, Shard):
        coords[PLAN] = 0
    return mesh.rank_of(coords)


def is_owner(pm, row) -> bool:
    """Whether this rank stores its shard of `row` in a deduped checkpoint (see owner_rank)."""
    return owner_rank(pm, row) == pm.RANK
