"""Memory profiler worker (torchrun, gloo): the quickstart GPT under `tp` on every rank, profiled
with nncompile.memory.profile; rank 0 saves the gathered profile (every rank's timeline).

    torchrun --nproc_per_node=2 tests/workers/memory_profile.py --savedir DIR --out FILE
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path[:0] = [ROOT, os.path.join(ROOT, "examples")]      # this checkout's nncompile
from gpt import GPT  # noqa: E402

import nncompile  # noqa: E402        (nncompile.memory: the memory profiler)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--savedir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--policy", default="tp")
    ap.add_argument("--steps", type=int, default=1)
    args = ap.parse_args()
    rank, world = nncompile.init_distributed()
    torch.manual_seed(0)
    model = GPT(vocab_size=16, block_size=32, n_layer=2, n_head=4, n_embd=64)
    idx = torch.randint(0, 16, (8, 32))
    targets = (idx + 1) % 16
    pm = nncompile.parallelize(model, {"idx": idx, "targets": targets},
                               nncompile.ComputeConfig(world, world), pas_policy=args.policy,
                               gen_savedir=args.savedir, reuse="moo")
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)

    def step():
        pm(idx, targets).backward()
        opt.step()
        opt.zero_grad()

    prof = nncompile.memory.profile(pm, step, steps=args.steps, optimizer=opt)
    if rank == 0:
        assert [m.rank for m in prof.ranks] == list(range(world)), prof.ranks
        prof.save(args.out)
        print(prof.table(), flush=True)
    else:
        assert [m.rank for m in prof.ranks] == [rank]
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
