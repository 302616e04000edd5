"""The conformance suite's loop: train like a user, under a plan and on one device, and compare.

One training script, `train_rank`, runs on every rank of a plan (threads of one process through
`nncompile.tools.simulate.run_ranks`, or torchrun processes where threads cannot be exact) and
records what a user logs; `run_reference` runs the same loop on one device. The loop has what
real scripts have (nanoGPT's train.py, Hugging Face's Trainer):

- AdamW over two parameter groups built from `pm.named_parameters()` (weight decay on tensors
  with dim >= 2, none on the rest) through `nncompile.build_optimizer(pm, AdamW, params=groups)`;
- a warmup + cosine `LambdaLR`; `nncompile.clip_grad_norm_`;
- gradient accumulation over 2 micro-batches (`pm.no_sync()` for the first; a pipeline's
  `train_step` splits its batch into the plan's 2 micro-batches);
- `pm.eval()` + `torch.no_grad()` validation every `eval_every` steps, then `pm.train()`;
- a checkpoint after step `ckpt_at` in every format (sharded, deduped, dcp, and a merged file
  made from the sharded one), each resumed into a fresh pm + optimizer + scheduler that runs
  the rest of the loop; the merged file is also resumed by the original module and a plain
  `torch.optim.AdamW` on one device ("merged->1dev"); where a cell lists "pretrained",
  `nncompile.save_pretrained`'s files are loaded by `load_pretrained` into a fresh pm whose
  weights were scrambled, which goes on with a fresh AdamW (Hugging Face files hold weights
  only; the scheduler keeps its state), against one device loading the same files;
- dropout > 0 (a nanoGPT-shaped GPT with embedding, attention and residual dropout, whose
  attention reads `self.training` as nanoGPT's does) and a BatchNorm model.

What is compared, per rank against its unit's reference: every step's logged train loss
(the sum of the micro-batches' `loss / accum`), the gradient norm `clip_grad_norm_` returns,
every validation loss, the final weights (`pm.gather_params()`), BatchNorm's running
statistics, and the same after each resume.

The reference. A plan unit (plan_ngpus ranks) computes what one device computes on the unit's
batch, so for one unit the reference is one device running the loop on that batch. With U
data-parallel units, each unit runs its own rows and the reducer averages the gradients, which
is one device on the concatenated batch for a mean loss -- except for what depends on the
unit: dropout and BatchNorm. Every rank is seeded alike at each step (as docs/concepts.md
asks; a plan unit needs it), so each unit draws its masks from the *same* generator state on
its own rows, which one device on the concatenated batch does not do (it draws one mask for
all rows). BatchNorm normalizes by each unit's own batch statistics and keeps each unit's own
running statistics (DDP without SyncBatchNorm); a sharded checkpoint keeps each unit's, the
other formats the first unit's, so after resuming them every unit starts from those
(docs/concepts.md), and so does the reference. So the reference is one device that runs, for
each unit u in turn, u's micro-batches from the step's generator state with u's running
statistics, backward of `loss / accum / U` (the average the reducer takes), and then one
clip + optimizer step: exactly the concatenated-batch reference when nothing depends on the
unit, and what DDP with ranks seeded alike computes when something does. Train and validation
losses are compared per unit, BatchNorm statistics per unit, weights on every rank.

Threads or processes. Threaded simulated ranks are exact where every random draw goes through
`nncompile.runtime.program.rng`, which gives each thread its own generator: every plan with
plan_ngpus >= 2 (dropout drawn as `rng.dropout` of the full tensor). Under plan_ngpus = 1 the
generated code calls `aten.dropout` on the process's one default generator, which threads
would share (racing), so dropout under a plan-1 `dp` plan runs as torchrun processes, with the
pipelines (which need a real process group) and torch.compile (not thread-safe): one launch,
tests/workers/conformance.py.

Tolerance. Losses, gradient norms and validation losses: rtol 1e-5, atol 1e-6 (float32).
Weights and running statistics: per tensor, |got - want| <= atol + weight_rtol * max|want|
(5e-4 of the tensor's scale), because a plan adds its float32 sums in another order (the
all-reduce, k-split matmuls, ZeRO's flat pieces) and AdamW amplifies that: its first update is
lr * g / (|g| + eps), so an element whose gradient is near eps (1e-8) turns a rounding
difference d of its gradient into lr * d / eps. Measured on tp 2 x 4 with dropout: step-0
gradients agree to 4e-7 of each tensor's largest, yet after 2 steps c_proj differs by 9e-6
(1.3e-4 of its scale), then stays there; 5e-4 leaves a 4x margin. The bugs this suite is for
land far outside: one group's weight decay ignored moves LayerNorm weights by ~1e-3 per step
(and a 2-D weight of scale 0.1 by 3e-3 of its scale in 6 steps); the schedule not reaching a
group by ~lr * (1 - lr_lambda).

Float8 cells (Loop.float8) compare with one device running torchao's float8 on the same
layers. float8's rounding can turn a plan's float32 reordering (~1e-7) into a flipped float8
value, which AdamW at lr 1e-2 amplifies (a tp 2 GPT's gradients from equal weights: 1e-6 at
most steps, up to 2e-2 of a tensor's scale at some); so float8_tp trains at lr 1e-3, and both
run on one intra-op thread (one_thread_for_float8). They then agree to 4e-7.

    python tests/conformance.py --matrix     # run every cell, print plan x feature -> max error
"""
from __future__ import annotations

