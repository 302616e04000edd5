"""Train the nanoGPT model on the Shakespeare corpus with the Lightning Trainer, with nncompile
(NnCompileStrategy + NnCompilePrecision) or with plain Lightning for comparison.

    python examples/nanogpt/prepare.py
    torchrun --nproc_per_node=2 examples/nanogpt/train.py --config cpu --plan_ngpus 2 --policy tp
    torchrun --nproc_per_node=2 examples/nanogpt/train.py --config cpu --use_nncompile false
    torchrun --nproc_per_node=4 examples/nanogpt/train.py --config cpu --plan_ngpus 4 \
        --pipeline_stages 2 --microbatches 4 --policy tp          # pp 2 x tp 2

With --pipeline_stages (or --microbatches > 1) NnCompileStrategy trains through
`pm.train_step` (forward and backward of the unit's batch on the pipeline schedule); such a
plan cannot run a forward alone, so validation is off in that mode.

Every step's batch is a function of (seed, step, data-parallel unit), so a resumed run
(--init_from resume) continues with exactly the batches an uninterrupted run would see.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import lightning as L
import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model import GPT, GPTConfig  # noqa: E402

HERE = Path(__file__).resolve().parent
CONFIGS = {
    # small enough for a 2-core CPU: ~0.2M parameters
    "cpu": dict(n_layer=2, n_head=4, n_embd=64, block_size=64, batch_size=8, dropout=0.0,
                lr=2e-3, min_lr=2e-4, warmup_iters=20, lr_decay_iters=600, max_iters=600,
                eval_interval=100, eval_iters=10, grad_clip=1.0, weight_decay=0.1),
    # nanoGPT's shakespeare_char reference
    "gpu": dict(n_layer=6, n_head=6, n_embd=384, block_size=256, batch_size=64, dropout=0.2,
                lr=1e-3, min_lr=1e-4, warmup_iters=100, lr_decay_iters=5000, max_iters=5000,
                eval_interval=250, eval_iters=200, grad_clip=1.0, weight_decay=0.1),
}


def flag(s: str) -> bool:
    return s.lower() in ("1", "true", "yes", "y")


def int_or_auto(s: str) -> int | str:
    return s if s == "auto" else int(s)


def parallel_spec(args) -> dict:
    """The pipeline options of the ComputeConfig's ParallelSpec (none: an unpipelined plan)."""
    out = {}
    if args.pipeline_stages != 1:
        out.update(pp=args.pipeline_stages, schedule=args.pipeline_schedule,
                   stages_per_rank=args.stages_per_rank)
    if args.microbatches > 1:
        out["microbatches"] = args.microbatches
    return out


