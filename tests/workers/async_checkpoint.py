"""Asynchronous checkpoints (runtime/checkpoints/async_checkpoint.py), tp 2 on 2 ranks, the tests' GPT:

    --check: a save in the background while training goes on holds the weights of the moment
             it was called; the next save waits for it; the program's end finishes the last.
    --kill:  after a complete checkpoint `step_1`, rank 0 is killed (SIGKILL) while `step_2` is
             written (its shards on disk, the checkpoint not yet finished).

    torchrun --nproc_per_node=2 tests/workers/async_checkpoint.py WORKDIR --check|--kill
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import models  # noqa: E402

import nncompile  # noqa: E402


def step(pm, opt, i: int) -> None:
    pm(**models.batch("gpt", i)).backward()
    opt.step()
    opt.zero_grad()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("workdir")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--kill", action="store_true")
    args = ap.parse_args()
    work = Path(args.workdir)
    nncompile.init_distributed()
    rank = dist.get_rank()
    pm = nncompile.parallelize(models.build("gpt"), models.batch("gpt", 0),
                               nncompile.ComputeConfig(2, 2), pas_policy="tp",
                               gen_savedir=str(work / "gen"))
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    step(pm, opt, 0)
    if args.kill:
        first = nncompile.save_checkpoint(work / "ckpt" / "step_1", pm, opt, format="dcp",
                                          async_save=True, extra={"step": 1})
        first.wait()
        weights = pm.gather_params()
        if rank == 0:
            torch.save(weights, work / "step_1.pt")
        step(pm, opt, 1)
        if rank == 0:
            from torch.distributed.checkpoint import FileSystemWriter
            write = FileSystemWriter.write_data

            def write_then_die(self, plan, planner):
                written = write(self, plan, planner)
                written.wait()                          # this rank's shards are on disk
                os.kill(os.getpid(), signal.SIGKILL)    # killed before the save finished
            FileSystemWriter.write_data = write_then_die
        nncompile.save_checkpoint(work / "ckpt" / "step_2", pm, opt, format="dcp",
                                  async_save=True, extra={"step": 2})
        for i in range(2, 100):                         # training goes on until the kill
            step(pm, opt, i)
        raise SystemExit("rank 0 was not killed during the write")
    # --check
    at_save = pm.gather_params()
    pending = nncompile.save_checkpoint(work / "ckpt" / "step_1", pm, opt, format="dcp",
                                        async_save=True, extra={"step": 1})
    assert isinstance(pending, nncompile.AsyncCheckpoint), pending
    step(pm, opt, 1)                                   # changes the weights during the write
    second = nncompile.save_checkpoint(work / "ckpt" / "step_2", pm, opt, format="dcp",
                                       async_save=True, extra={"step": 2})
    assert pending.done() and pending.wait() == (work / "ckpt" / "step_1").absolute()
    after = pm.gather_params()
    assert any(not torch.equal(at_save[k], after[k]) for k in at_save)
    second.wait()
    assert nncompile.load_checkpoint(work / "ckpt" / "step_1", pm, opt) == {"step": 1}
    loaded = pm.gather_params()
    assert all(torch.equal(at_save[k], loaded[k]) for k in at_save), "not the saved weights"
    step(pm, opt, 2)
    nncompile.save_checkpoint(work / "ckpt" / "step_3", pm, opt, format="dcp",
                              async_save=True, extra={"step": 3})
    end = pm.gather_params()
    if rank == 0:
        torch.save(end, work / "step_3.pt")
    # no wait: the end of the program finishes the save in flight


if __name__ == "__main__":
    main()
