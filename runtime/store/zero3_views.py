"""Under ZeRO-3 the module given to parallelize holds Shard(0) DTensors over pm's flat pieces.

A ZeRO-3 unit stores each tensor cut by rows over the ZeRO group, torch.chunk's way
(runtime/store/layouts.py, RowShardLayout), so this rank's run of a parameter in its flat piece is
the local tensor of a DTensor sharded along dim 0 over the mesh dimensions the ZeRO group
spans (data parallel, and context or expert parallel where the plan has them), as FSDP2's
parameters are; under a pipeline, a rank's stages' parameters (Replicate along "pp"). pm's storage-less handles and the module's released parameters are replaced
by the same such DTensors:

    before: pm.module.h[0].mlp_fc.weight            a released tensor: reading it is an error
            pm.h0_mlp_fc_weight                     a handle on the meta device
    after:  both DTensor [128, 32] (Shard(0),)      its local tensor views pm's flat piece

so `p.norm()`, `p.clamp_()`, `p.grad.norm()` (linked after each backward), `requires_grad_`,
torch's `get_model_state_dict` / `set_model_state_dict` with DCP, `AveragedModel(pm)` and an
optimizer over `pm.parameters()` mean what they mean on one device, and edit what pm trains.

ZeRO-3 over groups of the data-parallel ranks (zero_ngroups > 1) is HSDP's layout on a mesh
whose "dp" dimension is folded into ("zero_groups", "zero"): Replicate() across the groups,
Shard(0) inside one (`_hsdp_mesh`). A parameter stays released where one DTensor cannot
describe its run: such groups over context or expert ranks too, a 0-d tensor, a plan that
also splits it along dim 0 on another mesh dimension
in an order DTensor does not express, a part of a fused parameter.
"""
from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from nncompile import compat
from nncompile.ir.placement import Shard as ShardPlacement, parse_placement
from nncompile.mesh import DP, PP, param_placements, replica_dims
from nncompile.rows import param_rows

from ..protocol.groups import job_cache
from .dtensors import _mesh
from .released import ReleasedParameter
from .segments import zero3_segments


def _zero_dims(pm, mesh) -> list[int] | None:
    """The mesh dimensions (indices) the ZeRO group spans, in mesh order, when the group is
    exactly this rank's slice of the mesh along them (ranks in row-major order); else None."""
    grid = mesh.mesh
    coord = mesh.get_coordinate()
    if coord is None:
        return None
    dims = []
    for d in range(grid.dim()):
        line = grid[tuple(slice(None) if i == d else c for i, c in enumerate(coord))]
        if len(set(line.tolist()) & set(pm.zero.ranks)) > 1:
            dims.append(d)
    index = tuple(slice(None) if i in dims else c for i, c in enumerate(coord))
    if grid[index].reshape(-1).tolist() != list(pm.zero.ranks):
        return None
    return dims


def _placements(pm, row, mesh, dims: list[int]) -> list | None:
    """The row's placements with Shard(0) along the ZeRO dimensions (None: not expressible)."""
    per_dim = {PP: None, **param_placements(row.placement),
               **{axis: parse_placement(text)
                  for axis, text in pm.PARAM_AXES.get(row.name, {}).items()}}
    out = []
    for i, name in enumerate(mesh.mesh_dim_names):
        own = per_dim.get(name)
        if i in dims and isinstance(own, ShardPlacement):
            return None                     # split along this dimension by the plan already
        out.append(Shard(0) if i in dims else
                   Shard(own.dim) if isinstance(own, ShardPlacement) else Replicate())
    # DTensor applies splits in mesh order, but ZeRO cuts the rows of the plan's piece: a
    # plan dimension after the ZeRO one splitting dim 0 too makes the ZeRO split a strided
    # one (FSDP2's with tp), expressed where every piece has as many rows
    later = [i for i, p in enumerate(out) if dims and i > max(dims) and p == Shard(0)]
    if later:
        if len(dims) != 1 or len(later) != 1:
            return None
        factor = mesh.size(later[0])
        if row.shape[0] % (factor * mesh.size(dims[0])):
            return None
        out[dims[0]] = compat.strided_shard(0, factor)
    return out


_HSDP_MESHES = job_cache()           # default group -> {(device, dims, ngroups): mesh}
ZERO_GROUPS, ZERO = "zero_groups", "zero"      # the folded replica dimensions' names


