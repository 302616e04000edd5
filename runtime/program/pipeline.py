"""train_step: one optimizer step's forward and backward over micro-batches.

Pipelined plans (the generated class has PIPELINE and STAGES) run on PyTorch's own pipeline
runtime: each of this rank's `stage_k` methods becomes a `PipelineStage` (with the stage's
input/output shapes from the generated file, so no shape inference runs), and torch's
action-list runtime (`_PipelineScheduleRuntime`) splits the unit's batch into micro-batches
and runs the file's ACTIONS: this rank's forwards, backwards, sends and receives in the order
passes/pipeline_schedule.py wrote (the order torch's schedule class of that name runs:
GPipe, 1F1B, interleaved 1F1B, interleaved zero-bubble, ZB-V), activations and their
gradients going between neighbouring stages over the pipeline group. Each micro-batch's loss is
divided by M before its backward, so the gradients are those of one device accumulating
`(loss_m / M).backward()` over the same micro-batches. After the schedule:

    tied weights       their gradient summed over the stages that use them (Megatron's
                       embedding / lm_head all-reduce), so the copies stay equal
    data parallelism   the reducer's buckets reduced once (ZeRO-3 already reduce-scattered
                       each unit's gradient in backward)
    the loss           the mean over micro-batches, sent from the last stage to every rank

Plans without stages accumulate over `microbatches` micro-batches (no_sync on all but the
last), so a loop written with train_step runs under every plan.

Random ops (dropout, attention dropout) draw what one device draws. One device running the
micro-batches in order draws stage 0's noise of micro-batch 0, then stage 1's, ..., then
micro-batch 1's; each stage here runs on its own rank with its own generator, in the
schedule's order. Shapes are static, so the generated file lists every stage's draws
(PIPELINE["draws"]); at the start of a training-mode step each rank replays them all
(rng.replay: draw and discard) and keeps the generator state at which each of its
(micro-batch, stage) forwards starts, sets it before that forward, and ends in the state one
device ends in, so later steps and evaluation agree:

    before: stage 1's forward of micro-batch 0 starts where rank 1's generator happens to be
    after:  it starts where one device is after micro-batch 0's stage-0 draws

Tensor-parallel ranks of a stage replay alike and draw the same full masks (rng.py). Cost per
step, only when the plan draws and the module is in training mode: every rank generates the
noise of the whole model's dropouts for all M micro-batches once more (what one device
generates in its forwards), and keeps one generator state per (micro-batch, own stage).

Inference: `pm(...)` under torch.no_grad() or after pm.eval() runs the stages forward only
(`evaluate`: GPipe's forward phase, activations sent on between neighbouring stages), in the
mode pm is in, and returns the mean loss over the micro-batches on every rank, as train_step
does.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from nncompile import compat
from nncompile.errors import ConfigError, InputMismatchError
from nncompile.ir.schedule import parse_actions
from nncompile.pipeline_config import PipelineConfig
from nncompile.rows import param_rows
from nncompile import arguments

from . import rng
from ..store import user_hooks
from ..store.view_grads import hold_view_hooks, run_view_hooks
from ..store.pieces import local_parameters
from ..protocol.groups import pipe_group, tie_group


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


class FloatCarriedStage(StageModule):
    """A stage whose integer boundary tensors (token ids, masks sent on to a later stage) cross
    as float64, for torch releases whose PipelineStage makes every received buffer require
    grad (compat.pipeline_stages_send_integers). Values stay exact (|x| < 2**53); each such
    input is restored to its dtype and joins the first grad-requiring output times zero, so
    its buffer gets the zero gradient torch sends back. A floating input that needs no
    gradient (class weights, a float mask) is detached the same way, so ops that refuse a
    grad-requiring argument (cross_entropy's `weight`) take it:

        before: stage 1 receives idx (int64) -> "only Tensors of floating point dtype ..."
        after:  stage 0 sends idx.to(float64); stage 1 runs on idx.to(int64)
    """

    def __init__(self, inner: StageModule, restore: tuple, carried: tuple, frozen: tuple = ()):
        super().__init__(inner.pm, inner.index, inner.param_names)
        object.__setattr__(self, "inner", inner)  # runs the stage: wrappers of its fn apply
        self.restore = restore          # per input: its integer dtype, or None (floating)
        self.carried = carried          # per output: True where sent on as float64
        self.frozen = frozen + (False,) * (len(restore) - len(frozen))  # floating, no grad

    def forward(self, *inputs):
        cut = [dt is not None or f for dt, f in zip(self.restore, self.frozen)]
        anchors = [x for x, c in zip(inputs, cut) if c]
        inputs = tuple(x.detach().to(dt) if dt is not None else x.detach() if c else x
                       for x, dt, c in zip(inputs, self.restore, cut))
        out = self.inner(*inputs)
        single = not isinstance(out, (tuple, list))
        outs = [out] if single else list(out)
        i = next((i for i, o in enumerate(outs)
                  if isinstance(o, torch.Tensor) and o.requires_grad), None)
        outs = [(o.to(torch.float64) if i is None else _Carried.apply(o, outs[i])) if flag else o
                for o, flag in zip(outs, self.carried + (False,) * len(outs))]
        if anchors and torch.is_grad_enabled():
            if i is not None:
                zero = sum((a * 0).sum() for a in anchors)   # a contiguous zero gradient:
                outs[i] = outs[i] + zero.to(outs[i].dtype)  # torch 2.11 sends it as it is
        return outs[0] if single else tuple(outs)


class _Carried(torch.autograd.Function):
    """An integer output as float64 on `ref`'s autograd graph (ref gets a zero gradient): the
    schedules' split backward (zero-bubble) differentiates every stage output."""

    @staticmethod
    def forward(ctx, x, ref):
        ctx.like = (ref.shape, ref.dtype, ref.device)
        return x.to(torch.float64)

    @staticmethod
    def backward(ctx, grad):
        shape, dtype, device = ctx.like
        return None, torch.zeros(shape, dtype=dtype, device=device)


def _float_carried(meta):
    """The boundary metadata as sent: integer and bool tensors as float64."""
    shape, dtype, grad = meta
    return (shape, "float64", grad) if _integer(dtype) else meta


def _integer(dtype: str) -> bool:
    return not getattr(torch, dtype).is_floating_point and not getattr(torch, dtype).is_complex


def _stage_class():
    PipelineStage = compat.pipeline_stage_class()

    class Stage(PipelineStage):
        """A PipelineStage that tells the runtime which micro-batch's forward starts."""

        def forward_one_chunk(self, fwd_chunk_id, *args, **kwargs):
            hook = getattr(self, "before_forward", None)
            if hook is not None:
                hook(fwd_chunk_id, self.stage_index)
            return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
    return Stage


def _example(meta, device) -> torch.Tensor:
    shape, dtype, grad = meta
    return torch.empty(shape, dtype=getattr(torch, dtype), device="meta",
                       requires_grad=grad)


class PipelineRuntime:
    """This rank's stages, its pipeline group, the tie groups and the torch schedule."""

    def __init__(self, pm):
        from torch.distributed.pipelining.microbatch import TensorChunkSpec, _Replicate
        info = pm.PIPELINE
        self.pm = pm
        self.info = info
        self.m = info["microbatches"]
        self.group, self.ranks = pipe_group(pm.PLAN_NGPUS, pm.RUNTIME_NGPUS, pm.PIPE_RANKS,
                                            pm.mesh_axes)
        self.last_rank = self.ranks[self._pipe_of(info["stages"] - 1)]   # holds the loss
        self.ties = []
        rows = {row.fqn: row.name for row in param_rows(pm)}
        for fqn, stages in info["tied"].items():       # every rank: creating groups is collective
            pipes = tuple(sorted({self._pipe_of(s) for s in stages}))
            if len(pipes) < 2:
                continue                               # used twice on one rank: one copy
            group = tie_group(pipes, pm.PLAN_NGPUS, pm.RUNTIME_NGPUS, pm.PIPE_RANKS,
                              pm.mesh_axes)
            if group is not None and fqn in rows:
                self.ties.append((rows[fqn], group))
        self.modules = [StageModule(pm, s, params) for s, _, _, _, _, params in pm.STAGES]
        stage_cls = _stage_class()
        self.draws = {int(s): d for s, d in info.get("draws", {}).items()}
        self.rng_states: dict | None = None
        carry = not compat.pipeline_stages_send_integers()
        last = info["stages"] - 1

        def stage_module(mod, s, ins, outs):
            if not carry:
                return mod, ins, outs
            restore = tuple(getattr(torch, dt) if s > 0 and _integer(dt) else None
                            for _, dt, _ in ins)
            frozen = tuple(s > 0 and not _integer(dt) and not grad for _, dt, grad in ins)
            carried = tuple(s < last and _integer(dt) for _, dt, _ in outs)
            if all(r is None for r in restore) and not any(carried) and not any(frozen):
                return mod, ins, outs
            ins = [_float_carried(x) if s > 0 else x for x in ins]
            outs = [_float_carried(x) if s < last else x for x in outs]
            return FloatCarriedStage(mod, restore, carried, frozen), ins, outs

        stages = []
        for mod, (s, _, _, ins, outs, params) in zip(self.modules, pm.STAGES):
            mod, ins, outs = stage_module(mod, s, ins, outs)
            stages.append(stage_cls(
                mod, s, info["stages"], pm.device,
                input_args=tuple(_example(x, pm.device) for x in ins),
                output_args=tuple(_example(x, pm.device) for x in outs), group=self.group))
        batched = set(info["batched"])
        spec = tuple(TensorChunkSpec(0) if name in batched else _Replicate()
                     for name, _, _ in pm.INPUTS)
        m = self.m

        def loss_fn(out, _target):
            return (out[0] if isinstance(out, (tuple, list)) else out) / m
        try:
            self.schedule = compat.action_list_schedule(
                stages, parse_actions(pm.ACTIONS), n_microbatches=m, loss_fn=loss_fn,
                args_chunk_spec=spec, scale_grads=False)
        except (ValueError, RuntimeError, AssertionError) as e:
            raise ConfigError(f"torch.distributed.pipelining's action-list runtime refused "
                              f"this rank file's ACTIONS ({info['schedule']!r}: "
                              f"{info['stages']} stages on {info['ranks']} pipeline ranks, "
                              f"{m} micro-batches): {e}") from e
        self.stages = stages
        for st in stages:
            st.before_forward = self._before_forward

    def _pipe_of(self, stage: int) -> int:
        info = self.info
        cfg = PipelineConfig(info["ranks"], info["schedule"], info["microbatches"],
                             info["stages_per_rank"])
        return next(p for p in range(info["ranks"]) if stage in cfg.stage_ids(p, info["ranks"]))

    # ---- random draws: each (micro-batch, stage) starts where one device starts it ---------
    @contextlib.contextmanager
    def _one_device_rng(self):
        """Around one schedule run: in training mode with dropout, every forward starts from
        one device's generator state and the run ends in one device's final state; in eval
        mode (one device draws nothing) the generator is left as it was."""
        gen = rng.generator_of(self.pm.device)
        if not self.pm.training:
            start = gen.get_state()
            try:
                yield
            finally:
                gen.set_state(start)
            return
        if not self.draws:               # nothing to replay (other random ops: see the warning
            yield                        # codegen/pipeline.py stage_draws gives at compile time)
            return
        mine = {s for s, *_ in self.pm.STAGES}
        states = {}
        for mb in range(self.m):          # one device's order: micro-batch by micro-batch
            for s in range(self.info["stages"]):
                if s in mine:
                    states[mb, s] = gen.get_state()
                rng.replay(self.draws.get(s, []), self.pm.device)
        end = gen.get_state()
        self.rng_states = (gen, states)
        try:
            yield
        finally:
            self.rng_states = None
        gen.set_state(end)

    def _before_forward(self, mb: int, stage: int) -> None:
        if self.rng_states is not None:
            gen, states = self.rng_states
            gen.set_state(states[mb, stage])

    def step(self, inputs: list[torch.Tensor]) -> torch.Tensor:
        pm = self.pm
        losses: list[torch.Tensor] = []
        target = torch.zeros(self.m, device=pm.device)
        reducer = pm._reducer
        if pm.zero is not None:
            pm.zero.reset()
        held = user_hooks.defer(p for _, p in local_parameters(pm))
        with (pm.no_sync() if reducer is not None else contextlib.nullcontext()), \
                hold_view_hooks(pm):
            if reducer is not None:
                reducer.reset()
            with self._one_device_rng():
                self.schedule.step(*inputs, target=target, losses=losses,
                                   return_outputs=False)
        for name, group in self.ties:
            self._sum_tied(name, group)
        if reducer is not None:
            reducer.reduce_now()
        user_hooks.run(held)          # once, on the step's complete gradients
        run_view_hooks(pm)
        return self._mean_loss(losses)

    def evaluate(self, inputs: list[torch.Tensor]) -> torch.Tensor:
        """Forward only: the mean loss over the micro-batches, on every rank (no gradients;
        the stages run in the mode pm is in).

        Each rank runs its stages in stage order, each over the micro-batches in order,
        receiving a stage's inputs from the rank of the stage before and sending its outputs
        on without waiting (GPipe's forward phase). Every input of stage s comes from a lower
        stage, which its rank runs first, so this order cannot deadlock under any placement
        (loop or V-shaped). Torch's `Schedule*.eval` is not used: the zero-bubble schedules'
        eval fails in torch.distributed.pipelining ("can't steal_bwd_input")."""
        pm = self.pm
        info = self.info
        last = info["stages"] - 1
        batched = set(info["batched"])
        mbs = [[x.chunk(self.m)[i] if name in batched else x
                for x, (name, _, _) in zip(inputs, pm.INPUTS)] for i in range(self.m)]
        mine = {row[0]: (mod, row[3]) for mod, row in zip(self.modules, pm.STAGES)}
        me = info["pipe_rank"]
        kept: dict[tuple[int, int], tuple] = {}      # outputs for a later stage on this rank
        sends, total = [], torch.zeros((), device=pm.device)
        if pm.zero is not None:
            pm.zero.reset()
        with torch.no_grad(), self._one_device_rng():
            for s in sorted(mine):
                mod, metas = mine[s]
                src = self._pipe_of(s - 1) if s > 0 else me
                dst = self._pipe_of(s + 1) if s < last else me
                for i in range(self.m):
                    if s == 0:
                        args = mbs[i]
                    elif src == me:
                        args = kept.pop((s, i))
                    else:
                        args = [torch.empty(shape, dtype=getattr(torch, dt), device=pm.device)
                                for shape, dt, _ in metas]
                        for t in args:
                            dist.recv(t, src=self.ranks[src], group=self.group,
                                      tag=(s - 1) * self.m + i)
                    self._before_forward(i, s)
                    out = mod(*args)
                    out = tuple(out) if isinstance(out, (tuple, list)) else (out,)
                    if s == last:
                        total += out[0].detach().float() / self.m
                    elif dst == me:
                        kept[s + 1, i] = out
                    else:
                        sends += [dist.isend(t.contiguous(), dst=self.ranks[dst],
                                             group=self.group, tag=s * self.m + i)
                                  for t in out]
            for work in sends:
                work.wait()
        if self.group is not None:
            dist.broadcast(total, src=self.last_rank, group=self.group)
        return total

    def _mean_loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        pm = self.pm
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
                f"another parallel.microbatches")
        out.append(pm._check_input(name, x, want, dtype))
    return out


