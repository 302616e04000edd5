"""Quickstart: train a small GPT with tensor parallelism on 2 CPU ranks.

    torchrun --nproc_per_node=2 examples/quickstart.py

The model (examples/gpt.py) is ordinary single-device PyTorch. nncompile traces it, splits it
across the 2 ranks with the `tp` policy and writes one readable Python file per rank.
"""
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt import GPT  # noqa: E402

import nncompile  # noqa: E402

VOCAB, BLOCK, BATCH, STEPS = 16, 32, 8, 20


def batch(step: int):
    """Sequences that count up modulo VOCAB from a random start: easy to learn."""
    g = torch.Generator().manual_seed(step)
    start = torch.randint(0, VOCAB, (BATCH, 1), generator=g)
    seq = (start + torch.arange(BLOCK + 1)) % VOCAB
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def main():
    rank, world = nncompile.init_distributed()        # NCCL on GPUs, gloo on CPUs
    device = torch.device("cuda", torch.cuda.current_device()) \
        if torch.cuda.is_available() else torch.device("cpu")
    torch.manual_seed(0)
    model = GPT(vocab_size=VOCAB, block_size=BLOCK, n_layer=2, n_head=4, n_embd=64).to(device)
    idx, targets = (t.to(device) for t in batch(0))
    config = nncompile.ComputeConfig(plan_ngpus=world, runtime_ngpus=world)
    pm = nncompile.parallelize(model, {"idx": idx, "targets": targets}, config,
                               pas_policy="tp", gen_savedir="./.nncompile", reuse="moo")
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    for step in range(STEPS):
        idx, targets = (t.to(device) for t in batch(step))
        loss = pm(idx, targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if rank == 0:
            print(f"step {step:2d}  loss {loss.item():.4f}", flush=True)
    if rank == 0:
        print(f"\nGenerated code, one file per rank: {os.path.dirname(pm.gencode_path)}/"
              f"gencode{{0..{world - 1}}}.py (plan in plan.json, IR after each pass in graphs/)")
    dist.barrier()                 # every rank done with its collectives before teardown
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
