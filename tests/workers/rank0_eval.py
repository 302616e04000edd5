"""Rank 0 alone evaluates (nanoGPT's `if master_process: estimate_loss()`) between training
steps of a GPT, under each plan (dp, zero1, zero3, tp), and under dp and tp with every rank
evaluating ("dp_all", "tp_all"), and under tp with each rank fed its own training batches
("tp_skewed"): each rank writes, to OUT.rank{r}.json, per run its training
losses, its evaluation losses and the error it raised (type and message), or none.

    torchrun --nproc_per_node=2 tests/workers/rank0_eval.py --out OUT --savedir D
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import models  # noqa: E402

import nncompile  # noqa: E402

CONFIGS = {"dp": ((1, 2), {}, "dp"), "zero1": ((1, 2), {"use_zero": 1}, "dp"),
           "zero3": ((1, 2), {"use_zero": 3}, "dp"), "tp": ((2, 2), {}, "tp")}


def run(name: str, every_rank: bool, savedir: str, skew: bool = False) -> dict:
    """`skew`: each rank trains on a batch of its own (a unit's ranks must not), after rank 0
    alone evaluated 3 batches (forwards that must not count as the unit's checked calls)."""
    rank = dist.get_rank()
    (plan, world), kw, policy = CONFIGS[name]
    torch.manual_seed(0)
    pm = nncompile.parallelize(models.build("gpt"), models.batch("gpt", 0),
                               nncompile.ComputeConfig(plan, world, **kw), pas_policy=policy,
                               gen_savedir=savedir, instance_name=name)
    opt = nncompile.build_optimizer(pm, torch.optim.AdamW, lr=1e-2)
    unit = rank if skew else rank // plan
    losses, evals, error = [], [], None
    try:
        for step in range(4):
            if (every_rank or rank == 0) and step % 2 == 0:
                pm.eval()
                with torch.no_grad():
                    for i in range(3 if skew else 1):
                        evals.append(pm(**models.batch("gpt", 100 + i)).item())
                pm.train()
            loss = pm(**models.batch("gpt", 10 * step + unit))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    except nncompile.NNCompileError as e:
        error = [type(e).__name__, str(e)]
    return {"losses": losses, "evals": evals, "error": error}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--savedir", required=True)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    out = {"dp_all": run("dp", True, args.savedir), "tp_all": run("tp", True, args.savedir)}
    for name in CONFIGS:
        out[name] = run(name, False, args.savedir)
    out["tp_skewed"] = run("tp", False, args.savedir, skew=True)
    with open(f"{args.out}.rank{dist.get_rank()}.json", "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
