"""Resume on another world size (docs/operations.md): the tests' GPT trains STEPS AdamW steps
of a global batch of 8 drawn by nncompile.DataParallelSampler; the first run (tp 2 x dp 2 on 4
ranks) saves a dcp checkpoint with the sampler after step 3 and goes on, a resume loads it under
another layout and runs steps 3..STEPS-1. Rank 0 writes, per step, the global loss (the mean
over every unit and accumulation step) and the global data (each micro-step's sample indices
in unit order), and the final weights.

    torchrun --nproc_per_node=4 tests/workers/resume_world.py OUT --plan 2 --micro 4 --save CKPT
    torchrun --nproc_per_node=2 tests/workers/resume_world.py OUT --plan 2 --micro 4 --accum 2 \
        --resume CKPT
    torchrun --nproc_per_node=4 tests/workers/resume_world.py OUT --plan 1 --micro 2 --resume CKPT
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import models  # noqa: E402

import nncompile  # noqa: E402

STEPS, SAVE_AFTER, SAMPLES = 6, 3, 64


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    seq = torch.randint(0, 64, (SAMPLES, 17), generator=g)
    return TensorDataset(torch.arange(SAMPLES), seq[:, :-1], seq[:, 1:])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--plan", type=int, required=True)
    ap.add_argument("--micro", type=int, required=True)
    ap.add_argument("--accum", type=int, default=1)
    ap.add_argument("--save")
    ap.add_argument("--resume")
    args = ap.parse_args()
    out = Path(args.out)
    nncompile.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    data = dataset()
    example = {"idx": data.tensors[1][:args.micro], "targets": data.tensors[2][:args.micro]}
    pm = nncompile.parallelize(models.build("gpt"), example,
                               nncompile.ComputeConfig(args.plan, world),
                               pas_policy="tp" if args.plan > 1 else "dp",
                               gen_savedir=str(out / "gen"))
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2, weight_decay=0.1)
    sampler = nncompile.DataParallelSampler(data, args.micro, pm=pm, global_batch=8, seed=11)
    assert sampler.accumulation_steps == args.accum
    loader = DataLoader(data, batch_sampler=sampler)
    start = 0
    if args.resume:
        start = nncompile.load_checkpoint(args.resume, pm, opt, data=sampler)["step"]
    batches = iter(loader)
    records = []
    for step in range(start, STEPS):
        total, seen = torch.zeros(()), []
        for _ in range(args.accum):
            ids, idx, targets = next(batches)
            loss = pm(idx=idx, targets=targets) / args.accum
            loss.backward()
            total += loss.detach()
            seen.append(ids.tolist())
        opt.step()
        opt.zero_grad()
        dist.all_reduce(total)
        every = [None] * world
        dist.all_gather_object(every, (pm.dp_rank, seen))
        units = dict(every)                 # a unit's ranks saw the same samples
        order = [i for m in range(args.accum) for u in sorted(units) for i in units[u][m]]
        records.append({"step": step, "loss": total.item() / world, "data": order})
        if args.save and step + 1 == SAVE_AFTER:
            nncompile.save_checkpoint(args.save, pm, opt, format="dcp", data=sampler,
                                      extra={"step": step + 1})
    weights = pm.gather_params()
    if rank == 0:
        (out / "records.json").write_text(json.dumps(records))
        torch.save(weights, out / "final.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
