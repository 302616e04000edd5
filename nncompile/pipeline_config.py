"""Pipeline options in `ComputeConfig.pas_config`, read and checked in one place.

    pas_config={"pipeline_stages": 2,            # S, or "auto" (autodist picks S)
                "pipeline_schedule": "1f1b",     # one of SCHEDULES
                "microbatches": 4,               # M: the unit's batch is split into M
                "stages_per_rank": 1}            # V: stages each pipeline rank holds

The plan unit's plan_ngpus ranks become S pipeline ranks of plan_ngpus // S tensor-parallel
ranks each; with V > 1 the model is cut into S * V stages and pipeline rank p holds stages
p, p + S, ... (loop placement), or p and 2S - 1 - p for the V-shaped zero-bubble schedule.
`microbatches` without stages makes `train_step` accumulate over M micro-batches.
"""
from __future__ import annotations

from dataclasses import dataclass

from .errors import ConfigError

AUTO = "auto"
# schedule name -> (torch.distributed.pipelining class, stages_per_rank it runs with)
SCHEDULES = {
    "gpipe": ("ScheduleGPipe", (1,)),
    "1f1b": ("Schedule1F1B", (1,)),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", None),      # any V
    "zero_bubble": ("ScheduleInterleavedZeroBubble", None),     # V = 2: ScheduleZBVZeroBubble
}
PIPELINE_KEYS = ("pipeline_stages", "pipeline_schedule", "microbatches", "stages_per_rank")


@dataclass(frozen=True)
class PipelineConfig:
    stages: int | str = 1          # pipeline ranks S (1: no pipeline), or "auto"
    schedule: str = "1f1b"
    microbatches: int = 1          # M
    stages_per_rank: int = 1       # V

    @property
    def enabled(self) -> bool:
        return self.stages == AUTO or self.stages > 1

    def torch_schedule(self) -> str:
        """The torch.distributed.pipelining class that runs this schedule."""
        if self.schedule == "zero_bubble" and self.stages_per_rank == 2:
            return "ScheduleZBVZeroBubble"
        return SCHEDULES[self.schedule][0]

    def stage_ids(self, pipe_rank: int, stages: int) -> list[int]:
        """The stage indices pipeline rank `pipe_rank` of `stages` holds."""
        v = self.stages_per_rank
        if self.torch_schedule() == "ScheduleZBVZeroBubble":
            return [pipe_rank, 2 * stages - 1 - pipe_rank]
        return [pipe_rank + k * stages for k in range(v)]


def _positive_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def pipeline_config(pas_config: dict, plan_ngpus: int) -> PipelineConfig:
    """The checked pipeline options (PipelineConfig() when none are given)."""
    stages = pas_config.get("pipeline_stages", 1)
    schedule = pas_config.get("pipeline_schedule", "1f1b")
    m = pas_config.get("microbatches", 1)
    v = pas_config.get("stages_per_rank", 1)
    if not (_positive_int(stages) or stages == AUTO):
        raise ConfigError(f"pas_config['pipeline_stages']={stages!r}; give a positive int (the "
                          f"number of pipeline stages) or 'auto'")
    if _positive_int(stages) and plan_ngpus % stages:
        raise ConfigError(f"pas_config['pipeline_stages']={stages} does not divide plan_ngpus="
                          f"{plan_ngpus}: each stage runs on plan_ngpus // pipeline_stages "
                          f"tensor-parallel ranks; pick one of "
                          f"{[d for d in range(1, plan_ngpus + 1) if plan_ngpus % d == 0]}")
    if not _positive_int(m):
        raise ConfigError(f"pas_config['microbatches']={m!r}; give a positive int (the number "
                          "of micro-batches each unit's batch is split into)")
    if not _positive_int(v):
        raise ConfigError(f"pas_config['stages_per_rank']={v!r}; give a positive int")
    if schedule not in SCHEDULES:
        raise ConfigError(f"pas_config['pipeline_schedule']={schedule!r} is not a schedule "
                          f"torch.distributed.pipelining offers here; choose one of "
                          f"{sorted(SCHEDULES)}")
    allowed = SCHEDULES[schedule][1]
    if allowed is not None and v not in allowed:
        raise ConfigError(f"pipeline_schedule={schedule!r} runs one stage per rank, but "
                          f"stages_per_rank={v}; use 'interleaved_1f1b' or 'zero_bubble' for "
                          f"several stages per rank")
    if stages == 1 and (v != 1 or "pipeline_schedule" in pas_config):
        raise ConfigError("pipeline_schedule/stages_per_rank need pas_config['pipeline_stages'] "
                          "> 1 (or 'auto')")
    return PipelineConfig(stages, schedule, m, v)


def microbatch_dummy(dummy_args, microbatches: int, batched: list[bool] | None = None):
    """dummy_args with every tensor whose dim 0 is the batch size (that of the first tensor
    with a dim) cut to one micro-batch, and the batch size: the compiled code runs one
    micro-batch at a time. `batched` (per leaf, nncompile/batched.py) narrows which are."""
    import torch
    from torch.utils import _pytree as pytree
    leaves = [x for x in pytree.tree_leaves(dummy_args)
              if isinstance(x, torch.Tensor) and x.dim() > 0]
    if microbatches == 1 or not leaves:
        return dummy_args, (leaves[0].shape[0] if leaves else 1)
    batch = leaves[0].shape[0]
    if batch % microbatches:
        raise ConfigError(f"pas_config['microbatches']={microbatches} does not divide the "
                          f"batch of the dummy args ({batch} rows in dim 0 of the first tensor "
                          f"argument); every micro-batch needs the same size: use a batch that "
                          f"is a multiple of {microbatches}, or another microbatches")
    size = batch // microbatches
    flat, spec = pytree.tree_flatten(dummy_args)
    keep = batched if batched is not None and len(batched) == len(flat) else [True] * len(flat)
    return pytree.tree_unflatten(
        [x[:size] if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == batch
         and cut else x for x, cut in zip(flat, keep)], spec), batch
