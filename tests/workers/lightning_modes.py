"""Lightning validation runs the parallel module in eval mode (one process, gloo): a model
with dropout 0.2 under ZeRO-3 logs, as val_loss, the model's own eval-mode loss; training
steps still drop (the LightningModule's eval()/train() reach the parallel module inside it).

    python tests/workers/lightning_modes.py --savedir DIR
"""
from __future__ import annotations

import argparse
import copy
import os
import sys

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import models  # noqa: E402

import nncompile  # noqa: E402
from nncompile.integration.lightning import NnCompilePrecision, NnCompileStrategy  # noqa: E402


class DropoutMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.head = nn.Linear(16, 64), nn.Linear(64, 64), nn.Linear(64, 8)
        self.drop = nn.Dropout(0.2)

    def forward(self, x, y):
        h = self.drop(F.relu(self.fc1(x)))
        return F.cross_entropy(self.head(self.drop(torch.tanh(self.fc2(h)))), y)


class Lit(L.LightningModule):
    def __init__(self, net):
        super().__init__()
        self.net = net
        self.dummy_forward_args = models.batch("mlp", 0)
        self.modes = []

    def forward(self, x, y):
        return self.net(x, y)

    def training_step(self, batch, i):
        self.modes.append(("train", self.nncompile_module.training))
        return self(**batch)

    def validation_step(self, batch, i):
        self.modes.append(("val", self.nncompile_module.training))
        self.log("val_loss", self(**batch))

    def train_dataloader(self):
        return torch.utils.data.DataLoader([models.batch("mlp", i) for i in range(2)],
                                           batch_size=None)

    def val_dataloader(self):
        return torch.utils.data.DataLoader([models.batch("mlp", 9)], batch_size=None)

    def configure_optimizers(self):
        # lr 0: the weights stay the model's, so its eval loss is the reference
        return nncompile.build_optimizer(self.nncompile_module, torch.optim.SGD, lr=0.0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--savedir", required=True)
    args = ap.parse_args()
    torch.manual_seed(0)
    net = DropoutMLP()
    b = models.batch("mlp", 9)
    want = float(copy.deepcopy(net).eval()(**b))
    dropped = float(copy.deepcopy(net)(**b))
    assert abs(dropped - want) > 1e-3, "dropout had no effect; the check is vacuous"
    lit = Lit(net)
    strategy = NnCompileStrategy(nncompile.ComputeConfig(1, 1, use_zero=3), pas_policy="dp",
                                 gen_savedir=args.savedir)
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=2,
                        plugins=[NnCompilePrecision("32-true")], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0,
                        check_val_every_n_epoch=1)
    trainer.fit(lit)
    got = float(trainer.callback_metrics["val_loss"])
    assert abs(got - want) <= 1e-5 * abs(want), f"val_loss {got:.6f}, model in eval mode {want:.6f}"
    assert ("val", False) in lit.modes and ("train", True) in lit.modes, lit.modes
    assert lit.nncompile_module in list(lit.modules())
    print(f"ok lightning validation in eval mode: val_loss {got:.4f} = model.eval() {want:.4f} "
          f"(with dropout {dropped:.4f})", flush=True)


if __name__ == "__main__":
    main()
