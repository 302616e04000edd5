"""Gradient clipping worker (torchrun, gloo): nncompile.clip_grad_norm_ returns the
single-device global norm and leaves the single-device clipped gradients, for tp and dp plans.

    torchrun --nproc_per_node=4 tests/workers/clip.py --savedir DIR
"""
from __future__ import annotations

import argparse
import math
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import models  # noqa: E402

import nncompile  # noqa: E402

PLANS = {2: [("tp", 2, 2), ("dp", 1, 2)], 4: [("tp", 2, 4), ("dp", 1, 4), ("tp", 4, 4)]}


def reference(n_units: int, max_norm: float, norm_type: float):
    model = models.build("gpt")
    for u in range(n_units):
        (model(**models.batch("gpt", u)) / n_units).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)
    return norm, {k: p.grad for k, p in model.named_parameters()}


def check(policy: str, plan: int, runtime: int, norm_type: float, savedir: str) -> None:
    unit = dist.get_rank() // plan
    pm = nncompile.parallelize(models.build("gpt"), models.batch("gpt", 0),
                               nncompile.ComputeConfig(plan, runtime), pas_policy=policy,
                               gen_savedir=savedir, reuse="moo",
                               instance_name=f"gpt_{policy}_{plan}x{runtime}")
    pm(**models.batch("gpt", unit)).backward()
    norm = nncompile.clip_grad_norm_(pm, 0.05, norm_type)
    ref_norm, ref_grads = reference(runtime // plan, 0.05, norm_type)
    what = f"{policy} {plan}x{runtime} norm_type={norm_type}"
    torch.testing.assert_close(norm, ref_norm, rtol=1e-5, atol=1e-7, msg=lambda m: f"{what}: {m}")
    assert float(norm) > 0.05, f"{what}: the test must actually clip"
    for fqn, g in pm.gather_grads().items():
        torch.testing.assert_close(g, ref_grads[fqn], rtol=1e-5, atol=1e-7,
                                   msg=lambda m: f"{what} grad {fqn}: {m}")
    if dist.get_rank() == 0:
        print(f"ok clip {what}: norm {float(norm):.6f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--savedir", default="./.nncompile/clip")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    for policy, plan, runtime in PLANS[dist.get_world_size()]:
        for norm_type in (2.0, math.inf):
            check(policy, plan, runtime, norm_type, args.savedir)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
