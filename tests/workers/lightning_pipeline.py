"""NnCompileStrategy with pipelined plans (torchrun, 2 gloo ranks): a LightningModule whose
training_step returns `self(...)`'s loss trains through pm.train_step, step for step like one
device accumulating `(loss_m / M).backward()` over the same micro-batches (AdamW, LambdaLR,
clipping by the global norm); a sharded checkpoint resumes; bf16-mixed autocasts the stages'
forwards; a microbatches-only plan (no stages, data parallel) trains too; validation on the
pipelined plan equals one device's eval loss; what cannot work is refused with the fix
(validation on a microbatches-only plan, accumulate_grad_batches, a GradScaler, a changed
loss, two forwards in one step).

    torchrun --nproc_per_node=2 tests/workers/lightning_pipeline.py --savedir DIR
"""
from __future__ import annotations

import argparse
import copy
import math
import os
import sys
import time
import warnings

import lightning as L
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
from gpt import GPT  # noqa: E402

import nncompile  # noqa: E402
from nncompile.integration.lightning import NnCompilePrecision, NnCompileStrategy  # noqa: E402
from nncompile.rows import param_rows  # noqa: E402

M, ROWS, SEQ, VOCAB, STEPS = 4, 8, 16, 64, 4
LR, CLIP = 1e-2, 0.5
RTOL = 1e-5
RTOL_BF16 = 2e-3          # bfloat16 keeps 8 significant bits; orders of partial sums differ
WEIGHT_RTOL = 5e-4        # |got - want| <= WEIGHT_RTOL * max|want| (see tests/workers/pipeline.py;
#                           attention key biases, whose exact gradient is 0, are left out as there)


def make_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=4, n_embd=32)


def batches(unit: int) -> list[dict[str, torch.Tensor]]:
    """A data-parallel unit's 2 batches; step s trains on batch s % 2."""
    out = []
    for i in range(2):
        g = torch.Generator().manual_seed(100 * unit + i)
        out.append({k: torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
                    for k in ("idx", "targets")})
    return out


def lr_factor(step: int) -> float:
    return 0.5 + 0.5 * math.cos(math.pi * min(step, 10) / 10)


class Lit(L.LightningModule):
    def __init__(self, unit: int = 0, step: str = "plain", validate: bool = False):
        super().__init__()
        self.net = make_gpt()
        self.unit, self.step_kind, self.validate = unit, step, validate
        self.dummy_forward_args = batches(unit)[0]
        self.losses: list[float] = []
        self.val_losses: list[tuple[int, float]] = []     # (global step, loss) per validation

    def forward(self, idx, targets):
        return self.net(idx, targets)

    def training_step(self, batch, i):
        # the batch of this global step (Lightning resuming from a checkpoint saved at the end
        # of fit repeats an epoch's first batch; the step's number is what the reference uses)
        batch = batches(self.unit)[self.trainer.global_step % 2]
        loss = self(**batch)
        self.losses.append(float(loss))
        self.log("train_loss", loss, sync_dist=True)
        if self.step_kind == "changed":
            return loss * 2
        if self.step_kind == "twice":
            self(**batch)
        return loss

    def validation_step(self, batch, i):
        loss = self(**batch)
        self.val_losses.append((self.trainer.global_step, float(loss)))
        self.log("val_loss", loss, sync_dist=True)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(batches(self.unit), batch_size=None)

    def val_dataloader(self):
        return torch.utils.data.DataLoader(batches(self.unit)[:1], batch_size=None)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=LR)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def fit(lit, savedir, pas, plan=2, precision="32-true", ckpt_path=None, max_steps=STEPS,
        **kwargs) -> L.Trainer:
    kwargs.setdefault("enable_checkpointing", False)
    strategy = NnCompileStrategy(nncompile.ComputeConfig(plan, dist.get_world_size(),
                                                         parallel=pas),
                                 pas_policy="tp", gen_savedir=savedir, reuse="moo",
                                 instance_name="pp" + "_".join(f"{v}" for v in pas.values()))
    kwargs.setdefault("limit_val_batches", 0)
    kwargs.setdefault("num_sanity_val_steps", 0)
    trainer = L.Trainer(accelerator="cpu", devices=dist.get_world_size(), strategy=strategy,
                        max_steps=max_steps, plugins=[NnCompilePrecision(precision)],
                        gradient_clip_val=CLIP, logger=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False, **kwargs)
    trainer.fit(lit, ckpt_path=ckpt_path)
    return trainer


def reference(units: int, steps: int = STEPS, bf16: bool = False):
    """One device: per step, every unit's batch in M micro-batches, (loss_m / (M units))
    backward, clip, AdamW, LambdaLR. Returns (per-step loss of each unit, final weights)."""
    model = make_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    data = [batches(u) for u in range(units)]
    losses = []
    for step in range(steps):
        per_unit = []
        opt.zero_grad()
        for u in range(units):
            b = data[u][step % 2]
            total = 0.0
            for m in range(M):
                mb = {k: v.chunk(M)[m] for k, v in b.items()}
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                    loss = model(**mb)
                (loss / (M * units)).backward()
                total += loss.item() / M
            per_unit.append(total)
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        sched.step()
        losses.append(per_unit)
    return losses, {f"net.{k}": v.detach() for k, v in model.state_dict().items()}


def close(a: float, b: float, rtol: float) -> bool:
    return abs(a - b) <= rtol * abs(b)


