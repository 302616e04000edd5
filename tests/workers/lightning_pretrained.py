"""Hugging Face weights through NnCompileStrategy (torchrun, 2 gloo ranks, tp 2): the
LightningModule builds its Llama on meta, `pretrained=` loads model.save_pretrained's files
into the parallel module, validation logs the eager model's loss; after two training steps
`trainer.strategy.save_pretrained` writes files from_pretrained reads back as the trained
weights, and `python -m nncompile export` of the strategy's checkpoint writes the same.

    torchrun --nproc_per_node=2 tests/workers/lightning_pretrained.py --ckpt DIR --savedir DIR
"""
from __future__ import annotations

import argparse
import os
import sys

import lightning as L
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import nncompile  # noqa: E402
from nncompile.integration.lightning import NnCompilePrecision, NnCompileStrategy  # noqa: E402
from workers.pretrained import batch  # noqa: E402


class Lit(L.LightningModule):
    def __init__(self, ckpt: str):
        super().__init__()
        from transformers import AutoConfig, AutoModelForCausalLM
        with torch.device("meta"):
            self.model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(ckpt))
        self.dummy_forward_args = batch(0)

    def forward(self, input_ids, labels):
        return self.model(input_ids=input_ids, labels=labels, use_cache=False).loss

    def training_step(self, b, i):
        return self(**b)

    def validation_step(self, b, i):
        self.log("val_loss", self(**b), sync_dist=True)

    def train_dataloader(self):
        return torch.utils.data.DataLoader([batch(i) for i in range(2)], batch_size=None)

    def val_dataloader(self):
        return torch.utils.data.DataLoader([batch(9)], batch_size=None)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def main() -> None:
    from transformers import AutoModelForCausalLM
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--savedir", required=True)
    args = ap.parse_args()
    want = float(torch.load(os.path.join(args.ckpt, "val_loss.pt")))
    lit = Lit(args.ckpt)
    strategy = NnCompileStrategy(nncompile.ComputeConfig(2, 2), pas_policy="tp",
                                 gen_savedir=os.path.join(args.savedir, "gen"),
                                 pretrained=args.ckpt)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=2,
                        plugins=[NnCompilePrecision("32-true")], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0)
    trainer.validate(lit)
    got = float(trainer.callback_metrics["val_loss"])
    assert abs(got - want) <= 1e-5 * abs(want), f"val_loss {got:.6f}, eager model {want:.6f}"
    trainer.fit(lit)
    trained = {k.removeprefix("model."): v for k, v in
               trainer.strategy.parallel_module.gather_params().items()}
    out = os.path.join(args.savedir, "trained")
    trainer.strategy.save_pretrained(out)
    lit_ckpt = os.path.join(args.savedir, "lit.ckpt")
    trainer.save_checkpoint(lit_ckpt)
    if trainer.global_rank == 0:
        from safetensors.torch import load_file
        from nncompile.__main__ import main as cli
        exported = os.path.join(args.savedir, "exported")       # the strategy's checkpoint
        assert cli(["export", lit_ckpt, "-o", exported, "--config", args.ckpt]) == 0
        assert sorted(os.listdir(exported)) == sorted(os.listdir(out))
        a, b = (load_file(os.path.join(d, "model.safetensors")) for d in (exported, out))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        back = AutoModelForCausalLM.from_pretrained(out).state_dict()
        assert all(torch.equal(back[k], v) for k, v in trained.items())
        moved = max(float((back[k] - v).abs().max()) for k, v in
                    AutoModelForCausalLM.from_pretrained(args.ckpt).state_dict().items())
        assert moved > 0, "training changed nothing; the save check is vacuous"
        print(f"ok lightning pretrained: val_loss {got:.6f} = eager {want:.6f}; "
              f"{len(trained)} trained weights saved and read back", flush=True)


if __name__ == "__main__":
    main()
