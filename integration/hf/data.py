"""Data for NnCompileTrainer: one shard per data-parallel unit, metrics gathered once per unit.

Trainer shards its dataloaders with `accelerator.prepare`, which gives every process its own
batches (`num_processes` = world size, `process_index` = rank), and gathers evaluation losses,
logits and labels from every process (`accelerator.gather_for_metrics`). Under a plan of
plan_ngpus > 1 ranks, the ranks of one plan unit must read the SAME batches (they hold parts
of one model), and gathering from all of them would count each unit's results plan_ngpus
times. So, for such plans, the trainer's accelerator gets two replacements:

    prepare_data_loader   accelerate's prepare_data_loader with num_processes = the number of
                          data-parallel units and process_index = this rank's unit
    gather_for_metrics    everything gathered from the world, then one copy per unit kept
                          (the first rank of each unit), the padding of the last batch cut as
                          accelerate cuts it

    world 4, ComputeConfig(2, 4):   rank    0  1  2  3
                                    unit    0  0  1  1     (batches: unit 0's, unit 0's, ...)

With plan_ngpus == 1 every rank is its own unit and accelerate's own functions are kept.
"""
from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
from accelerate.data_loader import prepare_data_loader
from accelerate.utils import gather, recursively_apply

from nncompile.mesh import DP, Mesh


def unit_mesh(plan_ngpus: int, world: int) -> Mesh:
    """The job's mesh as the data sees it: ("dp", units) x ("plan", ranks of one unit)."""
    return Mesh.of(plan_ngpus, world)


def unit_leaders(mesh: Mesh) -> list[int]:
    """The first rank of each data-parallel unit, in unit order."""
    first: dict[int, int] = {}
    for rank in range(mesh.world):
        first.setdefault(mesh.unit_of(rank), rank)
    return [first[u] for u in range(mesh.size(DP))]


def install(accelerator, mesh: Mesh, rank: int) -> None:
    """Make `accelerator` shard dataloaders and gather metrics by data-parallel unit (see the
    module docstring); nothing changes when every rank is its own unit."""
    if mesh.size(DP) == mesh.world:
        return
    accelerator.prepare_data_loader = functools.partial(_prepare_loader, accelerator, mesh,
                                                        rank)
    accelerator.gather_for_metrics = functools.partial(_gather_for_metrics, accelerator, mesh)


def _prepare_loader(accelerator, mesh: Mesh, rank: int, data_loader, device_placement=None,
                    slice_fn_for_dispatch=None):
    """accelerate's prepare_data_loader with the accelerator's settings, sharded over the
    data-parallel units instead of the processes. Batches are never dispatched from rank 0
    (accelerate would split them over all processes): an iterable dataset is sharded by unit."""
    if getattr(data_loader, "_is_accelerate_prepared", False):
        if data_loader not in accelerator._dataloaders:
            accelerator._dataloaders.append(data_loader)
        return data_loader
    if device_placement is None:
        device_placement = accelerator.device_placement
    prepared = prepare_data_loader(
        data_loader, accelerator.device,
        num_processes=mesh.size(DP), process_index=mesh.unit_of(rank),
        split_batches=accelerator.split_batches, put_on_device=device_placement,
        rng_types=accelerator.rng_types.copy(), dispatch_batches=False,
        even_batches=accelerator.even_batches, slice_fn_for_dispatch=slice_fn_for_dispatch,
        use_seedable_sampler=accelerator.use_seedable_sampler,
        data_seed=accelerator.dataloader_config.data_seed,
        non_blocking=accelerator.non_blocking,
        use_stateful_dataloader=accelerator.use_stateful_dataloader)
    accelerator._dataloaders.append(prepared)
    return prepared


def _gather_for_metrics(accelerator, mesh: Mesh, input_data: Any,
                        use_gather_object: bool = False) -> Any:
    """Each unit's values once, in unit order, without the samples the last batch repeats."""
    leaders = unit_leaders(mesh)
    try:
        recursively_apply(lambda x: x, input_data, error_on_other_type=True)
        tensors = True
    except TypeError:
        tensors = False
    if use_gather_object or not tensors:
        every: list[Any] = [None] * mesh.world
        dist.all_gather_object(every, input_data)
        data = [x for r in leaders for x in every[r]]
    else:
        def keep(t: torch.Tensor) -> torch.Tensor:
            chunks = t.chunk(mesh.world)
            return torch.cat([chunks[r] for r in leaders])
        data = recursively_apply(keep, gather(input_data))
    state = accelerator.gradient_state
    if state.end_of_dataloader and state.remainder > 0:
        cut = state.remainder
        return data[:cut] if isinstance(data, list) else \
            recursively_apply(lambda t: t[:cut], data)
    return data