def accumulate(pm, inputs: list[torch.Tensor]) -> torch.Tensor:
    """Plans without stages: forward and backward per micro-batch, (loss_m / M), gradients
    reduced once with the last one."""
    from torch.utils import _pytree as pytree
    m = max(1, getattr(pm, "MICROBATCHES", 1))
    batched = set(pm.BATCHED)
    total = torch.zeros((), device=pm.device)
    # without a reducer (which runs them after its reduction) the user's post-accumulate
    # hooks run once, after the last micro-batch (runtime/store/user_hooks.py)
    held = user_hooks.defer(p for _, p in local_parameters(pm)) \
        if pm._reducer is None and m > 1 else {}
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
    user_hooks.run(held)
    return total


def pipelined_forward(pm, args: tuple, kwargs: dict) -> torch.Tensor:
    """`pm(...)` on a pipelined plan: inference (under torch.no_grad() or after pm.eval()) runs
    the stages forward only on the unit's whole batch and returns the mean loss over the
    micro-batches on every rank; a training forward is refused (the stages run forward and
    backward together: train_step)."""
    from nncompile.errors import PipelineError
    info = pm.PIPELINE
    if torch.is_grad_enabled() and pm.training:
        raise PipelineError(
            f"this plan is pipelined ({info['ranks']} pipeline ranks, schedule "
            f"{info['schedule']!r}): a forward alone cannot train, since the stages run "
            "forward and backward together over micro-batches; call "
            "`loss = pm.train_step(*args, **kwargs)` instead of `pm(...)` + backward (for "
            "inference, call pm(...) under torch.no_grad() or after pm.eval())")
    if not pm.training and info.get("eval_differs"):
        raise PipelineError(
            "this model's forward differs in eval mode beyond its dropout (a branch on "
            "self.training, batch statistics), and a pipelined plan's stages hold the "
            "training-mode forward only; evaluate under a plan without a pipeline "
            "(a dcp checkpoint of this plan loads there) or in training mode under "
            "torch.no_grad()")
    pm._legacy_args()
    inputs = split_check(pm, args, kwargs)
    if pm.pipeline is None:
        raise ConfigError("a pipelined plan runs its stages in the process group it was loaded "
                          "in (torch.distributed.init_process_group first)")
    return pm.pipeline.evaluate(inputs)
