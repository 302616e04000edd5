"""Lightning with a smaller last batch: 10 sequences in batches of 4 (4, 4, 2 per epoch) train
a GPT compiled once with dynamic_dims (the batch dim varies), under NnCompileStrategy (tp,
plan 2 on 2 ranks, or --plain: Lightning alone, one process); each step's loss is written.
A sharded checkpoint is saved at the end and loaded into a fresh module, whose loss on the
last batch matches.

    torchrun --nproc_per_node=2 tests/workers/lightning_dynamic.py --out losses.json --savedir D
    python tests/workers/lightning_dynamic.py --plain --out plain.json --savedir D
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import lightning as L
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import models  # noqa: E402

import nncompile  # noqa: E402
from nncompile.integration.lightning import NnCompileStrategy  # noqa: E402

EPOCHS, N, BATCH = 2, 10, 4


class Lit(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = models.build("gpt")
        self.dummy_forward_args = models.batch("gpt", 0, batch_size=BATCH)
        self.losses: list[tuple[int, int, float]] = []

    def forward(self, idx, targets):
        return self.net(idx, targets)

    def training_step(self, batch, i):
        loss = self(**batch)
        self.losses.append((self.global_step, int(batch["idx"].shape[0]), float(loss.detach())))
        return loss

    def train_dataloader(self):
        rows = models.batch("gpt", 7, batch_size=N)
        data = [{k: v[i] for k, v in rows.items()} for i in range(N)]
        return torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=False)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--plain", action="store_true")
    ap.add_argument("--out", required=True)
    ap.add_argument("--savedir", required=True)
    args = ap.parse_args()
    torch.manual_seed(0)
    lit = Lit()
    common = dict(max_epochs=EPOCHS, logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
                  use_distributed_sampler=False)
    if args.plain:
        trainer = L.Trainer(devices=1, **common)
    else:
        dims = {"idx": {0: "batch"}, "targets": {0: "batch"}}
        strategy = NnCompileStrategy(nncompile.ComputeConfig(2, 2), pas_policy="tp",
                                     gen_savedir=args.savedir, reuse="override",
                                     dynamic_dims=dims, process_group_backend="gloo")
        trainer = L.Trainer(devices=2, strategy=strategy, **common)
    trainer.fit(lit)
    out = {"losses": lit.losses}
    if not args.plain:
        ckpt = os.path.join(args.savedir, "last.ckpt")
        trainer.save_checkpoint(ckpt)
        last = models.batch("gpt", 7, batch_size=N)
        last = {k: v[8:] for k, v in last.items()}          # the 2-row last batch
        before = float(lit.nncompile_module(**last))
        fresh = Lit()
        trainer2 = L.Trainer(devices=2, **common, strategy=NnCompileStrategy(
                                 nncompile.ComputeConfig(2, 2), pas_policy="tp",
                                 gen_savedir=args.savedir, dynamic_dims=dims,
                                 process_group_backend="gloo"))
        trainer2.fit(fresh, ckpt_path=ckpt)
        out["resumed"] = [before, float(fresh.nncompile_module(**last))]
    if trainer.global_rank == 0:
        with open(args.out, "w") as f:
            json.dump(out, f)


if __name__ == "__main__":
    main()
