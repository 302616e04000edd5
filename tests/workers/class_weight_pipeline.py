"""Pipeline worker (torchrun, gloo, 2 ranks): a classifier whose per-class weights have as many
entries as the batch has rows trains under pipeline_stages=2 (1F1B, 2 micro-batches) with the
losses and weights of one device's micro-batch loop; the class weights go whole to every
micro-batch. The model and the one-device loop are tests/test_clear_errors.py's.

    torchrun --nproc_per_node=2 tests/workers/class_weight_pipeline.py --savedir DIR
"""
from __future__ import annotations

import argparse
import copy
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from test_clear_errors import ClassWeighted, _one_device_steps, _weighted_batch  # noqa: E402

import nncompile  # noqa: E402
from nncompile.rows import param_rows  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--savedir", required=True)
    args = ap.parse_args()
    nncompile.init_distributed()
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = ClassWeighted()
    ref = copy.deepcopy(model)
    batches = [_weighted_batch(s) for s in range(3)]
    pm = nncompile.parallelize(model, batches[0], nncompile.ComputeConfig(
        2, 2, parallel={"pp": 2, "microbatches": 2}), pas_policy="dp",
        gen_savedir=args.savedir)
    assert pm.BATCHED == ["x", "y"], pm.BATCHED
    opt = torch.optim.SGD(pm.parameters(), lr=0.1)
    got = []
    for b in batches:
        got.append(float(pm.train_step(**b)))
        opt.step()
        opt.zero_grad()
    want = _one_device_steps(ref, batches, 2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    full = dict(ref.named_parameters())
    rows = param_rows(pm)                   # this rank's stage's parameters
    assert rows, "no parameters on this rank"
    for row in rows:
        want_t = full[row.fqn].detach()[tuple(slice(a, b) for a, b in row.slices)]
        torch.testing.assert_close(getattr(pm, row.name).detach(), want_t, rtol=1e-5,
                                   atol=1e-6, msg=row.fqn)
    print(f"rank {rank}: ok class weights whole under a pipeline {got}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