def _hsdp_mesh(pm, mesh):
    """(mesh, its ZeRO dimension) for ZeRO-3 over consecutive groups of the data-parallel
    replicas (zero_ngroups > 1), as FSDP2's HSDP lays it out: the job's mesh with its "dp"
    dimension folded into ("zero_groups", "zero") in front, the others after in their
    order, so a parameter is Replicate() across the groups and Shard(0) inside its group:

        mesh ("dp" 4, "plan" 2), zero_ngroups 2  ->  ("zero_groups" 2, "zero" 2, "plan" 2)

    None where the groups are not such slices of the mesh (a pipeline, context or expert
    ranks among the replicas)."""
    from torch.distributed.device_mesh import DeviceMesh
    from .value_reads import own_mesh
    ngroups = pm.compute_config.zero_ngroups
    replicas = [n for n in replica_dims(pm.mesh) if pm.mesh.size(n) > 1]
    if ngroups <= 1 or pm.PIPELINE is not None or replicas != [DP]:
        return None                       # (context or expert ranks among the replicas: kept)
    names = list(pm.mesh.names)
    at = names.index(DP)
    rest = [i for i in range(len(names)) if i != at]
    grid = mesh.mesh.permute(at, *rest)
    grid = grid.reshape(ngroups, grid.shape[0] // ngroups, *grid.shape[1:])
    line = grid.reshape(grid.shape[0], grid.shape[1], -1)      # [group, its ranks, the rest]
    me = dist.get_rank()
    group = next((line[g, :, k].tolist() for g in range(line.shape[0])
                  for k in range(line.shape[2]) if me in line[g, :, k].tolist()), None)
    if group != list(pm.zero.ranks):
        return None
    key = (mesh.device_type, pm.mesh.dims, ngroups)
    meshes = _HSDP_MESHES.setdefault(dist.distributed_c10d._get_default_group(), {})
    if key not in meshes:
        meshes[key] = DeviceMesh(mesh.device_type, grid,
                                 mesh_dim_names=(ZERO_GROUPS, ZERO,
                                                 *(names[i] for i in rest)))
        own_mesh(meshes[key])           # reading a partial over it: value_reads.py
    return meshes[key], [1]


def view_pm_params(pm) -> dict[str, torch.nn.Parameter]:
    """Replace pm's ZeRO-3 handles by Shard(0) DTensor Parameters over its flat pieces where
    one DTensor describes the run (pm.parameters() then are these); {local name: view}."""
    if not dist.is_initialized() or pm.INFERENCE_ONLY:
        return {}
    mesh = _mesh(pm)
    dims = _zero_dims(pm, mesh)              # [] where the ZeRO group is this rank alone
    if dims is None:
        found = _hsdp_mesh(pm, mesh)          # zero_ngroups > 1
        if found is None:
            return {}
        mesh, dims = found
    rows = {r.name: r for r in param_rows(pm) if r.part is None}
    segs = zero3_segments(pm)
    views, by_unit = {}, {}
    for unit in pm.zero.units:
        for i, name in enumerate(unit.layout.names):
            row, seg, handle = rows.get(name), segs.get(name), pm._parameters.get(name)
            if row is None or seg is None or handle is None or not row.local_shape or \
                    seg.device != pm.device:        # (a 0-d tensor has no rows to shard)
                continue
            placements = _placements(pm, row, mesh, dims)
            if placements is None:
                continue
            shape = (unit.layout.local_rows(i),) + tuple(row.local_shape[1:])
            local = compat.alias_at_offset_zero(seg.detach()).view(shape)
            full = torch.Size(row.shape)
            view = torch.nn.Parameter(
                DTensor.from_local(local, mesh, placements, run_check=False, shape=full,
                                   stride=torch.empty(full, device="meta").stride()),
                requires_grad=handle.requires_grad)
            view._nnc_handle = (weakref.ref(pm), name)
            view._nnc_view = True            # stepped as a DTensor (its local run in place)
            pm._parameters[name] = view
            views[name] = view
            if unit.trainable:              # a unit frozen at parallelize gets no gradient
                by_unit.setdefault(unit.attr, []).append(
                    [view, view, view.requires_grad, None, seg])
    _link_grads(pm, by_unit)
    return views


def _link_grads(pm, by_unit: dict) -> None:
    """After each unit's gradient lands (and at the end of the reduction), each view's .grad
    is a DTensor over its run of the flat gradient."""
    from .view_grads import add_entries, follow_cleared, landed, link_grads
    if not by_unit:
        return
    add_entries(pm, [e for entries in by_unit.values() for e in entries])

    def linker(unit_entries):
        def hook(_):
            for e in unit_entries:
                landed(e)
        return hook
    def follower(unit_entries):
        def hook(_):
            for e in unit_entries:
                follow_cleared(e)
        return hook
    for attr, unit_entries in by_unit.items():       # after the segments' refresh
        flat = pm.zero.flat(pm.zero.by_attr[attr])
        flat.register_hook(follower(unit_entries))     # zero_grad() between forward, backward
        flat.register_post_accumulate_grad_hook(linker(unit_entries))
    if pm._reducer is not None:
        pm._reducer.on_finish.append(lambda: link_grads(pm))


def view_zero3(pm, module: torch.nn.Module, params: list, rows) -> list[str]:
    """pm's parameters become Shard(0) DTensors over its ZeRO-3 runs (view_pm_params) and
    `module` holds the same objects in place of its released parameters; returns the FQNs
    that stay released."""
    released = [fqn for fqn, p in params if isinstance(p, ReleasedParameter)]
    views = view_pm_params(pm)
    whole_rows = {r.fqn: r for r in rows if r.part is None}
    made: dict[int, torch.nn.Parameter] = {}       # id(original) -> its view (ties share one)
    still = []
    for fqn, p in params:
        if not isinstance(p, ReleasedParameter):
            continue
        row = whole_rows.get(fqn)
        view = made.get(id(p))
        if view is None and row is not None:
            view = views.get(row.name)
        if view is None or view.device != p.device:
            still.append(fqn)
            continue
        made[id(p)] = view
        owner, _, leaf = fqn.rpartition(".")
        module.get_submodule(owner)._parameters[leaf] = view
    return [fqn for fqn in released if fqn in still]


__all__ = ["view_zero3", "view_pm_params"]
