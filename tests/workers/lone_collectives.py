"""Rank 0 evaluates alone after the last step while the other ranks go to a torch.distributed
call of the script's own (`--call`): `barrier` (rank 0 saves a file with torch.save first, then
joins the barrier), `all_reduce` of a logged loss, or `broadcast` of a flag. Those ranks wait
in torch's call for rank 0, and rank 0's forward waits for them: rank 0 raises nncompile's
ConfigError naming each rank's call and script line (runtime/protocol/lockstep.py `_watched`),
and the others, whose call fails as rank 0 leaves, print the hang report naming rank 0's
error (runtime/protocol/hang_report.py) before torch's own error.

`--call full_optimizer_state_dict` (ZeRO-1/2, whose forwards exchange nothing): rank 0 gathers
the optimizer state alone after the last step, as a DDP script saves on rank 0, while the
others train one more step and wait in the gradient reduction for rank 0: rank 0 raises the
ConfigError that says to call it on every rank, naming where each other rank waits.

    torchrun --nproc_per_node=N tests/workers/lone_collectives.py \\
        --plan tp|zero3|tp_zero3|zero1|zero2|tp_zero1 \\
        --call barrier|all_reduce|broadcast|full_optimizer_state_dict --savedir D
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import models  # noqa: E402

import nncompile  # noqa: E402

PLANS = {"tp": (2, 2, 0, "tp"), "zero3": (1, 2, 3, "dp"), "tp_zero3": (2, 4, 3, "tp"),
         "zero1": (1, 2, 1, "dp"), "zero2": (1, 2, 2, "dp"), "tp_zero1": (2, 4, 1, "tp")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--plan", choices=PLANS, required=True)
    ap.add_argument("--call", choices=("barrier", "all_reduce", "broadcast",
                                       "full_optimizer_state_dict"), required=True)
    ap.add_argument("--savedir", required=True)
    args = ap.parse_args()
    rank, _ = nncompile.init_distributed(backend="gloo", timeout_s=60)
    plan, world, zero, policy = PLANS[args.plan]
    torch.manual_seed(0)
    pm = nncompile.parallelize(models.build("gpt"), models.batch("gpt", 0),
                               nncompile.ComputeConfig(plan, world, use_zero=zero),
                               pas_policy=policy, gen_savedir=args.savedir)
    opt = nncompile.build_optimizer(pm, torch.optim.AdamW, lr=1e-2)
    for step in range(2):
        loss = pm(**models.batch("gpt", 10 * step + rank // plan))
        loss.backward()
        opt.step()
        opt.zero_grad()
    logged = torch.tensor([loss.item()])
    if args.call == "full_optimizer_state_dict":
        if rank == 0:                  # saves alone after the last step
            state = nncompile.full_optimizer_state_dict(pm, opt)
            print(f"rank 0 gathered the optimizer state alone: {len(state['state'])}", flush=True)
        else:                          # trains on: its gradient reduction waits for rank 0
            pm(**models.batch("gpt", 30 + rank // plan)).backward()
            opt.step()
            print(f"rank {rank} passed the {args.call}", flush=True)
        dist.destroy_process_group()
        return
    if rank == 0:                      # evaluates alone after the last step
        pm.eval()
        with torch.no_grad():
            val = pm(**models.batch("gpt", 100)).item()
        print(f"rank 0 evaluated alone: {val:.4f}", flush=True)
        torch.save({"val": val}, os.path.join(args.savedir, "val.pt"))
    if args.call == "barrier":
        dist.barrier()
    elif args.call == "all_reduce":
        dist.all_reduce(logged)
    else:
        flag = torch.tensor([1 if rank == 0 else 0])
        dist.broadcast(flag, src=0)
    print(f"rank {rank} passed the {args.call}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
