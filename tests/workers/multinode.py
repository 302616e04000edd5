"""Two-node worker (torchrun --nnodes=2 --nproc_per_node=2, gloo): each node runs in its own
working directory with a relative gen_savedir, so the nodes share no generated files. Rank 0
compiles the GPT (tp, 2x4); node 1 gets the files over the process group. Both nodes then train
with parity: every step's loss and gathered gradients equal a single-device run (units see
different batches; the reference gradient is the units' average). A second parallelize() with
the files already in place on both nodes must not rewrite node 1's copy.

    torchrun --nnodes=2 --nproc_per_node=2 --node_rank=K ... tests/workers/multinode.py
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import models  # noqa: E402

import nncompile  # noqa: E402

RTOL, ATOL = 1e-5, 1e-6
STEPS, LR, PLAN, RUNTIME = 3, 0.1, 2, 4
SAVEDIR, INSTANCE = "./gen", "gpt_tp"


def batch(step: int, unit: int) -> dict[str, torch.Tensor]:
    return models.batch("gpt", 10 * step + unit)


def reference(n_units: int):
    """Single-device SGD on the units' batches: per-step losses and averaged gradients."""
    model = models.build("gpt")
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads = [], []
    for step in range(STEPS):
        step_losses = []
        for u in range(n_units):
            loss = model(**batch(step, u))
            (loss / n_units).backward()         # dividing by 2 is exact: the units' average
            step_losses.append(loss.detach())
        losses.append(step_losses)
        grads.append({k: p.grad.clone() for k, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    return losses, grads


def main() -> None:
    nncompile.init_distributed("gloo", timeout_s=400)
    rank, node = dist.get_rank(), os.environ["GROUP_RANK"]
    unit = rank // PLAN
    cfg = nncompile.ComputeConfig(plan_ngpus=PLAN, runtime_ngpus=RUNTIME)
    pm = nncompile.parallelize(models.build("gpt"), batch(0, 0), cfg, pas_policy="tp",
                               gen_savedir=SAVEDIR, reuse="override", instance_name=INSTANCE)
    local = os.path.abspath(os.path.join(SAVEDIR, INSTANCE))
    assert os.path.dirname(pm.gencode_path) == local, (pm.gencode_path, local)
    ref_losses, ref_grads = reference(RUNTIME // PLAN)
    opt = torch.optim.SGD(pm.parameters(), lr=LR)
    for step in range(STEPS):
        loss = pm(**batch(step, unit))
        loss.backward()
        grads = pm.gather_grads()
        torch.testing.assert_close(loss.detach(), ref_losses[step][unit], rtol=RTOL, atol=ATOL,
                                   msg=lambda m: f"rank {rank} step {step} loss: {m}")
        assert set(grads) == set(ref_grads[step]), (sorted(grads), sorted(ref_grads[step]))
        for fqn, g in grads.items():
            want = ref_grads[step][fqn]
            torch.testing.assert_close(
                g, want, rtol=RTOL, atol=ATOL * max(1.0, float(want.abs().max())),
                msg=lambda m: f"rank {rank} step {step} grad {fqn}: {m}")
        opt.step()
        opt.zero_grad()
    # the files are now in place on both nodes: a second call reuses them and sends nothing
    manifest = os.path.join(local, "manifest.json")
    before = os.stat(manifest).st_ino
    dist.barrier()
    nncompile.parallelize(models.build("gpt"), batch(0, 0), cfg, pas_policy="tp",
                          gen_savedir=SAVEDIR, reuse="match", instance_name=INSTANCE)
    assert os.stat(manifest).st_ino == before, f"rank {rank}: reuse rewrote {local}"
    print(f"ok rank {rank} node {node}: {STEPS} SGD steps with parity, final loss "
          f"{float(loss):.5f}, loaded {pm.gencode_path}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
