"""nncompile data parallel vs torch DistributedDataParallel on the GPT, side by side in one run.

Every rank builds the same GPT twice: one copy wrapped in DDP, one compiled with the `dp` policy
(sync and async reducer). Training steps (forward, backward, gradient all-reduce, AdamW) of the
three alternate, so machine noise hits them alike; the medians are compared. It also compiles
the `tp` plan and reports each rank's parameter bytes as a fraction of the full model.

    python benchmarks/dp_vs_ddp.py [--nproc 2] [--steps 30] [--device cpu|cuda]
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from gpt import GPT  # noqa: E402

import nncompile  # noqa: E402


def make_model(args) -> GPT:
    torch.manual_seed(0)
    return GPT(vocab_size=512, block_size=args.block, n_layer=args.n_layer, n_head=8,
               n_embd=args.n_embd)


def timed_step(module, opt, batch, device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    module(**batch).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def tp_param_fraction(args, savedir: str) -> list[float]:
    """Each rank's parameter bytes under the tp plan (plan_ngpus = nproc) / the full model's."""
    model = make_model(args)
    batch = {"idx": torch.zeros(args.batch, args.block, dtype=torch.long),
             "targets": torch.zeros(args.batch, args.block, dtype=torch.long)}
    out = nncompile.parallelize(model, batch, nncompile.ComputeConfig(args.nproc, args.nproc),
                                pas_policy="tp", gen_savedir=savedir, instance_name="tp",
                                load_module=False)
    manifest = json.loads((out / "manifest.json").read_text())
    full = sum(p.numel() for p in model.parameters())
    fractions = []
    for r in range(args.nproc):
        local = 0
        for p in manifest["ranks"][str(r)]["params"]:
            n = 1
            for a, b in p["slices"]:
                n *= b - a
            local += n
        fractions.append(local / full)
    return fractions


def worker(rank: int, args, port: int, savedir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(args.nproc), LOCAL_RANK=str(rank), NNCOMPILE_QUIET="1")
    torch.set_num_threads(args.threads)
    nncompile.init_distributed()
    device = torch.device(f"cuda:{rank}" if args.device == "cuda" else "cpu")
    g = torch.Generator().manual_seed(rank)
    batch = {k: torch.randint(0, 512, (args.batch, args.block), generator=g).to(device)
             for k in ("idx", "targets")}
    ddp_model = make_model(args).to(device)
    ddp = torch.nn.parallel.DistributedDataParallel(
        ddp_model, device_ids=[rank] if device.type == "cuda" else None)
    runs = {"ddp": (ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-4))}
    for name, async_ in (("nncompile dp", False), ("nncompile dp async", True)):
        cfg = nncompile.ComputeConfig(1, args.nproc, use_async_reducer=async_)
        pm = nncompile.parallelize(make_model(args).to(device), batch, cfg, pas_policy="dp",
                                   gen_savedir=savedir, instance_name="dp")
        runs[name] = (pm, nncompile.build_optimizer(pm, torch.optim.AdamW, lr=1e-4))
    times: dict[str, list[float]] = {k: [] for k in runs}
    names = list(runs)
    for i in range(args.warmup + args.steps):
        for name in names[i % len(names):] + names[:i % len(names)]:      # rotate the order
            module, opt = runs[name]
            t = timed_step(module, opt, batch, device)
            if i >= args.warmup:
                times[name].append(t)
    med = {k: statistics.median(v) for k, v in times.items()}
    if rank == 0:
        n = sum(p.numel() for p in ddp_model.parameters())
        print(f"GPT {args.n_layer}L d{args.n_embd} ({n / 1e6:.1f}M params), batch "
              f"{args.batch}x{args.block} per rank, {args.nproc} ranks "
              f"({dist.get_backend()}), {args.steps} steps, {args.threads} thread(s)/rank")
        for k, v in med.items():
            print(f"  {k:<20} median train step {v * 1e3:8.2f} ms")
        for k in runs:
            if k != "ddp":
                print(f"  ratio DDP / {k}: {med['ddp'] / med[k]:.3f}  (>= 1.0: at least as fast)")
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = ap.parse_args()
    os.environ.setdefault("NNCOMPILE_QUIET", "1")
    with tempfile.TemporaryDirectory() as savedir:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(worker, args=(args, port, savedir), nprocs=args.nproc)
        fractions = tp_param_fraction(args, savedir)
    print(f"tp plan (plan_ngpus {args.nproc}): parameter bytes per rank / full model: "
          + ", ".join(f"rank {r} {f:.3f}" for r, f in enumerate(fractions)))


if __name__ == "__main__":
    main()
