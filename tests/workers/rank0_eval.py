"""Rank 0 alone evaluates (nanoGPT's `if master_process: estimate_loss()`) between training
steps of a GPT, under each plan (dp, zero1, zero3, tp), and under dp and tp with every rank
evaluating ("dp_all", "tp_all"), and under tp with each rank fed its own training batches
("tp_skewed"), and under ZeRO-3 and tp evaluating after the last step while the other ranks
go on to gather_params and save_checkpoint ("zero3_end", "tp_end"; every rank: "..._end_all"):
each rank writes, to OUT.rank{r}.json, per run its training losses, its evaluation losses, the
sum of the gathered weights' absolute values and the error it raised (type and message), or
none. Last, rank 0 evaluates while the others are in nncompile.finish() (OUT.finish.json).

    torchrun --nproc_per_node=2 tests/workers/rank0_eval.py --out OUT --savedir D

With `--end exit` rank 0 evaluates under ZeRO-3 after the last step while the others drop
the module and end the program (OUT.exit.json); with `--end gone` they leave abruptly (os._exit, as a crash
would) and rank 0 records the error it gets (OUT.gone.json).
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


def build(name: str, savedir: str, instance: str):
    (plan, world), kw, policy = CONFIGS[name]
    torch.manual_seed(0)
    pm = nncompile.parallelize(models.build("gpt"), models.batch("gpt", 0),
                               nncompile.ComputeConfig(plan, world, **kw), pas_policy=policy,
                               gen_savedir=savedir, instance_name=instance)
    return pm, nncompile.build_optimizer(pm, torch.optim.AdamW, lr=1e-2)


def evaluate(pm, seed: int) -> float:
    pm.eval()
    with torch.no_grad():
        loss = pm(**models.batch("gpt", seed)).item()
    pm.train()
    return loss


def train(pm, opt, steps: int) -> list[float]:
    losses = []
    for step in range(steps):
        loss = pm(**models.batch("gpt", 10 * step + dist.get_rank() // pm.PLAN_NGPUS))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def run_end(name: str, every_rank: bool, savedir: str, ckpt: str) -> dict:
    """Two steps, then rank 0 (or every rank) evaluates, all gather the weights, rank 0
    evaluates again, all save a checkpoint."""
    pm, opt = build(name, savedir, f"{name}_end")
    evals, weights, error = [], None, None
    try:
        losses = train(pm, opt, 2)
        if every_rank or dist.get_rank() == 0:
            evals.append(evaluate(pm, 100))
        weights = sum(float(t.abs().sum()) for t in pm.gather_params().values())
        if every_rank or dist.get_rank() == 0:
            evals.append(evaluate(pm, 101))
        nncompile.save_checkpoint(f"{ckpt}_{name}_{every_rank}", pm, opt)
    except nncompile.NNCompileError as e:
        losses, error = [], [type(e).__name__, str(e)]
    return {"losses": losses, "evals": evals, "weights": weights, "error": error}


def end_of_program(how: str, out: str, savedir: str) -> None:
    """Rank 0 evaluates after the last step while the others leave (`how`: "exit": they
    return from this function, which held the module, and end the program with
    nncompile.finish() and destroy_process_group; "bare": the same without finish();
    "gone": at once, as a crash would)."""
    pm, opt = build("zero3", savedir, f"zero3_{how}")
    losses = train(pm, opt, 2)
    if dist.get_rank() != 0:
        if how == "gone":
            os._exit(0)
        return
    result = {"losses": losses}
    try:
        result["evals"] = [evaluate(pm, 100), evaluate(pm, 101)]
    except nncompile.NNCompileError as e:
        result["error"] = [type(e).__name__, str(e)]
    with open(f"{out}.{how}.json", "w") as f:
        json.dump(result, f)
    if how == "gone":             # the peer is gone: nothing to meet at the end
        os._exit(0)


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
    ap.add_argument("--end", choices=("exit", "bare", "gone"))
    args = ap.parse_args()
    dist.init_process_group("gloo")
    if args.end:
        end_of_program(args.end, args.out, args.savedir)
        if args.end == "exit":
            nncompile.finish()
        return dist.destroy_process_group()
    out = {"dp_all": run("dp", True, args.savedir), "tp_all": run("tp", True, args.savedir)}
    for name in CONFIGS:
        out[name] = run(name, False, args.savedir)
    out["tp_skewed"] = run("tp", False, args.savedir, skew=True)
    for name in ("zero3", "tp"):
        for every_rank in (True, False):
            out[f"{name}_end" + ("_all" if every_rank else "")] = run_end(
                name, every_rank, args.savedir, args.out)
    with open(f"{args.out}.rank{dist.get_rank()}.json", "w") as f:
        json.dump(out, f)
    pm, opt = build("tp", args.savedir, "tp_finish")
    if dist.get_rank() == 0:        # the others wait in nncompile.finish() meanwhile
        with open(f"{args.out}.finish.json", "w") as f:
            json.dump({"evals": [evaluate(pm, 100), evaluate(pm, 101)]}, f)
    nncompile.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
