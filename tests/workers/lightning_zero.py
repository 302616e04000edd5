"""The nanoGPT example (examples/nanogpt/train.py) under NnCompileStrategy with ZeRO/offload,
with checks inside the run (torchrun, gloo):

- the optimizer the strategy steps is a ZeroOptimizer of the expected stage (ZeRO-3: over the
  parallel module's flat `zero_*` pieces; offload: state in host memory), and the LR scheduler
  drives it (scheduler.optimizer is it);
- before every optimizer step, the lr the inner optimizer will use equals the scheduler's
  (base lr x lr_lambda(step)): the warmup changes it every step, so a scheduler left on the
  optimizer configure_optimizers built, or on stale param_groups after loading a checkpoint,
  fails here;
- gradient clipping (gradient_clip_val) runs nncompile.clip_grad_norm_ once per step.

    torchrun --nproc_per_node=2 tests/workers/lightning_zero.py --expect_zero 3 -- \
        --data_dir DATA --out_dir OUT --plan_ngpus 1 --policy dp --use_zero 3 ...

Everything after `--` goes to train.py. Rank 0 prints "ok ..." lines the test looks for.
"""
from __future__ import annotations

import argparse
import os
import sys

import lightning as L
import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, os.path.join(ROOT, "examples", "nanogpt"))
import train  # noqa: E402

import nncompile.integration.lightning.precision as precision_module  # noqa: E402
from nncompile.runtime.optim.optimizer import ZeroOptimizer  # noqa: E402

CLIPS: list[float] = []


def _counting_clip(fn):
    def clip(pm, max_norm, *args, **kwargs):
        norm = fn(pm, max_norm, *args, **kwargs)
        CLIPS.append(float(norm))
        return norm
    return clip


class Check(L.Callback):
    def __init__(self, stage: int, offload: bool):
        self.stage, self.offload = stage, offload
        self.lrs: list[tuple[int, float]] = []
        self.first_step = None

    def _say(self, trainer, text: str) -> None:
        if trainer.is_global_zero:
            print(text, flush=True)

    def on_train_start(self, trainer, pl_module):
        opt = trainer.strategy.optimizers[0]
        pm = pl_module.nncompile_module
        assert isinstance(opt, ZeroOptimizer), type(opt)
        assert opt.pm is pm and opt.stage == self.stage == pm.memory.zero, \
            (opt.stage, self.stage, pm.memory)
        assert pm.memory.offload_optimizer == self.offload
        if self.stage == 3:
            flats = list(pm.stored_parameters())     # one flat piece per unit
            assert flats and all(f.dim() == 1 for f in flats)
            assert not any(n.startswith("zero_") for n, _ in pm.named_parameters())
            assert all(any(s.flat is f for s in opt.shards) for f in flats if f.requires_grad)
        if self.offload:
            assert all(s.param.device.type == "cpu" for s in opt.shards)
        (config,) = trainer.strategy.lr_scheduler_configs
        assert config.scheduler.optimizer is opt, "the LR scheduler drives another optimizer"
        assert config.interval == "step"
        self.first_step = trainer.global_step
        self._say(trainer, f"ok zero optimizer: stage {opt.stage}, offload {self.offload}, "
                           f"{len(opt.shards)} shards, {type(opt.inner).__name__} inside, "
                           f"from step {trainer.global_step}")

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        opt = trainer.strategy.optimizers[0]
        sched = trainer.strategy.lr_scheduler_configs[0].scheduler
        step = trainer.global_step                 # the step about to be taken (0-based)
        want = sched.base_lrs[0] * sched.lr_lambdas[0](step)
        got = opt.inner.param_groups[0]["lr"]      # what the inner optimizer steps with
        assert opt.param_groups is opt.inner.param_groups, "stale param_groups alias"
        assert abs(got - want) <= 1e-12 * want, f"step {step}: lr {got}, scheduler says {want}"
        assert abs(sched.get_last_lr()[0] - got) <= 1e-12 * want
        self.lrs.append((step, got))

    def on_train_end(self, trainer, pl_module):
        steps = trainer.global_step - self.first_step
        assert len(self.lrs) == steps, (len(self.lrs), steps)
        assert len({lr for _, lr in self.lrs}) == steps > 1, f"the lr did not change: {self.lrs}"
        assert len(CLIPS) == steps, f"clip_grad_norm_ ran {len(CLIPS)} times in {steps} steps"
        first, last = self.lrs[0], self.lrs[-1]
        self._say(trainer, f"ok lr follows the scheduler: step {first[0]} lr {first[1]:.6g} -> "
                           f"step {last[0]} lr {last[1]:.6g} ({steps} steps)")
        self._say(trainer, f"ok clip: nncompile.clip_grad_norm_ {len(CLIPS)} times, norms "
                           f"{min(CLIPS):.3g}..{max(CLIPS):.3g}")


def main() -> None:
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    ap = argparse.ArgumentParser()
    ap.add_argument("--expect_zero", type=int, required=True)
    ap.add_argument("--expect_offload", action="store_true")
    ours = ap.parse_args(argv[:split])
    precision_module.clip_grad_norm_ = _counting_clip(precision_module.clip_grad_norm_)
    build = train.build_trainer

    def build_trainer(args, cfg):
        trainer = build(args, cfg)
        trainer.callbacks.append(Check(ours.expect_zero, ours.expect_offload))
        return trainer
    train.build_trainer = build_trainer
    train.main(argv[split + 1:])
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
