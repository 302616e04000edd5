"""train_step: one optimizer step's forward and backward over micro-batches.

Pipelined plans (the generated class has PIPELINE and STAGES) run on PyTorch's own pipeline
runtime: each of this rank's `stage_k` methods becomes a `PipelineStage` (with the stage's
input/output shapes from the generated file, so no shape inference runs), and the schedule
class the plan names (`Schedule1F1B`, `ScheduleGPipe`, `ScheduleInterleaved1F1B`,
`ScheduleInterleavedZeroBubble`, `ScheduleZBVZeroBubble`) splits the unit's batch into
micro-batches and runs forward and backward in its order, sending activations and their
gradients between neighbouring stages over the pipeline group. Each micro-batch's loss is
divided by M before its backward, so the gradients are those of one device accumulating
`(loss_m / M).backward()` over the same micro-batches. After the schedule:

    tied weights       their gradient summed over the stages that use them (Megatron's
                       embedding / lm_head all-reduce), so the copies stay equal
    data parallelism   the reducer's buckets reduced once (ZeRO-3 already reduce-scattered
                       each unit's gradient in backward)
    the loss           the mean over micro-batches, sent from the last stage to every rank

Plans without stages accumulate over `microbatches` micro-batches (no_sync on all but the
last), so a loop written with train_step runs under every plan.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from nncompile.errors import ConfigError, InputMismatchError
from nncompile.pipeline_config import PipelineConfig

from . import arguments
from .groups import pipe_group, tie_group
from .rows import param_rows


class StageModule(torch.nn.Module):
    """One stage of this rank's generated module, as the nn.Module PipelineStage wraps; the
    parameters stay registered on the rank's module."""

    def __init__(self, pm, index: int, params: tuple[str, ...]):
        super().__init__()
        object.__setattr__(self, "pm", pm)        # not a child: no second owner of the weights
        self.index = index
        self.param_names = params
        self.fn = getattr(pm, f"stage_{index}")

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True):
        for name in self.param_names:
            p = getattr(self.pm, name)
            if isinstance(p, torch.nn.Parameter):
                yield prefix + name, p

    def forward(self, *inputs):
        zero = self.pm.zero
        if zero is None:
            return self.fn(*inputs)
        with torch.autograd.graph.saved_tensors_hooks(zero.pack, zero.unpack):
            return self.fn(*inputs)


def _example(meta, device) -> torch.Tensor:
    shape, dtype, grad = meta
    return torch.empty(shape, dtype=getattr(torch, dtype), device="meta",
                       requires_grad=grad)


