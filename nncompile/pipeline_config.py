"""Pipeline options of `ComputeConfig.parallel` (nncompile/parallel_spec.py), checked in one
place against plan_ngpus.

    parallel=ParallelSpec(pp=2,                  # S, or "auto" (autodist picks S)
                          schedule="1f1b",       # one of SCHEDULES
                          microbatches=4,        # M: the unit's batch is split into M
                          stages_per_rank=1)     # V: stages each pipeline rank holds

The plan unit's plan_ngpus ranks become S pipeline ranks of plan_ngpus // S tensor-parallel
ranks each; with V > 1 the model is cut into S * V stages and pipeline rank p holds stages
p, p + S, ... (loop placement), or p and 2S - 1 - p for the V-shaped schedules (zero_bubble
with V = 2, and dualpipev, which always holds two stages per rank).
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
    "dualpipev": ("ScheduleDualPipeV", (2,)),
}
V_SHAPED = ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")     # rank p holds p and 2S - 1 - p


def auto_schedules(v: int) -> list[str]:
    """The schedules schedule='auto' prices for V stages per rank."""
    if v == 1:
        return ["gpipe", "1f1b", "zero_bubble"]
    return ["interleaved_1f1b", "zero_bubble"] + (["dualpipev"] if v == 2 else [])



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
        """The torch.distributed.pipelining class that runs this schedule (a plan's, never
        'auto': pipeline_stages records the one autodist chose)."""
        if self.schedule == "zero_bubble" and self.stages_per_rank == 2:
            return "ScheduleZBVZeroBubble"
        return SCHEDULES[self.schedule][0]

    def stage_ids(self, pipe_rank: int, stages: int) -> list[int]:
        """The stage indices pipeline rank `pipe_rank` of `stages` holds."""
        v = self.stages_per_rank
        if self.torch_schedule() in V_SHAPED:
            return [pipe_rank, 2 * stages - 1 - pipe_rank]
        return [pipe_rank + k * stages for k in range(v)]


def pipeline_config(spec, plan_ngpus: int) -> PipelineConfig:
    """The pipeline options of a ParallelSpec (each field's type is checked there), checked
    against plan_ngpus (PipelineConfig() when none are given)."""
    stages, schedule = spec.pp, spec.schedule or "1f1b"
    m, v = spec.microbatches, spec.stages_per_rank
    if stages != AUTO and plan_ngpus % stages:
        raise ConfigError(f"parallel.pp={stages} does not divide plan_ngpus={plan_ngpus}: each "
                          f"stage runs on plan_ngpus // pp tensor-parallel ranks; pick one of "
                          f"{[d for d in range(1, plan_ngpus + 1) if plan_ngpus % d == 0]}")
    allowed = SCHEDULES[schedule][1] if schedule != AUTO else None
    if allowed == (2,) and v == 1:         # dualpipev: always two stages per rank (a V)
        v = 2
    if allowed is not None and v not in allowed:
        if allowed == (2,):
            raise ConfigError(f"parallel.schedule={schedule!r} places two stages on every "
                              f"pipeline rank (a V), but parallel.stages_per_rank={v}; leave "
                              "stages_per_rank out or set it to 2")
        raise ConfigError(f"parallel.schedule={schedule!r} runs one stage per rank, but "
                          f"parallel.stages_per_rank={v}; use 'interleaved_1f1b' or "
                          "'zero_bubble' for several stages per rank")
    if stages == 1 and (v != 1 or spec.schedule is not None):
        raise ConfigError("parallel.schedule/stages_per_rank need a pipeline: parallel.pp > 1 "
                          "(or 'auto')")
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
        raise ConfigError(f"parallel.microbatches={microbatches} does not divide the "
                          f"batch of the dummy args ({batch} rows in dim 0 of the first tensor "
                          f"argument); every micro-batch needs the same size: use a batch that "
                          f"is a multiple of {microbatches}, or another microbatches")
    size = batch // microbatches
    flat, spec = pytree.tree_flatten(dummy_args)
    keep = batched if batched is not None and len(batched) == len(flat) else [True] * len(flat)
    return pytree.tree_unflatten(
        [x[:size] if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == batch
         and cut else x for x, cut in zip(flat, keep)], spec), batch
