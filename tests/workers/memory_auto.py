"""autodist chooses the ZeRO stage under a memory limit, and the measured peak matches its
prediction (torchrun, gloo, 4 ranks):

    torchrun --nproc_per_node=4 tests/workers/memory_auto.py --dir DIR

1. autodist plans the GPT at dp 4 with use_zero="auto" and no limit: its candidates list every
   ZeRO stage's predicted bytes per rank;
2. again with mem_limit_gb halfway between the ZeRO-1 and ZeRO-3 predictions: it must pick
   ZeRO-2 or ZeRO-3 (or recompute), whichever its model says fits fastest;
3. three AdamW steps of that plan under nncompile.memory.profile: every rank's measured peak is
   within 15 % of the predicted per-rank total.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from models import GPT  # noqa: E402

import nncompile  # noqa: E402
from nncompile import memory  # noqa: E402

T, B = 64, 8


def build():
    torch.manual_seed(0)
    return GPT(vocab_size=256, block_size=T, n_layer=4, n_head=4, n_embd=128)


def batch(rank: int, step: int = 0):
    g = torch.Generator().manual_seed(100 * step + rank)
    return {"idx": torch.randint(0, 256, (B, T), generator=g),
            "targets": torch.randint(0, 256, (B, T), generator=g)}


def compile_(d: Path, name: str, **pas):
    cfg = nncompile.ComputeConfig(1, dist.get_world_size(), use_zero="auto",
                                  parallel={"device": "cpu", **pas})
    pm = nncompile.parallelize(build(), batch(dist.get_rank()), cfg, pas_policy="autodist",
                               gen_savedir=d, instance_name=name)
    return pm, json.loads((d / name / "plan.json").read_text())["autodist"]["memory"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    args = ap.parse_args()
    nncompile.init_distributed("gloo")
    d = Path(args.dir)
    rank = dist.get_rank()
    _, free = compile_(d, "free")
    totals = {c["choice"]["zero"]: c["total"] for c in free["candidates"]
              if not c["choice"]["offload_optimizer"] and not c["choice"]["recompute"]}
    limit = (totals[1] + totals[3]) / 2
    pm, mem = compile_(d, "limited", mem_limit_gb=limit / 1e9)
    choice, predicted = mem["choice"], mem["per_rank_bytes"]["total"]
    assert choice["zero"] in (2, 3) or choice["recompute"], choice
    assert predicted <= limit, (predicted, limit)
    assert pm.memory.zero == choice["zero"]
    opt = nncompile.build_optimizer(pm, torch.optim.AdamW, lr=1e-3)
    steps = iter(range(1, 100))

    def step():
        loss = pm(**batch(rank, next(steps)))
        loss.backward()
        opt.step()
        opt.zero_grad()
    prof = memory.profile(pm, step, steps=3, optimizer=opt, predicted=False, gather=False)
    peak = prof.ranks[0].peak_bytes if hasattr(prof, "ranks") else prof.peak_bytes
    err = abs(peak - predicted) / predicted
    peaks = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, (peak, err))
    if rank == 0:
        print(f"ok memory auto: limit {limit / 1e6:.3f} MB, ZeRO candidates "
              f"{ {k: round(v / 1e6, 3) for k, v in totals.items()} } MB, chose {choice}, "
              f"predicted {predicted / 1e6:.3f} MB/rank, measured peaks "
              f"{[round(p / 1e6, 3) for p, _ in peaks]} MB "
              f"(largest error {max(e for _, e in peaks):.1%})", flush=True)
    assert all(e <= 0.15 for _, e in peaks), peaks
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
