"""Asynchronous vs synchronous checkpoints: how long a training step is blocked by a save.

    torchrun --nproc_per_node=2 benchmarks/async_checkpoint.py [--n-layer 12] [--repeats 3]

The GPT of examples/gpt.py at --n-layer x --n-embd (12 x 768, vocab 8192: ~93 M parameters)
under tp 2 with AdamW, so a checkpoint holds the weights and two moments (~1.1 GB). After a few
steps, alternately:

  sync    save_checkpoint(..., format="dcp"): the time the call takes is the time the step is
          blocked (every rank; the slowest rank's, as the next step waits for it).
  async   save_checkpoint(..., format="dcp", async_save=True): the step is blocked for the
          call (the buffers' copy, DCP's planning) and, in the next step, for as long as its
          optimizer step waits for DCP's background copy of the weights and optimizer state
          (that step's optimizer-step time minus the one of a step without a save); the
          files are written in the background, and wait() gives the write's end.

Each save goes to a new directory under --dir (removed at the end); the median over --repeats
of each is reported with the ratio async / sync, the step time alone and the step time during
a background write (the write shares the CPU with training), and the peak extra memory the copy
takes (the state's bytes).
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from examples.gpt import GPT  # noqa: E402

import nncompile  # noqa: E402
from benchmarks.run_record import command, write_atomic  # noqa: E402


def slowest(seconds: float) -> float:
    t = torch.tensor(seconds, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n-layer", type=int, default=12)
    ap.add_argument("--n-embd", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where the checkpoints go (default: a temp dir)")
    ap.add_argument("--results-dir", default="benchmarks/results")
    args = ap.parse_args()
    nncompile.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = GPT(vocab_size=args.vocab, block_size=args.seq, n_layer=args.n_layer,
                n_head=args.n_embd // 64, n_embd=args.n_embd)
    n_params = sum(p.numel() for p in model.parameters())
    g = torch.Generator().manual_seed(1)
    seq = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)
    batch = {"idx": seq[:, :-1], "targets": seq[:, 1:]}
    pm = nncompile.parallelize(model, batch, nncompile.ComputeConfig(2, world), pas_policy="tp",
                               gen_savedir=".nncompile/bench_async_checkpoint")
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-4)

    def train_step() -> tuple[float, float]:
        """(the step's time, its optimizer step's time), the slowest rank's."""
        dist.barrier()
        t0 = time.perf_counter()
        pm(**batch).backward()
        t1 = time.perf_counter()
        opt.step()
        t2 = time.perf_counter()
        opt.zero_grad()
        return slowest(t2 - t0), slowest(t2 - t1)

    for _ in range(2):
        train_step()
    state_bytes = sum(p.numel() * p.element_size() for p in pm.parameters()) + sum(
        t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
        if torch.is_tensor(t))
    root = [args.dir or tempfile.mkdtemp(prefix="nncompile_async_")]
    dist.broadcast_object_list(root)
    root = Path(root[0])
    sync, call, held, write, alone, during = [], [], [], [], [], []
    for i in range(args.repeats):
        step_alone, opt_alone = train_step()
        alone.append(step_alone)
        dist.barrier()
        t0 = time.perf_counter()
        nncompile.save_checkpoint(root / f"sync_{i}", pm, opt, format="dcp")
        sync.append(slowest(time.perf_counter() - t0))
        dist.barrier()
        t0 = time.perf_counter()
        pending = nncompile.save_checkpoint(root / f"async_{i}", pm, opt, format="dcp",
                                            async_save=True)
        call.append(slowest(time.perf_counter() - t0))
        step_during, opt_during = train_step()
        during.append(step_during)
        held.append(max(0.0, opt_during - opt_alone))
        pending.wait()
        write.append(slowest(time.perf_counter() - t0))
    blocked = [c + h for c, h in zip(call, held)]
    dist.barrier()
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
        med = statistics.median
        lines = [
            f"# {command('benchmarks/async_checkpoint.py', world)}",
            f"# GPT {args.n_layer} x {args.n_embd}, vocab {args.vocab}: {n_params / 1e6:.1f} M "
            f"parameters, tp 2 on {world} ranks, AdamW; {state_bytes / 2**30:.2f} GiB of "
            f"state per rank; median of {args.repeats}; torch {torch.__version__}, CPU",
            f"sync save (step blocked)      {med(sync):7.3f} s",
            f"async save (step blocked)     {med(blocked):7.3f} s   "
            f"= {med(blocked) / med(sync):.2f} x sync: the call {med(call):.3f} s + the next "
            f"optimizer step's wait for the copy {med(held):.3f} s",
            f"async save (until written)    {med(write):7.3f} s   (call to wait(), with one "
            "training step in between)",
            f"training step alone           {med(alone):7.3f} s",
            f"training step during a write  {med(during):7.3f} s",
            f"extra CPU memory of the copy  {state_bytes / 2**30:7.2f} GiB per rank",
        ]
        print("\n".join(lines))
        os.makedirs(args.results_dir, exist_ok=True)
        write_atomic(os.path.join(args.results_dir, "async_checkpoint_cpu.txt"),
                     "\n".join(lines) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
