"""Quickstart: train a small GPT on 2 CPU ranks, split two ways, side by side.

    torchrun --nproc_per_node=2 examples/quickstart.py

The model (examples/gpt.py) is ordinary single-device PyTorch. nncompile traces it and splits
it across the 2 ranks twice: with the `tp` policy (Megatron tensor parallelism, written to
.nncompile/GPT/) and with the `autodist` policy (the planner picks the split from its cost
model, written to .nncompile/autodist/GPT/). Both copies train on the same batches; each
rank runs one readable Python file per plan. At the end rank 0 says what each plan
communicates per training step (from its plan.json).
"""
import collections
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt import GPT  # noqa: E402

import nncompile  # noqa: E402

VOCAB, BLOCK, BATCH, STEPS = 16, 32, 8, 20
# policy -> gen_savedir; `python -m nncompile show DIR` explains either
PLANS = {"tp": "./.nncompile", "autodist": "./.nncompile/autodist"}


def batch(step: int):
    """Sequences that count up modulo VOCAB from a random start: easy to learn."""
    g = torch.Generator().manual_seed(step)
    start = torch.randint(0, VOCAB, (BATCH, 1), generator=g)
    seq = (start + torch.arange(BLOCK + 1)) % VOCAB
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def summary(policy: str, gen_dir: str) -> str:
    """What the plan in gen_dir does, from its plan.json: placements and collectives."""
    plan = json.loads(open(os.path.join(gen_dir, "plan.json")).read())
    places = collections.Counter(plan["params"].values())
    weights = ", ".join(f"{n} {p}" for p, n in sorted(places.items()))
    kinds = ", ".join(f"{n} {k.removeprefix('comm.')}"
                      for k, n in sorted(plan["collectives"].items()))
    lines = [f"{policy}: {gen_dir}/",
             f"  weights: {weights}",
             f"  collectives per step: {sum(plan['collectives'].values())} ({kinds})",
             f"  gradients all-reduced after backward: {len(plan['partial_grad_params'])}"]
    if plan.get("autodist"):
        lines.append(f"  autodist estimate: {plan['autodist']['objective_ms']:.2f} ms/step on "
                     f"{plan['autodist']['device']}")
    return "\n".join(lines)


def main():
    rank, world = nncompile.init_distributed()        # NCCL on GPUs, gloo on CPUs
    device = torch.device("cuda", torch.cuda.current_device()) \
        if torch.cuda.is_available() else torch.device("cpu")
    idx, targets = (t.to(device) for t in batch(0))
    config = nncompile.ComputeConfig(plan_ngpus=world, runtime_ngpus=world)
    models, opts = {}, {}
    for policy, savedir in PLANS.items():
        torch.manual_seed(0)                           # the same initial weights for both
        model = GPT(vocab_size=VOCAB, block_size=BLOCK, n_layer=2, n_head=4, n_embd=64)
        models[policy] = nncompile.parallelize(
            model.to(device), {"idx": idx, "targets": targets}, config, pas_policy=policy,
            gen_savedir=savedir, reuse="moo")
        opts[policy] = torch.optim.AdamW(models[policy].parameters(), lr=1e-2)
    for step in range(STEPS):
        idx, targets = (t.to(device) for t in batch(step))
        losses = []
        for policy, pm in models.items():
            loss = pm(idx, targets)
            loss.backward()
            opts[policy].step()
            opts[policy].zero_grad(set_to_none=True)
            losses.append(f"{policy} {loss.item():.4f}")
        if rank == 0:
            print(f"step {step:2d}  loss " + "  ".join(losses), flush=True)
    if rank == 0:
        for policy, pm in models.items():
            print("\n" + summary(policy, os.path.relpath(os.path.dirname(pm.gencode_path))))
        print(f"\nGenerated code, one file per rank: "
              f"{os.path.dirname(models['tp'].gencode_path)}/gencode{{0..{world - 1}}}.py "
              "(plan in plan.json, IR after each pass in graphs/)", flush=True)
    dist.barrier()                 # every rank done with its collectives before teardown
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
