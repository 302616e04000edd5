"""Elastic restart worker (docs/operations.md's recipe): tp 2 on 2 ranks trains the tests' GPT
for STEPS AdamW steps, saving a sharded checkpoint after each; at start every rank resumes
from nncompile.latest_checkpoint. With --kill-at K, rank 1 of the first attempt kills itself
(SIGKILL) before step K: torchrun --max-restarts=1 restarts the job, which resumes and
finishes. Rank 0 writes the final weights and the attempts it ran in.

    torchrun --nproc_per_node=2 --max-restarts=1 tests/workers/elastic.py WORKDIR [--kill-at K]
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import models  # noqa: E402

import nncompile  # noqa: E402

STEPS = 6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("workdir")
    ap.add_argument("--kill-at", type=int, default=-1)
    args = ap.parse_args()
    work = Path(args.workdir)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    nncompile.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    pm = nncompile.parallelize(models.build("gpt"), models.batch("gpt", 0),
                               nncompile.ComputeConfig(2, world), pas_policy="tp",
                               gen_savedir=str(work / "gen"))
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2, weight_decay=0.1)
    start = 0
    latest = nncompile.latest_checkpoint(work / "ckpt")
    if latest is not None:
        start = nncompile.load_checkpoint(latest, pm, opt)["step"]
    if rank == 0:
        with open(work / "attempts.jsonl", "a") as f:
            f.write(json.dumps({"attempt": attempt, "resumed_at": start}) + "\n")
    for step in range(start, STEPS):
        if step == args.kill_at and attempt == 0 and rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)          # a lost rank, mid-run
        loss = pm(**models.batch("gpt", step))
        loss.backward()
        opt.step()
        opt.zero_grad()
        nncompile.save_checkpoint(work / "ckpt" / f"step_{step + 1}", pm, opt,
                                  extra={"step": step + 1})
    weights = pm.gather_params()
    if rank == 0:
        torch.save(weights, work / "final.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