class PipelineRuntime:
    """This rank's stages, its pipeline group, the tie groups and the torch schedule."""

    def __init__(self, pm):
        from torch.distributed import pipelining
        from torch.distributed.pipelining.microbatch import TensorChunkSpec, _Replicate
        info = pm.PIPELINE
        self.pm = pm
        self.info = info
        self.m = info["microbatches"]
        self.group, self.ranks = pipe_group(pm.PLAN_NGPUS, pm.RUNTIME_NGPUS, pm.PIPE_RANKS)
        self.last_rank = self.ranks[self._pipe_of(info["stages"] - 1)]   # holds the loss
        self.ties = []
        rows = {row.fqn: row.name for row in param_rows(pm)}
        for fqn, stages in info["tied"].items():       # every rank: creating groups is collective
            pipes = tuple(sorted({self._pipe_of(s) for s in stages}))
            if len(pipes) < 2:
                continue                               # used twice on one rank: one copy
            group = tie_group(pipes, pm.PLAN_NGPUS, pm.RUNTIME_NGPUS, pm.PIPE_RANKS)
            if group is not None and fqn in rows:
                self.ties.append((rows[fqn], group))
        self.modules = [StageModule(pm, s, params) for s, _, _, _, _, params in pm.STAGES]
        stages = [pipelining.PipelineStage(
            mod, s, info["stages"], pm.device,
            input_args=tuple(_example(x, pm.device) for x in ins),
            output_args=tuple(_example(x, pm.device) for x in outs), group=self.group)
            for mod, (s, _, _, ins, outs, _) in zip(self.modules, pm.STAGES)]
        cfg = PipelineConfig(info["ranks"], info["schedule"], self.m, info["stages_per_rank"])
        cls = getattr(pipelining, cfg.torch_schedule())
        batched = set(info["batched"])
        spec = tuple(TensorChunkSpec(0) if name in batched else _Replicate()
                     for name, _, _ in pm.INPUTS)
        m = self.m

        def loss_fn(out, _target):
            return (out[0] if isinstance(out, (tuple, list)) else out) / m
        single = cls in (pipelining.ScheduleGPipe, pipelining.Schedule1F1B)
        try:
            self.schedule = cls(stages[0] if single else stages, n_microbatches=m,
                                loss_fn=loss_fn, args_chunk_spec=spec, scale_grads=False)
        except (ValueError, RuntimeError) as e:
            raise ConfigError(f"torch.distributed.pipelining.{cls.__name__} refused this "
                              f"layout ({info['stages']} stages on {info['ranks']} pipeline "
                              f"ranks, {m} micro-batches): {e}") from e

    def _pipe_of(self, stage: int) -> int:
        info = self.info
        cfg = PipelineConfig(info["ranks"], info["schedule"], info["microbatches"],
                             info["stages_per_rank"])
        return next(p for p in range(info["ranks"]) if stage in cfg.stage_ids(p, info["ranks"]))

    def step(self, inputs: list[torch.Tensor]) -> torch.Tensor:
        pm = self.pm
        losses: list[torch.Tensor] = []
        target = torch.zeros(self.m, device=pm.device)
        reducer = pm._reducer
        if pm.zero is not None:
            pm.zero.reset()
        with (pm.no_sync() if reducer is not None else contextlib.nullcontext()):
            if reducer is not None:
                reducer.reset()
            self.schedule.step(*inputs, target=target, losses=losses, return_outputs=False)
        for name, group in self.ties:
            self._sum_tied(name, group)
        if reducer is not None:
            reducer.reduce_now()
        loss = torch.stack([x.detach().float() for x in losses]).sum() if losses else \
            torch.zeros((), device=pm.device)
        if self.group is not None:
            dist.broadcast(loss, src=self.last_rank, group=self.group)
        return loss

    def _sum_tied(self, name: str, group) -> None:
        pm = self.pm
        if pm.zero is not None:
            grad = pm.zero.tied_grad(name)
        else:
            p = getattr(pm, name)
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grad = p.grad
        if grad is not None:
            dist.all_reduce(grad, group=group)


def split_check(pm, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The forward's tensor inputs of one whole (unit) batch, checked: batched inputs have M
    times the traced micro-batch rows, the others their traced shape."""
    m = max(1, getattr(pm, "MICROBATCHES", 1))
    batched = set(pm.BATCHED)
    bound = dict(arguments.bind(pm, args, kwargs))
    out = []
    for name, shape, dtype in pm.INPUTS:
        x = bound[name]
        want = (shape[0] * m, *shape[1:]) if name in batched else tuple(shape)
        if isinstance(x, torch.Tensor) and tuple(x.shape) != want and name in batched:
            raise InputMismatchError(
                f"input {name!r} has {x.shape[0]} rows but train_step takes the unit's whole "
                f"batch: {m} micro-batches of {shape[0]} = {want[0]} rows (traced with "
                f"{dtype}{list(want)}); pass a batch of {want[0]} rows or compile with "
                f"another pas_config['microbatches']")
        out.append(pm._check_input(name, x, want, dtype))
    return out


def accumulate(pm, inputs: list[torch.Tensor]) -> torch.Tensor:
    """Plans without stages: forward and backward per micro-batch, (loss_m / M), gradients
    reduced once with the last one."""
    from torch.utils import _pytree as pytree
    m = max(1, getattr(pm, "MICROBATCHES", 1))
    batched = set(pm.BATCHED)
    total = torch.zeros((), device=pm.device)
    for i in range(m):
        mb = [x.chunk(m)[i] if name in batched and m > 1 else x
              for x, (name, _, _) in zip(inputs, pm.INPUTS)]
        ctx = pm.no_sync() if i < m - 1 else contextlib.nullcontext()
        with ctx:
            out = pm._run(mb)
            loss = next((t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)
                         and t.dim() == 0 and t.is_floating_point()), None)
            if loss is None:
                raise ConfigError("train_step trains on forward's loss, but forward returned "
                                  "no scalar floating-point tensor; return the loss (alone or "
                                  "first among the outputs)")
            (loss / m).backward()
        total += loss.detach().float() / m
    return total
