"""Overhead of generated code on one rank: the generated module vs the eager module, forward +
backward of the GPT, median of repeated steps measured side by side (interleaved).

    python benchmarks/overhead.py [--steps 30] [--n-embd 256]
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from gpt import GPT  # noqa: E402

import nncompile  # noqa: E402


def step_time(module, idx, targets) -> float:
    start = time.perf_counter()
    loss = module(idx, targets)
    loss.backward()
    module.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=256)
    args = ap.parse_args()
    os.environ.setdefault("NNCOMPILE_QUIET", "1")
    torch.manual_seed(0)
    model = GPT(vocab_size=512, block_size=args.block, n_layer=args.n_layer, n_head=8,
                n_embd=args.n_embd)
    idx = torch.randint(0, 512, (args.batch, args.block))
    targets = torch.randint(0, 512, (args.batch, args.block))
    with tempfile.TemporaryDirectory() as savedir:
        pm = nncompile.parallelize(model, {"idx": idx, "targets": targets},
                                   nncompile.ComputeConfig(plan_ngpus=1), pas_policy="dp",
                                   gen_savedir=savedir)
        eager, generated = [], []
        for i in range(args.warmup + args.steps):
            e, g = step_time(model, idx, targets), step_time(pm, idx, targets)
            if i >= args.warmup:
                eager.append(e)
                generated.append(g)
    me, mg = statistics.median(eager), statistics.median(generated)
    print(f"GPT {args.n_layer}L d{args.n_embd} batch {args.batch}x{args.block}, "
          f"{args.steps} steps, {torch.get_num_threads()} threads")
    print(f"eager     median fwd+bwd {me * 1e3:8.2f} ms")
    print(f"generated median fwd+bwd {mg * 1e3:8.2f} ms")
    print(f"ratio generated / eager: {mg / me:.3f}")


if __name__ == "__main__":
    main()
