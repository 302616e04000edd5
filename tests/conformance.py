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
`nncompile.runtime.rng`, which gives each thread its own generator: every plan with
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
    if reference and loop.float8:
        from torchao.float8 import convert_to_float8_training
        from nncompile.runtime.float8 import recipe_config
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
                                   offload_optimizer=cell.offload, compile=cell.compile,
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
    (a thread) draws from a generator of its own with that state (runtime/rng.py)."""
    if threaded:
        from nncompile.runtime import rng
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


def run_plan(cell: Cell, workdir: Path) -> list[dict]:
    """Every rank's records for a threaded cell (raises what a rank raised)."""
    from nncompile.tools.simulate import run_ranks
    model = build_model(cell.loop)
    workdir.mkdir(parents=True, exist_ok=True)
    return run_ranks(cell.runtime, lambda r: train_rank(cell, model, workdir, True))


# ---- one device -------------------------------------------------------------------------
_REFS: dict = {}
_AT_CKPT: dict = {}         # (loop, units) -> the reference's state after ckpt_at steps


def run_reference(loop: Loop, units: int, resume_from: dict | None = None,
                  start: int = 0) -> list[dict]:
    """One device: per unit u, u's micro-batches from the step's generator state with u's
    BatchNorm statistics, backward of loss / accum / units; one clip + step. Returns each
    unit's records (weights alike). `resume_from`: a merged checkpoint to start from (every
    unit starts from its BatchNorm statistics)."""
    key = (loop, units)
    if resume_from is None and key in _REFS:
        return _REFS[key]
    model = build_model(loop, reference=True)
    opt = make_reference_optimizer(loop, model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(loop))
    if resume_from is not None:
        if resume_from["optimizer"] is None:     # Hugging Face files: weights, a tie once
            missing, extra = model.load_state_dict(resume_from["model"], strict=False)
            assert not extra and all(k in _tied(model) for k in missing), (missing, extra)
        else:
            model.load_state_dict(resume_from["model"])
            opt.load_state_dict(resume_from["optimizer"])
        sched.load_state_dict(resume_from["extra"]["sched"])
    bufs = [{k: v.clone() for k, v in model.named_buffers()} for _ in range(units)]

    def use(u):
        with torch.no_grad():
            for k, v in model.named_buffers():
                v.copy_(bufs[u][k])

    def keep(u):
        bufs[u] = {k: v.clone() for k, v in model.named_buffers()}

    recs = [{"unit": u, "train": {}, "norm": {}, "val": {}} for u in range(units)]
    for step in range(start, loop.steps):
        for u in range(units):
            use(u)
            torch.manual_seed(SEED + step)
            total = 0.0
            for m in range(loop.accum):
                part = model(**micro_batch(loop, step, m, u)) / loop.accum
                (part / units).backward()
                total += part.item()
            keep(u)
            recs[u]["train"][step] = total
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), loop.clip))
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        for r in recs:
            r["norm"][step] = norm
        if (step + 1) % loop.eval_every == 0:
            model.eval()
            with torch.no_grad():
                for u in range(units):
                    use(u)
                    recs[u]["val"][step] = model(**val_batch(loop, u)).item()
            model.train()
        if resume_from is None and step + 1 == loop.ckpt_at:     # as a merged file holds it
            use(0)
            _AT_CKPT[key] = copy.deepcopy({"model": model.state_dict(),
                                           "optimizer": opt.state_dict(),
                                           "extra": {"step": step + 1,
                                                     "sched": sched.state_dict()}})
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    for u, r in enumerate(recs):
        r["weights"] = weights
        if loop.model == "bn":
            r["buffers"] = {k: v for k, v in bufs[u].items() if v.is_floating_point()}
    if resume_from is None:
        _REFS[key] = recs
    return recs


def resumed_from_first_unit(loop: Loop, units: int) -> list[dict]:
    """The reference's rest of the loop after a resume that gives every unit the first unit's
    BatchNorm statistics (deduped, dcp, merged: docs/concepts.md)."""
    key = (loop, units, "first unit")
    if key not in _REFS:
        run_reference(loop, units)
        snap = _AT_CKPT[(loop, units)]
        _REFS[key] = run_reference(loop, units, snap, snap["extra"]["step"])
    return _REFS[key]


def _tied(model: nn.Module) -> set[str]:
    """State keys whose parameter another key also names."""
    names = dict(model.named_parameters(remove_duplicate=False))
    first = {}
    return {k for k, p in names.items() if first.setdefault(id(p), k) != k}


def pretrained_on_one_device(cell: Cell, workdir: Path) -> list[dict] | dict:
    """The reference's rest of the loop from save_pretrained's files (loaded into the original
    module on one device, as from_pretrained would), with a fresh AdamW and the scheduler's
    state at ckpt_at: per unit, as run_reference. Starting from the very weights the plan
    saved, the fresh optimizer's first update (lr * g / (|g| + eps), amplifying any difference)
    compares loading, not the rounding of the steps before."""
    from safetensors.torch import load_file
    from nncompile.pretrained_layout import find_pretrained
    path = workdir / "ckpt" / PRETRAINED
    try:
        found = find_pretrained(build_model(cell.loop))
        if found is None:
            weights = load_file(path / "model.safetensors")
        else:                           # a Hugging Face model inside: as a user reads it
            prefix, hf = found
            weights = {prefix + k: v for k, v in
                       type(hf).from_pretrained(path).state_dict().items()}
        run_reference(cell.loop, cell.units)
        snap = _AT_CKPT[(cell.loop, cell.units)]
        return run_reference(cell.loop, cell.units,
                             {"model": weights, "optimizer": None, "extra": snap["extra"]},
                             snap["extra"]["step"])
    except Exception as e:                                   # noqa: BLE001 - reported
        return {"error": _short(e)}


