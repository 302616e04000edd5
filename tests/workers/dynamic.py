"""Dynamic-shape parity worker (torchrun, gloo): each model is compiled once with batch and
sequence dynamic (parallelize(..., dynamic_dims=...)) and called at several sizes, including
an odd sequence length; at each, the loss and every gathered gradient equal one device's.
Then a call outside the allowed range, and a state-dict round trip at another size.

    torchrun --nproc_per_node=2 tests/workers/dynamic.py --out report.json
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

RTOL, ATOL = 1e-5, 1e-6
# (batch, seq) per call: the dummy size first, then smaller and odd sequence lengths
SIZES = [(4, 16), (2, 9), (6, 13)]
# model, policy, plan: tp splits heads (odd sequences are fine), data splits the batch (a
# multiple of the plan size), autodist picks at the dummy size
CASES = [("gpt", "tp", 2), ("gpt", "data", 2), ("hf_llama", "tp", 2), ("hf_llama", "autodist", 2),
         ("gpt", "dp", 1)]


def dims(name: str, policy: str, plan: int) -> dict:
    batch = {"name": "batch", "multiple_of": plan} if policy in ("data", "autodist") and \
        plan > 1 else "batch"
    keys = ["idx", "targets"] if name == "gpt" else ["input_ids", "labels"]
    return {k: {0: batch, 1: {"name": "seq", "max": 16}} for k in keys}


def reference(name: str, b: int, t: int, seed: int):
    model = models.build(name)
    loss = model(**models.batch(name, seed, batch_size=b, seq=t))
    loss.backward()
    return loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}


def check(name: str, policy: str, plan: int, savedir: str) -> dict:
    world = dist.get_world_size()
    unit = dist.get_rank() // plan
    pm = nncompile.parallelize(models.build(name), models.batch(name, 0),
                               nncompile.ComputeConfig(plan, world), pas_policy=policy,
                               gen_savedir=savedir, reuse="override",
                               instance_name=f"{name}_{policy}_{plan}",
                               dynamic_dims=dims(name, policy, plan))
    worst = 0.0
    for b, t in SIZES:
        for p in pm.parameters():
            p.grad = None
        loss = pm(**models.batch(name, unit, batch_size=b, seq=t))
        loss.backward()
        grads = pm.gather_grads()
        ref_loss, ref_grads = reference(name, b, t, unit)
        if world // plan > 1:          # data-parallel units: gradients are their average
            others = [reference(name, b, t, u)[1] for u in range(world // plan) if u != unit]
            for k in ref_grads:
                ref_grads[k] = (ref_grads[k] + sum(o[k] for o in others)) / (world // plan)
        what = f"{name} {policy} plan {plan} at batch {b} seq {t}"
        torch.testing.assert_close(loss.detach(), ref_loss, rtol=RTOL, atol=ATOL,
                                   msg=lambda m: f"{what} loss: {m}")
        for fqn, g in grads.items():
            scale = max(1.0, float(ref_grads[fqn].abs().max()))
            torch.testing.assert_close(g, ref_grads[fqn], rtol=RTOL, atol=ATOL * scale,
                                       msg=lambda m: f"{what} grad {fqn}: {m}")
            worst = max(worst, float((g - ref_grads[fqn]).abs().max()))
    # outside the range: a clear error naming the size and its range
    try:
        pm(**models.batch(name, unit, batch_size=2, seq=17))
        outside = None
    except nncompile.InputMismatchError as e:
        outside = str(e)
    # the state is the same whatever size the module was last called at
    state = pm.gather_params()
    code = open(pm.gencode_path).read()
    return {"model": name, "policy": policy, "plan": plan, "max_grad_err": worst,
            "outside": outside, "params": len(state),
            "symbolic_args": code.count("s_seq") + code.count("s_batch"),
            "sizes_line": next((ln.strip() for ln in code.splitlines()
                                if ln.strip().startswith("SIZES =")), None)}


def main(check_all=lambda savedir: [check(name, policy, plan, savedir)
                                     for name, policy, plan in CASES]) -> None:
    """Run `check_all(savedir)` on every rank; rank 0 writes its results to --out."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--savedir", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    results = check_all(args.savedir)
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