import contextlib
import copy
import math
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import nncompile  # noqa: E402
from conformance_models import VOCAB, BNNet, TinyGPT, TinyMoE  # noqa: E402

FORMATS = ("sharded", "deduped", "dcp", "merged")
PRETRAINED = "pretrained"       # save_pretrained / load_pretrained: weights only
SEED = 1234


def build_model(loop: "Loop", reference: bool = False) -> nn.Module:
    """The loop's model; the one-device `reference` runs torchao's float8 where the loop
    asks for it (the plan converts the same layers: nncompile.float8_module_filter)."""
    torch.manual_seed(0)
    if loop.model == "bn":
        return BNNet().train()
    if loop.model == "moe":
        return TinyMoE(loop.dropout, layers=loop.layers).train()
    model = TinyGPT(loop.dropout, layers=loop.layers, fused=loop.model == "gpt_fused").train()
    for name in loop.freeze:
        model.get_submodule(name).requires_grad_(False)
    if reference and loop.float8:
        from torchao.float8 import convert_to_float8_training
        from nncompile.runtime.program.float8 import recipe_config
        convert_to_float8_training(model, config=recipe_config(loop.float8, emulate=True),
                                   module_filter_fn=nncompile.float8_module_filter(
                                       float8_spec(loop)))
    return model


def float8_spec(loop: "Loop") -> "nncompile.Float8Spec | None":
    """The plan's float8: every linear but the (tied) head, small as they are."""
    return nncompile.Float8Spec(loop.float8, filter="all") if loop.float8 else None


# ---- the loop -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Loop:
    model: str = "gpt"              # "gpt" (TinyGPT), "gpt_fused" (its fused c_attn), "bn" or
    #                                 "moe" (TinyMoE: Mixtral's experts)
    dropout: float = 0.0
    layers: int = 2                 # of gpt and moe (4: two stages per pipeline rank at pp 2)
    steps: int = 6
    accum: int = 2                  # micro-batches per optimizer step
    sizes: tuple = ((4, 16),)       # (rows, seq) of a unit's micro-batch, by step % len
    eval_every: int = 2             # validate after steps 1, 3, 5
    ckpt_at: int = 3                # checkpoint after this many steps, resume from it
    lr: float = 1e-2
    warmup: int = 2
    weight_decay: float = 0.1
    clip: float = 0.5               # below the gradient norm of most steps: clipping bites
    formats: tuple = FORMATS        # checkpoint formats saved at ckpt_at and resumed
    val_micro: int = 1              # micro-batches in a validation batch (a pipeline
                                    # evaluates the unit's whole batch: accum)
    float8: str | None = None       # torchao's float8 recipe for the linears (the reference
                                    # converts them with convert_to_float8_training)
    freeze: tuple = ()              # submodules frozen (requires_grad_(False)) before
                                    # parallelize, as LoRA's base weights or a fixed table