def check_run(what: str, trainer, got: list[float], want: list[float], weights: dict,
              rtol: float) -> None:
    assert len(got) == len(want), f"{what}: {len(got)} steps, want {len(want)}"
    for i, (a, b) in enumerate(zip(got, want)):
        assert close(a, b, rtol), f"{what}: step {i} loss {a} vs {b}"
    pm = trainer.lightning_module.nncompile_module
    worst = 0.0
    for row in param_rows(pm):
        if row.fqn.endswith("k_proj.bias"):
            continue      # exact gradient 0 (softmax ignores a per-row shift): AdamW-scaled noise
        mine, full = getattr(pm, row.name).detach().float(), weights[row.fqn].float()
        want_t = full[tuple(slice(a, b) for a, b in row.slices)]
        err = (mine - want_t).abs().max().item() / max(full.abs().max().item(), 1e-12)
        worst = max(worst, err)
        assert err <= WEIGHT_RTOL * (100 if rtol == RTOL_BF16 else 1), \
            f"{what}: {row.fqn} off by {err:.2e} of its scale"
    report(f"ok {what}: {len(got)} steps equal one device (losses rtol {rtol:g}), "
           f"weights max rel diff {worst:.1e}")


START = time.perf_counter()


def report(line: str) -> None:
    if dist.get_rank() == 0:
        print(f"{line} [{time.perf_counter() - START:.1f} s]", flush=True)


def expect(what: str, fn, match: str) -> None:
    try:
        fn()
    except nncompile.NNCompileError as e:
        assert match in str(e), f"{what}: {e}"
        report(f"ok error {what}: {e}")
        return
    raise AssertionError(f"{what}: no error")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--savedir", required=True)
    d = ap.parse_args().savedir
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    nncompile.init_distributed("gloo")
    pp2 = {"pp": 2, "schedule": "1f1b", "microbatches": M}
    want, weights = reference(units=1)
    want = [x[0] for x in want]

    # its sharded checkpoint at step 2 resumes to step 4 like the uninterrupted run
    saver = L.pytorch.callbacks.ModelCheckpoint(dirpath=os.path.join(d, "ckpt"), filename="{step}",
                                                every_n_train_steps=2, save_top_k=-1)
    trainer = fit(Lit(), d, pp2, callbacks=[saver], enable_checkpointing=True)
    check_run("pp2 1f1b", trainer, trainer.lightning_module.losses, want, weights, RTOL)
    resumed = fit(Lit(), d, pp2, ckpt_path=os.path.join(d, "ckpt", "step=2.ckpt"))
    assert resumed.global_step == STEPS
    check_run("pp2 resumed from its step-2 checkpoint", resumed,
              trainer.lightning_module.losses[:2] + resumed.lightning_module.losses, want,
              weights, RTOL)

    want16, weights16 = reference(units=1, bf16=True)
    trainer = fit(Lit(), d, pp2, precision="bf16-mixed")
    check_run("pp2 bf16-mixed", trainer, trainer.lightning_module.losses,
              [x[0] for x in want16], weights16, RTOL_BF16)

    # no stages, micro-batches only, data parallel over the 2 ranks (a unit each)
    units = dist.get_world_size()
    want_dp, weights_dp = reference(units=units)
    trainer = fit(Lit(unit=dist.get_rank()), d, {"microbatches": M}, plan=1)
    check_run("dp2 microbatches 4", trainer, trainer.lightning_module.losses,
              [x[dist.get_rank()] for x in want_dp], weights_dp, RTOL)

    # validation on the pipelined plan: the stages forward only, in eval mode; the sanity
    # check (initial weights) and the last validation (after STEPS steps) equal one device
    trainer = fit(Lit(), d, pp2, limit_val_batches=1, num_sanity_val_steps=1)
    records = dict(trainer.lightning_module.val_losses)
    assert sorted(records)[0] == 0 and max(records) == STEPS, records
    for step, state in ((0, make_gpt().state_dict()),
                        (STEPS, {k[len("net."):]: v for k, v in weights.items()})):
        model = make_gpt()
        model.load_state_dict(state)
        model.eval()
        with torch.no_grad():
            want_val = sum(model(**{k: v.chunk(M)[m] for k, v in batches(0)[0].items()}).item()
                           for m in range(M)) / M
        assert close(records[step], want_val, RTOL), (step, records[step], want_val)
    report(f"ok validation pp2: val_loss at steps 0 and {STEPS} {records[0]:.6f}, "
           f"{records[STEPS]:.6f} equal one device's eval loss")
    expect("validation", lambda: fit(Lit(unit=dist.get_rank()), d, {"microbatches": M}, plan=1,
                                     limit_val_batches=1, num_sanity_val_steps=1),
           "limit_val_batches=0")
    expect("accumulate", lambda: fit(Lit(), d, pp2, accumulate_grad_batches=2),
           "microbatches=8")
    expect("16-mixed", lambda: fit(Lit(), d, pp2, precision="16-mixed"), "'bf16-mixed'")
    expect("changed loss", lambda: fit(Lit(step="changed"), d, pp2, max_steps=1),
           "unchanged")
    expect("forward twice", lambda: fit(Lit(step="twice"), d, pp2, max_steps=1),
           "once per training_step")
    dist.barrier()
    report("ok lightning pipeline: all checks passed")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
