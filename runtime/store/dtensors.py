"""pm's tensors as DTensors on the job's device mesh (one per process group and device kind).

The same mesh serves the DTensor views the module holds (module_views.py, zero3_views.py),
DCP checkpoints (dcp.py) and pm.state_dict() (model_state.py):

    before: this rank's piece [16, 32] of h.0.mlp_fc.weight [32, 32], Shard(0) on "plan"
    after:  DTensor(local=that piece, mesh=("dp", "plan"), placements=(Replicate(), Shard(0)))
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from nncompile.ir.placement import Shard as ShardPlacement, parse_placement
from nncompile.mesh import PP, param_placements
from nncompile.rows import BufferRow, ParamRow

from ..protocol.groups import job_cache


_MESHES = job_cache()           # default group -> meshes


def _mesh(pm):
    from torch.distributed.device_mesh import init_device_mesh
    from .value_reads import own_mesh
    mesh = pm.mesh
    device = "cuda" if pm.device.type == "cuda" else "cpu"
    key = (device, mesh.dims)
    meshes = _MESHES.setdefault(dist.distributed_c10d._get_default_group(), {})
    if key not in meshes:
        meshes[key] = init_device_mesh(device, tuple(size for _, size in mesh.dims),
                                       mesh_dim_names=mesh.names)
        own_mesh(meshes[key])             # reading a partial over it: runtime/store/value_reads.py
    return meshes[key]


def _dtensor(pm, local: torch.Tensor, row: ParamRow | BufferRow) -> DTensor:
    """`local` (this rank's piece of `row`'s tensor, or a tensor shaped like it) as a DTensor."""
    per_dim = {PP: None, **param_placements(row.placement),   # along "pp": Replicate; an
               **{axis: parse_placement(text)                     # expert weight's "ep"
                  for axis, text in pm.PARAM_AXES.get(row.name, {}).items()}}
    names = pm.mesh.names
    placements = [Shard(per_dim[d].dim) if isinstance(per_dim.get(d), ShardPlacement)
                  else Replicate() for d in names]                     # one per mesh dim
    shape = torch.Size(row.shape)
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local.contiguous(), _mesh(pm), placements,
                              run_check=False, shape=shape, stride=stride)


def _whole(pm, full: torch.Tensor) -> DTensor:
    """A full tensor every rank holds alike as a replicated DTensor."""
    names = pm.mesh.names
    return DTensor.from_local(full.contiguous(), _mesh(pm), [Replicate() for _ in names],
                              run_check=False)