def windows(data: np.ndarray, n: int, block: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(len(data) - block - 1, (n,), generator=g)
    x = torch.stack([torch.from_numpy(data[s:s + block].astype(np.int64)) for s in starts])
    y = torch.stack([torch.from_numpy(data[s + 1:s + 1 + block].astype(np.int64))
                     for s in starts])
    return x, y


class StepBatches(torch.utils.data.Dataset):
    """Item j = this data-parallel unit's part of micro-batch (first + j)."""

    def __init__(self, data, block, batch, n_units, unit, first, count, seed):
        self.data, self.block, self.batch = data, block, batch
        self.n_units, self.unit, self.first, self.count, self.seed = \
            n_units, unit, first, count, seed

    def __len__(self):
        return self.count

    def __getitem__(self, j):
        x, y = windows(self.data, self.batch * self.n_units, self.block,
                       self.seed * 1_000_003 + self.first + j)
        part = slice(self.unit * self.batch, (self.unit + 1) * self.batch)
        return x[part], y[part]


class LitGPT(L.LightningModule):
    def __init__(self, args, cfg: dict, vocab_size: int):
        super().__init__()
        self.args, self.cfg = args, cfg
        gcfg = GPTConfig(block_size=cfg["block_size"], vocab_size=vocab_size,
                         n_layer=cfg["n_layer"], n_head=cfg["n_head"], n_embd=cfg["n_embd"],
                         dropout=0.0 if args.deterministic else cfg["dropout"])
        self.model = GPT(gcfg)
        self.train_data = np.memmap(Path(args.data_dir) / "train.bin", dtype=np.uint16, mode="r")
        self.val_data = np.memmap(Path(args.data_dir) / "val.bin", dtype=np.uint16, mode="r")
        # nncompile traces forward with the first training batch
        self.dummy_forward_args_fn = lambda batch: {"idx": batch[0], "targets": batch[1]}

    def forward(self, idx, targets):
        return self.model(idx, targets)

    def _units(self) -> tuple[int, int]:
        plan = self.args.plan_ngpus if self.args.use_nncompile else 1
        return self.trainer.world_size // plan, self.trainer.global_rank // plan

    def train_dataloader(self):
        n_units, unit = self._units()
        micro = self.args.accumulate
        first = self.trainer.global_step * micro
        count = max(self.args.max_iters * micro - first, 1)
        ds = StepBatches(self.train_data, self.cfg["block_size"], self.cfg["batch_size"],
                         n_units, unit, first, count, self.args.seed)
        return torch.utils.data.DataLoader(ds, batch_size=None, shuffle=False)

    def val_dataloader(self):
        n_units, unit = self._units()
        ds = StepBatches(self.val_data, self.cfg["block_size"], self.cfg["batch_size"],
                         n_units, unit, 0, self.cfg["eval_iters"], self.args.seed + 7)
        return torch.utils.data.DataLoader(ds, batch_size=None, shuffle=False)

    def training_step(self, batch, batch_idx):
        loss = self(*batch)
        self.log("train_loss", loss, on_step=True, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self(*batch), on_epoch=True, prog_bar=True, sync_dist=True)

    def configure_optimizers(self):
        c = self.cfg
        opt = torch.optim.AdamW(self.parameters(), lr=c["lr"], betas=(0.9, 0.99),
                                weight_decay=c["weight_decay"])

        def lr_factor(it):        # nanoGPT: linear warmup, cosine decay to min_lr
            if it < c["warmup_iters"]:
                return (it + 1) / (c["warmup_iters"] + 1)
            ratio = min(1.0, (it - c["warmup_iters"]) / (c["lr_decay_iters"] - c["warmup_iters"]))
            coeff = 0.5 * (1.0 + math.cos(math.pi * ratio))
            return (c["min_lr"] + coeff * (c["lr"] - c["min_lr"])) / c["lr"]
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class LossPrinter(L.Callback):
    """Rank 0 prints the training loss at the run's first step (1, or the one after a resumed
    checkpoint), every `interval` steps and at the last step, with the average time per step
    since the previous line, and each validation loss."""

    def __init__(self, interval: int, max_steps: int):
        self.interval, self.max_steps = interval, max_steps
        self.printed, self.t0, self.step0, self.first = -1, None, 0, 1

    def on_train_start(self, trainer, pl_module):
        self.t0, self.step0 = time.perf_counter(), trainer.global_step
        self.first = trainer.global_step + 1

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = trainer.global_step            # optimizer steps taken so far
        if self.interval <= 0 or step in (0, self.printed) or not trainer.is_global_zero:
            return
        if step == self.first or step % self.interval == 0 or step == self.max_steps:
            now = time.perf_counter()
            ms = 1000 * (now - self.t0) / max(step - self.step0, 1)
            loss = float(trainer.callback_metrics["train_loss"])
            print(f"step {step}: train loss {loss:.4f}, {ms:.0f} ms/step", flush=True)
            self.printed, self.t0, self.step0 = step, now, step

    def on_validation_epoch_end(self, trainer, pl_module):
        if trainer.is_global_zero and not trainer.sanity_checking and \
                "val_loss" in trainer.callback_metrics:
            print(f"step {trainer.global_step}: val loss "
                  f"{float(trainer.callback_metrics['val_loss']):.4f}", flush=True)


class LossLog(L.Callback):
    """Rank 0 appends {"step", "batch", "train_loss"} / {"step", "val_loss"} JSON lines."""

    def __init__(self, path: str | None):
        self.path = path

    def _write(self, trainer, record: dict) -> None:
        if self.path and trainer.is_global_zero:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        loss = trainer.callback_metrics.get("train_loss")
        self._write(trainer, {"step": trainer.global_step, "batch": batch_idx,
                              "train_loss": float(loss)})

    def on_validation_epoch_end(self, trainer, pl_module):
        if not trainer.sanity_checking and "val_loss" in trainer.callback_metrics:
            self._write(trainer, {"step": trainer.global_step,
                                  "val_loss": float(trainer.callback_metrics["val_loss"])})


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", choices=sorted(CONFIGS), default="cpu")
    ap.add_argument("--plan_ngpus", type=int, default=1)
    ap.add_argument("--runtime_ngpus", type=int, default=None, help="default: world size")
    ap.add_argument("--use_nncompile", type=flag, default=True)
    ap.add_argument("--use_zero", "--use-zero", type=int_or_auto, default=0,
                    help="ZeRO stage 0-3 over the data-parallel ranks, or auto (autodist)")
    ap.add_argument("--offload_optimizer", "--offload-optimizer", type=flag, default=False,
                    help="optimizer state and step in host memory")
    ap.add_argument("--policy", default="autodist",
                    choices=["autodist", "tp", "tp_sp", "data", "dp"],
                    help="how one copy of the model is split over its plan_ngpus ranks: "
                         "autodist (the cost model's cheapest plan), tp (Megatron: attention "
                         "by heads, the fused c_attn as its q/k/v parts, MLP by columns), "
                         "tp_sp (tp + sequence parallel norms), data (the batch), dp (none: "
                         "plan_ngpus 1)")
    ap.add_argument("--pipeline_stages", "--pipeline-stages", type=int_or_auto, default=1,
                    help="pipeline ranks S per plan unit (plan_ngpus // S tensor-parallel ranks "
                         "each), or auto (autodist)")
    ap.add_argument("--microbatches", type=int, default=1,
                    help="micro-batches M each unit's batch is split into (pipeline schedule, "
                         "or accumulation without stages); must divide the batch size")
    ap.add_argument("--pipeline_schedule", "--pipeline-schedule", default="1f1b",
                    choices=["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"])
    ap.add_argument("--stages_per_rank", "--stages-per-rank", type=int, default=1,
                    help="V stages per pipeline rank (interleaved_1f1b, zero_bubble)")
    ap.add_argument("--deterministic", type=flag, default=False,
                    help="no dropout, deterministic algorithms: runs are exactly comparable")
    ap.add_argument("--init_from", default="scratch",
                    help="scratch, resume (the last checkpoint in out_dir) or a checkpoint path")
    ap.add_argument("--max_iters", type=int, default=None)
    ap.add_argument("--accumulate", type=int, default=1, help="accumulate_grad_batches")
    ap.add_argument("--grad_clip", type=float, default=None, help="0 disables clipping")
    ap.add_argument("--precision", default="32-true")
    ap.add_argument("--state_dict_type", default="sharded", choices=["sharded", "deduped"])
    ap.add_argument("--ckpt_interval", type=int, default=None, help="default: eval_interval")
    ap.add_argument("--eval_interval", type=int, default=None)
    ap.add_argument("--out_dir", default=str(HERE / "out"))
    ap.add_argument("--data_dir", default=str(HERE / "data" / "shakespeare_char"))
    ap.add_argument("--loss_log", default=None, help="JSON lines of per-step losses")
    ap.add_argument("--log_interval", type=int, default=10,
                    help="print the training loss every N steps (and at the first and the "
                         "last step; 0: never) on rank 0")
    ap.add_argument("--seed", type=int, default=1337)
    args = ap.parse_args(argv)
    cfg = dict(CONFIGS[args.config])
    args.max_iters = args.max_iters or cfg["max_iters"]
    args.eval_interval = args.eval_interval or cfg["eval_interval"]
    args.ckpt_interval = args.ckpt_interval or args.eval_interval
    if args.grad_clip is not None:
        cfg["grad_clip"] = args.grad_clip
    if (args.pipeline_stages != 1 or args.microbatches > 1) and not args.use_nncompile:
        ap.error("--pipeline_stages/--microbatches need nncompile (--use_nncompile true)")
    if cfg["batch_size"] % args.microbatches:
        ap.error(f"--microbatches {args.microbatches} must divide the batch size "
                 f"{cfg['batch_size']} of --config {args.config}")
    return args, cfg


def build_trainer(args, cfg) -> L.Trainer:
    world = int(os.environ.get("WORLD_SIZE", 1))
    accelerator = "gpu" if torch.cuda.is_available() else "cpu"
    kwargs = {}
    if args.use_nncompile:
        import nncompile
        from nncompile.integration.lightning import NnCompilePrecision, NnCompileStrategy
        config = nncompile.ComputeConfig(args.plan_ngpus, args.runtime_ngpus or world,
                                         use_zero=args.use_zero,
                                         offload_optimizer=args.offload_optimizer,
                                         parallel=parallel_spec(args))
        if parallel_spec(args):
            # pm.train_step runs forward + backward together: no forward alone to validate with
            kwargs["limit_val_batches"] = 0
            if int(os.environ.get("RANK", 0)) == 0:
                print(f"nanoGPT: training through pm.train_step ({parallel_spec(args)}); "
                      f"validation is off (a pipelined plan has no forward alone)", flush=True)
        kwargs["strategy"] = NnCompileStrategy(
            config, pas_policy=args.policy, gen_savedir=str(Path(args.out_dir) / "gen"),
            reuse="moo", state_dict_type=args.state_dict_type)
        kwargs["plugins"] = [NnCompilePrecision(args.precision)]
    else:
        kwargs["strategy"] = "ddp" if world > 1 else "auto"
        kwargs["precision"] = args.precision
    ckpt = L.pytorch.callbacks.ModelCheckpoint(
        dirpath=Path(args.out_dir) / "ckpt", filename="{step}", save_last=True,
        every_n_train_steps=args.ckpt_interval, save_top_k=-1)
    return L.Trainer(
        accelerator=accelerator, devices=world, num_nodes=1, max_steps=args.max_iters,
        max_epochs=-1, accumulate_grad_batches=args.accumulate,
        gradient_clip_val=cfg["grad_clip"] or None, gradient_clip_algorithm="norm",
        val_check_interval=args.eval_interval * args.accumulate,
        check_val_every_n_epoch=None, num_sanity_val_steps=0,
        deterministic=args.deterministic, use_distributed_sampler=False,
        callbacks=[ckpt, LossLog(args.loss_log), LossPrinter(args.log_interval, args.max_iters)],
        logger=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=args.out_dir, **kwargs)


def main(argv=None) -> None:
    args, cfg = parse_args(argv)
    if not (Path(args.data_dir) / "train.bin").exists():
        raise SystemExit(f"no {args.data_dir}/train.bin: run python examples/nanogpt/prepare.py "
                         f"--out {args.data_dir}")
    L.seed_everything(args.seed, workers=True)
    with open(Path(args.data_dir) / "meta.pkl", "rb") as f:
        import pickle
        vocab_size = pickle.load(f)["vocab_size"]
    model = LitGPT(args, cfg, vocab_size)
    trainer = build_trainer(args, cfg)
    ckpt_path = None
    if args.init_from == "resume":
        last = Path(args.out_dir) / "ckpt" / "last.ckpt"
        if not last.exists():
            raise SystemExit(f"--init_from resume: no {last}")
        ckpt_path = str(last)
    elif args.init_from != "scratch":
        ckpt_path = args.init_from
    trainer.fit(model, ckpt_path=ckpt_path)
    if torch.distributed.is_initialized():
        # Lightning leaves the process group open; closing it here, once every rank is done,
        # stops gloo's worker threads before the interpreter exits (else an occasional abort)
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