def lr_lambda(loop: Loop):
    def f(it: int) -> float:                         # warmup, then cosine down to 0.1
        if it < loop.warmup:
            return (it + 1) / loop.warmup
        progress = min(1.0, (it - loop.warmup) / max(1, loop.steps - loop.warmup))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))
    return f


def micro_batch(loop: Loop, step: int, micro: int, unit: int) -> dict[str, torch.Tensor]:
    """Unit `unit`'s micro-batch `micro` of step `step` (step < 0: a validation batch)."""
    rows, seq = loop.sizes[step % len(loop.sizes)] if step >= 0 else loop.sizes[0]
    g = torch.Generator().manual_seed(10_000 + 1000 * step + 100 * micro + unit)
    if loop.model == "bn":
        x = torch.randn(rows, 16, generator=g)
        proj = torch.Generator().manual_seed(7)
        y = (x @ torch.randn(16, 8, generator=proj)).argmax(-1)
        return {"x": x, "y": y}
    seq_ = (torch.randint(0, VOCAB, (rows, 1), generator=g) + torch.arange(seq + 1)) % VOCAB
    noise = torch.rand(rows, seq + 1, generator=g) < 0.2            # some unpredictable tokens
    seq_ = torch.where(noise, torch.randint(0, VOCAB, seq_.shape, generator=g), seq_)
    return {"idx": seq_[:, :-1].contiguous(), "targets": seq_[:, 1:].contiguous()}


def unit_batch(loop: Loop, step: int, unit: int) -> dict[str, torch.Tensor]:
    """A unit's whole batch of one step: its micro-batches concatenated (pipelines)."""
    parts = [micro_batch(loop, step, m, unit) for m in range(loop.accum)]
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


def val_batch(loop: Loop, unit: int) -> dict[str, torch.Tensor]:
    parts = [micro_batch(loop, -1, m, unit) for m in range(loop.val_micro)]
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


def param_groups(named, weight_decay: float) -> list[dict]:
    """nanoGPT's configure_optimizers: decay on 2-D+ tensors, none on biases and norms."""
    params = [(n, p) for n, p in named if p.requires_grad]
    return [{"params": [p for _, p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for _, p in params if p.dim() < 2], "weight_decay": 0.0}]


def make_optimizer(loop: Loop, pm) -> torch.optim.Optimizer:
    return nncompile.build_optimizer(pm, torch.optim.AdamW,
                                     params=param_groups(pm.named_parameters(),
                                                         loop.weight_decay),
                                     lr=loop.lr, betas=(0.9, 0.95))


