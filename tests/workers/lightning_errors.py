"""Bad Lightning set-ups get clear errors (one process, gloo): two optimizers, two parameter
groups, no trace inputs, clipping by value; and the sampler is sized by data-parallel units.

    python tests/workers/lightning_errors.py --savedir DIR
"""
from __future__ import annotations

import argparse
import os
import sys

import lightning as L
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import models  # noqa: E402

import nncompile  # noqa: E402
from nncompile.integration.lightning import NnCompilePrecision, NnCompileStrategy  # noqa: E402


class Lit(L.LightningModule):
    def __init__(self, optimizers="one", dummy=True):
        super().__init__()
        self.net = models.MLP()
        self.optimizers_kind = optimizers
        self.automatic_optimization = optimizers != "two"   # Lightning's rule for several
        if dummy:
            self.dummy_forward_args = models.batch("mlp", 0)

    def forward(self, x, y):
        return self.net(x, y)

    def training_step(self, batch, i):
        return self(**batch)

    def train_dataloader(self):
        return torch.utils.data.DataLoader([models.batch("mlp", i) for i in range(4)],
                                           batch_size=None)

    def configure_optimizers(self):
        ps = list(self.parameters())
        if self.optimizers_kind == "two":
            return [torch.optim.SGD(ps[:2], lr=0.1), torch.optim.SGD(ps[2:], lr=0.1)]
        if self.optimizers_kind == "groups":
            return torch.optim.SGD([{"params": ps[:2]}, {"params": ps[2:], "lr": 0.01}], lr=0.1)
        return torch.optim.SGD(ps, lr=0.1)


def fit(lit, savedir, precision="32-true", **kwargs):
    strategy = NnCompileStrategy(nncompile.ComputeConfig(1), pas_policy="dp",
                                 gen_savedir=savedir, reuse="moo")
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=2,
                        plugins=[NnCompilePrecision(precision)], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, **kwargs)
    trainer.fit(lit)
    return trainer


def expect(what: str, fn, match: str) -> None:
    try:
        fn()
    except nncompile.NNCompileError as e:
        assert match in str(e), f"{what}: {e}"
        print(f"ok error {what}: {e}", flush=True)
        return
    raise AssertionError(f"{what}: no error")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--savedir", required=True)
    d = ap.parse_args().savedir
    expect("two optimizers", lambda: fit(Lit("two"), d), "exactly one optimizer")
    expect("two param groups", lambda: fit(Lit("groups"), d), "one parameter group")
    expect("no dummy args", lambda: fit(Lit(dummy=False), d), "dummy_forward_args")
    expect("clip by value", lambda: fit(Lit(), d, gradient_clip_val=1.0,
                                        gradient_clip_algorithm="value"), "'norm'")
    trainer = fit(Lit(), d, gradient_clip_val=1.0)
    lm = trainer.lightning_module
    assert lm.net is None and isinstance(lm.nncompile_module, nncompile.runtime.module.
                                         ParallelModule)
    assert {n for n, _ in lm.named_parameters()} == \
        {f"nncompile_module.{n}" for n, _ in lm.nncompile_module.named_parameters()}
    print("ok lightning set-up: trainable modules replaced, clipping by norm", flush=True)
    for precision in ("16-true", "bf16-true", "16-mixed", "bf16-mixed"):
        trainer = fit(Lit(), f"{d}/{precision}", precision=precision, gradient_clip_val=1.0)
        pm = trainer.lightning_module.nncompile_module
        dtype = {"16-true": torch.float16, "bf16-true": torch.bfloat16}.get(precision,
                                                                            torch.float32)
        assert all(p.dtype == dtype for p in pm.parameters()), precision
        assert trainer.global_step == 2 and all(torch.isfinite(p).all() for p in pm.parameters())
        print(f"ok precision {precision}: 2 steps, parameters in {dtype}", flush=True)
    expect("state_dict_type", lambda: NnCompileStrategy(state_dict_type="full"), "sharded")
    expect("precision", lambda: NnCompilePrecision("64-true"), "supports")


if __name__ == "__main__":
    main()
