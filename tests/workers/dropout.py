"""Dropout parity worker (torchrun, gloo): with every rank seeded alike before the step (as
docs/concepts.md says), dropout p=0.5 under tp, data and autodist at plan 2 gives the loss and
gradients of one device seeded the same: each rank draws the full tensor's mask and keeps its
slice. Models: an MLP with dropout on its split hidden layer, and Hugging Face GPT-2 with
embedding, residual and attention dropout (inside scaled_dot_product_attention).

    torchrun --nproc_per_node=2 tests/workers/dropout.py --savedir DIR
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import models  # noqa: E402

import nncompile  # noqa: E402

SEED = 1234
RTOL, ATOL = 1e-5, 1e-6


class DropoutMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.head = nn.Linear(16, 64), nn.Linear(64, 64), nn.Linear(64, 8)
        self.drop = nn.Dropout(0.5)

    def forward(self, x, y):
        h = self.drop(F.relu(self.fc1(x)))
        h = F.dropout(torch.tanh(self.fc2(h)), 0.5, self.training)
        return F.cross_entropy(self.head(h), y)


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    return (DropoutMLP() if name == "mlp" else models.hf_gpt2(pdrop=0.5)).train()


def batch(name: str) -> dict[str, torch.Tensor]:
    return models.batch("mlp" if name == "mlp" else "hf_gpt2", 0, batch_size=4)


def run(model, b, seed=SEED):
    torch.manual_seed(seed)
    loss = model(**b)
    loss.backward()
    return loss.detach()


def check(name: str, policy: str, savedir: str) -> None:
    model, b = build(name), batch(name)
    ref_loss = run(model, b)
    ref_grads = {k: p.grad for k, p in model.named_parameters()}
    eval_loss = build(name).eval()(**b).detach()
    assert (ref_loss - eval_loss).abs() > 1e-3, "dropout had no effect; the check is vacuous"
    pm = nncompile.parallelize(build(name), tuple(b.values()), nncompile.ComputeConfig(2, 2),
                               pas_policy=policy, gen_savedir=savedir,
                               instance_name=f"{name}_{policy}")
    code = open(pm.gencode_path).read()
    if policy == "tp":              # the split ops draw through rng, exactly
        assert "rng.dropout(" in code, "no split dropout in the tp plan"
        if name == "gpt2":
            assert "rng.scaled_dot_product_attention(" in code
    loss = run(pm, b)
    torch.testing.assert_close(loss, ref_loss, rtol=RTOL, atol=ATOL,
                               msg=lambda m: f"{name} {policy}: loss {m}")
    for fqn, g in pm.gather_grads().items():
        want = ref_grads[fqn]
        torch.testing.assert_close(g, want, rtol=RTOL, atol=ATOL * max(1.0, want.abs().max()),
                                   msg=lambda m: f"{name} {policy}: grad of {fqn}: {m}")
    # a second step draws the next masks, still in step on every rank
    pm.zero_grad()
    torch.testing.assert_close(run(pm, b, SEED + 1), run(build(name), b, SEED + 1),
                               rtol=RTOL, atol=ATOL)
    if dist.get_rank() == 0:
        print(f"ok dropout {name} {policy}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--savedir", required=True)
    args = ap.parse_args()
    nncompile.init_distributed(backend="gloo")
    for name in ("mlp", "gpt2"):
        for policy in ("tp", "data", "autodist"):
            check(name, policy, args.savedir)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