def make_reference_optimizer(loop: Loop, model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(param_groups(model.named_parameters(), loop.weight_decay),
                             lr=loop.lr, betas=(0.9, 0.95))


# ---- plans --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Cell:
    """One plan (and loop) of the matrix."""
    name: str
    policy: str
    plan: int
    runtime: int
    loop: Loop = Loop()
    zero: int = 0
    offload: bool = False
    offload_params: bool = False    # ZeRO-3's parameter pieces in host memory too
    stages: int = 0                 # pipeline_stages (microbatches = loop.accum)
    schedule: str = "1f1b"          # the pipeline schedule (with stages)
    dynamic: bool = False
    cp: int = 1                     # context_parallel: ranks splitting the sequence
    ep: int = 1                     # expert_parallel: ranks splitting tokens and experts
    recompute: tuple = ()           # recompute_modules (checkpoint regions, lower_recompute)
    compile: bool = False
    process: bool = False           # torchrun processes (tests/workers/conformance.py)
    rtol: float = 1e-5              # losses and norms
    atol: float = 1e-6
    weight_rtol: float = 5e-4       # weights and buffers: of the tensor's largest element

    @property
    def units(self) -> int:
        return self.runtime // self.plan


DROP = Loop(dropout=0.1)
DYN = Loop(dropout=0.1, sizes=((4, 16), (2, 8)))
BN = Loop(model="bn")
FUSED = Loop(model="gpt_fused", dropout=0.1)
MOE = Loop(model="moe", dropout=0.1)           # attention dropout
HF = (*FORMATS, PRETRAINED)                     # and Hugging Face files out and back in
# Threaded cells under plan_ngpus 1 have no dropout (see "Threads or processes"); dp_dropout
# runs it as processes. The compile cell saves no checkpoint: every resumed pm would compile
# again (the checkpoint is the same code with or without compile).
CELLS = [
    Cell("dp", "dp", 1, 2),
    Cell("data", "data", 2, 2, DROP),
    Cell("tp", "tp", 2, 2, replace(DROP, formats=HF)),
    Cell("tp_sp", "tp_sp", 2, 2, DROP),
    Cell("autodist", "autodist", 2, 2, DROP),
    Cell("zero1", "dp", 1, 2, zero=1),
    Cell("zero2", "tp", 2, 4, DROP, zero=2),
    Cell("zero3", "tp", 2, 4, replace(DROP, formats=HF), zero=3),
    Cell("zero3_dp", "dp", 1, 2, zero=3),
    Cell("offload", "tp", 2, 4, DROP, zero=1, offload=True),
    # ZeRO-3 with both offloads: the pieces, gradients and optimizer state in host memory,
    # the host step on the optimizer's fused kernel
    Cell("zero3_offload", "tp", 2, 4, DROP, zero=3, offload=True, offload_params=True),
    # parameters frozen before parallelize: the position table a ZeRO-3 unit of its own, h.0's
    # attention a frozen unit beside its block's trainable one
    Cell("zero3_frozen", "tp", 2, 4, replace(DROP, freeze=("wpe", "h.0.attn")), zero=3),
    Cell("dynamic", "tp", 2, 2, DYN, dynamic=True),
    # nanoGPT's fused c_attn: tp holds parts of it; checkpoints give back the fused layout
    Cell("tp_fused", "tp", 2, 2, FUSED),
    Cell("zero3_fused", "tp", 2, 4, FUSED, zero=3),
    # BatchNorm's backward subtracts batch means (cancellation), so a reordered sum shows ~10x
    # more in the gradient norm: measured 1.05e-5 relative under `data` with two intra-op
    # threads; 1e-4 keeps a 10x margin and stays far below a wrong loop's 1e-3
    Cell("bn_dp", "dp", 1, 2, BN, rtol=1e-4),
    Cell("bn_data", "data", 2, 2, BN, rtol=1e-4),
    Cell("bn_tp", "tp", 2, 2, BN, rtol=1e-4),
    # the sequence split along cp (ring-free: k and v gathered), with data parallelism
    Cell("cp_dp", "tp", 2, 4, DROP, cp=2),
    Cell("cp_tp", "tp", 4, 4, cp=2),
    Cell("cp_zero3", "tp", 2, 4, cp=2, zero=3),
    # ZeRO over the context ranks alone (they hold the same parameters): no data parallelism
    Cell("cp_zero1", "tp", 2, 2, DROP, cp=2, zero=1),
    Cell("cp_zero2", "tp", 4, 4, cp=2, zero=2),
    # ZeRO-3 gathers inside recomputed blocks (lower_zero3 + lower_recompute); the recompute
    # draws the forward's dropout masks again (rng.recompute_draws)
    Cell("zero3_recompute", "tp", 2, 4, DROP, zero=3, recompute=("Block",)),
    Cell("cp_dynamic", "tp", 2, 2, DYN, dynamic=True, cp=2),
    # Mixtral's experts split across the plan (2 of 4 per rank), with its router loss, data
    # parallelism and ZeRO-3 of the expert weights
    Cell("experts_zero3", "tp", 2, 4, replace(MOE, formats=HF), zero=3),
    # expert parallelism (tokens dispatched by all-to-all): ep 2 x dp 2 with ZeRO-3, and an
    # ep axis of 2 beside 2 tensor ranks (attention split by heads)
    Cell("ep_dp_zero3", "data", 2, 4, MOE, ep=2, zero=3),
    Cell("ep_tp", "tp", 4, 4, replace(MOE, formats=HF), ep=2),
    # torchrun processes, one launch of 2 ranks
    Cell("dp_dropout", "dp", 1, 2, DROP, process=True),
    Cell("compile", "tp", 2, 2, replace(DROP, formats=()), compile=True, process=True),
    Cell("float8_tp", "tp", 2, 2, Loop(float8="tensorwise", lr=1e-3)),
    Cell("float8_zero3", "tp", 2, 4, Loop(float8="rowwise"), zero=3),
    # tensorwise under ZeRO-3: the weights gathered in float8 (runtime/store/zero_float8.py)
    Cell("float8_zero3_gather", "tp", 1, 2, Loop(float8="tensorwise", lr=1e-3), zero=3),
    Cell("pp", "tp", 2, 2, Loop(val_micro=2, formats=HF), stages=2, process=True),
    Cell("pp_dropout", "tp", 2, 2, replace(DROP, val_micro=2), stages=2, process=True),
    # the sequence split in two inside each of two pipeline stages
    Cell("pp_cp", "tp", 4, 4, Loop(val_micro=2), stages=2, cp=2, process=True),
    # DualPipeV (2 stages per rank, overlapped forward/backward steps, 4 micro-batches): with
    # dropout, and with Mixtral's experts dispatched along ep 2 inside each stage
    Cell("pp_dualpipev", "tp", 2, 2, replace(DROP, accum=4, val_micro=4, layers=4,
                                             formats=("dcp",)),
         stages=2, schedule="dualpipev", process=True),
    # (no validation: Mixtral's eval-mode forward differs beyond dropout, which a pipeline
    # refuses; see test_pipeline)
    Cell("pp_dualpipev_ep", "data", 4, 4, replace(MOE, accum=4, layers=4, steps=3,
                                                  eval_every=99, formats=()),
         stages=2, ep=2, schedule="dualpipev", process=True),
]
BY_NAME = {c.name: c for c in CELLS}


def compute_config(cell: Cell) -> nncompile.ComputeConfig:
    pas = {"pp": cell.stages, "schedule": cell.schedule,
           "microbatches": cell.loop.accum} if cell.stages else {}
    pas.update({k: v for k, v in (("cp", cell.cp), ("ep", cell.ep))
                if v > 1})
    if cell.recompute:
        pas["recompute_modules"] = list(cell.recompute)
    return nncompile.ComputeConfig(cell.plan, cell.runtime, use_zero=cell.zero,
                                   offload_optimizer=cell.offload,
                                   offload_params=cell.offload_params, compile=cell.compile,
                                   parallel=pas, float8=float8_spec(cell.loop))


def parallelize(cell: Cell, model: nn.Module, savedir: Path):
    loop = cell.loop
    dummy = unit_batch(loop, 0, 0) if cell.stages else micro_batch(loop, 0, 0, 0)
    dyn = None
    if cell.dynamic:
        dims = {0: "batch", 1: "seq"}
        dyn = {"idx": dims, "targets": dims}
    return nncompile.parallelize(model, dummy, compute_config(cell), pas_policy=cell.policy,
                                 gen_savedir=savedir / "gen", instance_name=cell.name,
                                 dynamic_dims=dyn)


# ---- one rank's script ------------------------------------------------------------------------
@contextlib.contextmanager
def seeded(step: int, threaded: bool):
    """Every rank seeded alike at each step (a user's torch.manual_seed); a simulated rank
    (a thread) draws from a generator of its own with that state (runtime/program/rng.py)."""
    if threaded:
        from nncompile.runtime.program import rng
        with rng.rank_generator(torch.Generator().manual_seed(SEED + step).get_state()):
            yield
    else:
        torch.manual_seed(SEED + step)
        yield


def full_buffers(pm) -> dict[str, torch.Tensor]:
    """BatchNorm's running statistics by FQN, whole (gathered along the plan unit)."""
    from nncompile.ir.placement import Shard
    from nncompile.rows import buffer_rows
    out = {}
    for row in buffer_rows(pm):
        t = getattr(pm, row.name).detach()
        if isinstance(row.placement, Shard) and pm.plan_group is not None:
            parts = [torch.empty_like(t) for _ in range(pm.PLAN_NGPUS)]
            dist.all_gather(parts, t.contiguous(), group=pm.plan_group)
            t = torch.cat(parts, dim=row.placement.dim)
        if t.is_floating_point():
            out[row.fqn] = t.clone()
    return out


def run_steps(cell: Cell, pm, opt, sched, unit: int, start: int, threaded: bool,
              save=None) -> dict:
    """The loop from step `start` to the end; returns what it logged."""
    loop = cell.loop
    rec = {"train": {}, "norm": {}, "val": {}}
    for step in range(start, loop.steps):
        with seeded(step, threaded):
            if cell.stages:
                loss = pm.train_step(**unit_batch(loop, step, unit)).item()
            else:
                loss = 0.0
                for m in range(loop.accum):
                    ctx = pm.no_sync() if m < loop.accum - 1 else contextlib.nullcontext()
                    with ctx:
                        part = pm(**micro_batch(loop, step, m, unit)) / loop.accum
                        part.backward()
                    loss += part.item()
        rec["train"][step] = loss
        rec["norm"][step] = float(nncompile.clip_grad_norm_(pm, loop.clip))
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if (step + 1) % loop.eval_every == 0:
            pm.eval()
            with torch.no_grad():
                rec["val"][step] = pm(**val_batch(loop, unit)).item()
            pm.train()
        if save is not None and step + 1 == loop.ckpt_at:
            save(step + 1)
    rec["weights"] = pm.gather_params()
    if loop.model == "bn":
        rec["buffers"] = full_buffers(pm)
    return rec


def train_rank(cell: Cell, model: nn.Module, workdir: Path, threaded: bool) -> dict:
    """Everything one rank does for a cell: train with a checkpoint at ckpt_at, then resume
    each format into a fresh pm + optimizer + scheduler. Returns the rank's records."""
    rank = dist.get_rank()
    unit = rank // (cell.plan)
    ckpt = workdir / "ckpt"
    pm = parallelize(cell, copy.deepcopy(model), workdir)
    opt = make_optimizer(cell.loop, pm)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cell.loop))

    at_ckpt = {}

    def save(step):
        extra = {"step": step, "sched": sched.state_dict()}
        at_ckpt.update(extra)
        if PRETRAINED in cell.loop.formats:
            nncompile.save_pretrained(pm, ckpt / PRETRAINED)
        for fmt in ("sharded", "deduped", "dcp"):
            if fmt in cell.loop.formats or (fmt == "sharded" and "merged" in cell.loop.formats):
                nncompile.save_checkpoint(ckpt / fmt, pm, opt, format=fmt, extra=extra)
        if rank == 0 and "merged" in cell.loop.formats:
            nncompile.merge_checkpoint([ckpt / "sharded"], ckpt / "merged.pt")
        dist.barrier()

    out = {"rank": rank, "unit": unit}
    out.update(run_steps(cell, pm, opt, sched, unit, 0, threaded,
                         save if cell.loop.formats else None))
    for fmt in cell.loop.formats:
        try:
            pm2 = parallelize(cell, copy.deepcopy(model), workdir)
            opt2 = make_optimizer(cell.loop, pm2)
            sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, lr_lambda(cell.loop))
            path = ckpt / ("merged.pt" if fmt == "merged" else fmt)
            if fmt == PRETRAINED:
                with torch.no_grad():                       # a load that misses one shows
                    for p in pm2.stored_parameters():
                        p.normal_()
                nncompile.load_pretrained(pm2, path)
                extra = at_ckpt
            else:
                extra = nncompile.load_checkpoint(path, pm2, opt2)
            sched2.load_state_dict(extra["sched"])
            out[f"resume:{fmt}"] = run_steps(cell, pm2, opt2, sched2, unit, extra["step"],
                                             threaded)
        except Exception as e:                               # noqa: BLE001 - reported
            out[f"resume:{fmt}"] = {"error": _short(e)}
    return out


def _short(e: BaseException) -> str:
    while isinstance(e.__cause__, BaseException) and "simulated rank" in str(e):
        e = e.__cause__
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]


@contextlib.contextmanager
def one_thread_for_float8(loop: Loop):
    """A float8 loop's plan and reference run on one intra-op thread, as xdist's workers and
    torchrun's ranks do: under another thread count the plan's float32 sums are reordered
    otherwise, and float8's rounding can turn that into a flipped value (docs/float8.md)."""
    threads = torch.get_num_threads()
    if loop.float8:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def run_plan(cell: Cell, workdir: Path) -> list[dict]:
    """Every rank's records for a threaded cell (raises what a rank raised)."""
    from nncompile.tools.simulate import run_ranks
    model = build_model(cell.loop)
    workdir.mkdir(parents=True, exist_ok=True)
    with one_thread_for_float8(cell.loop):
        return run_ranks(cell.runtime, lambda r: train_rank(cell, model, workdir, True))