def merged_on_one_device(cell: Cell, workdir: Path) -> dict:
    """The merged checkpoint resumed by the original module and a plain AdamW (one device,
    per unit as run_reference); unit 0's records."""
    try:
        merged = torch.load(workdir / "ckpt" / "merged.pt", weights_only=True)
        return run_reference(cell.loop, cell.units, merged, merged["extra"]["step"])[0]
    except Exception as e:                                   # noqa: BLE001 - reported
        return {"error": _short(e)}


# ---- comparing ----------------------------------------------------------------------------
class Mismatch(AssertionError):
    """A recorded value differs from one device's; `row` is the cell's matrix row."""

    def __init__(self, message: str, row: dict):
        super().__init__(message)
        self.row = row


FEATURES = ("train", "norm", "val", "weights", "buffers",
            *(f"resume:{f}" for f in (*FORMATS, PRETRAINED)), "merged->1dev")


def _checks(rec: dict, ref: dict):
    """(what, kind, got, want) in the order they happened."""
    for step in sorted(ref["train"]):
        yield f"step {step} train loss", "train", rec["train"].get(step), ref["train"][step]
        yield f"step {step} grad norm", "norm", rec["norm"].get(step), ref["norm"][step]
        if step in ref["val"]:
            yield f"step {step} validation loss", "val", rec["val"].get(step), ref["val"][step]
    for kind in ("weights", "buffers"):
        for name, want in ref.get(kind, {}).items():
            yield f"final {kind[:-1]} {name}", kind, rec.get(kind, {}).get(name), want


def compare(cell: Cell, records: list[dict], merged: dict | None = None,
            pretrained: list[dict] | dict | None = None) -> dict:
    """Every rank's records against its unit's one-device reference. Returns the matrix row
    (feature -> max abs error, or what raised); raises Mismatch naming the first value out of
    tolerance (phase, step, what, unit, rank), the uninterrupted run before the resumes."""
    refs = run_reference(cell.loop, cell.units)
    ckpt = cell.loop.ckpt_at
    phases = [""] + [f"resume:{f}" for f in cell.loop.formats] + \
        (["merged->1dev"] if merged is not None else [])
    row: dict = {}
    first = None
    # with BatchNorm across units only a sharded checkpoint keeps every unit's statistics
    first_unit = cell.loop.model == "bn" and cell.units > 1
    for phase in phases:
        for rec in records:
            ref = refs[rec["unit"]]
            if first_unit and phase and phase != "resume:sharded":
                ref = resumed_from_first_unit(cell.loop, cell.units)[rec["unit"]]
            if phase == f"resume:{PRETRAINED}":
                if "error" in pretrained:
                    row[phase] = pretrained["error"]
                    first = first or f"{cell.name} {phase}: {pretrained['error']}"
                    continue
                ref = pretrained[rec["unit"]]
            want = ref if not phase else {
                **ref, **{k: {s: v for s, v in ref[k].items() if s >= ckpt}
                          for k in ("train", "norm", "val")}}
            if phase == "merged->1dev":            # one device, from unit 0's point of view
                if rec["rank"] != 0:
                    continue
                got = merged
            else:
                got = rec[phase] if phase else rec
            if "error" in got:
                row[phase] = got["error"]
                first = first or f"{cell.name} {phase}: {got['error']}"
                continue
            where = f"{phase + ': ' if phase else ''}unit {rec['unit']} rank {rec['rank']}"
            for what, kind, g, w in _checks(got, want):
                col = phase or kind
                if isinstance(row.get(col), str):
                    continue
                if g is None:
                    row[col] = f"missing {what}"
                    first = first or f"{cell.name} {where}: {what} missing"
                    continue
                g, w = (torch.as_tensor(t, dtype=torch.float64) for t in (g, w))
                err = (g - w).abs()
                row[col] = max(row.get(col, 0.0), float(err.max()) if err.numel() else 0.0)
                scale = cell.weight_rtol * w.abs().max() if kind in ("weights", "buffers") \
                    else cell.rtol * w.abs()
                bad = err > cell.atol + scale
                if bool(bad.any()):
                    oot = row.setdefault("out of tolerance", [])
                    if col not in oot:
                        oot.append(col)
                    first = first or _describe(cell, where, what, g, w, bad)
    if first is not None:
        row["first mismatch"] = first
        raise Mismatch(first + "\n" + format_row(cell.name, row), row)
    return row


def _describe(cell, where, what, g, w, bad) -> str:
    if g.dim() == 0:
        return (f"{cell.name} {where}: {what}: got {float(g):.6f}, one device {float(w):.6f} "
                f"(|err| {abs(float(g - w)):.2e} > atol {cell.atol:g} + rtol {cell.rtol:g})")
    i = int((g - w).abs().argmax())
    idx = tuple(int(x) for x in torch.unravel_index(torch.tensor(i), g.shape))
    return (f"{cell.name} {where}: {what}: {int(bad.sum())} of {g.numel()} elements differ, "
            f"max |err| {float((g - w).abs().max()):.2e} at {idx} (got {float(g[idx]):.6f}, "
            f"one device {float(w[idx]):.6f}; bound atol {cell.atol:g} + {cell.weight_rtol:g} "
            f"* max|w| {float(w.abs().max()):.3g})")


def _cell_text(row: dict, f: str) -> str:
    v = row.get(f)
    if v is None:
        return "-"
    if isinstance(v, str):
        return "ERR"
    return f"{v:.0e}" + ("!" if f in row.get("out of tolerance", ()) else "")


def format_row(name: str, row: dict) -> str:
    return f"{name}: " + "  ".join(f"{f}={_cell_text(row, f)}" for f in FEATURES)


if __name__ == "__main__":
    from conformance_run import main
    main()
