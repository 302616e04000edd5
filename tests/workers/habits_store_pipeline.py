"""The second habits table under a pipeline (torchrun, gloo: 2 stages, 2 micro-batches, and
`--tp 2` inside each stage, or `--zero 3` over two replicas): tests/test_habits_store.py's
loop with pm.train_step, against one device accumulating the same micro-batches. A rank lists its stages' parameters, so what
it reads per parameter is merged over the ranks first. Prints `HABITS {json}`.

    torchrun --nproc_per_node=4 tests/workers/habits_store_pipeline.py --savedir DIR --tp 2
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from test_habits_store import HABITS, _difference, _model, store_loop, table_row  # noqa: E402

import nncompile  # noqa: E402
from nncompile import ComputeConfig  # noqa: E402

M = 2                   # micro-batches per step
MERGED = ("register_hook", "grad_item", "grad_item_rank0", "param_item")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--savedir", required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--zero", type=int, default=0)      # ZeRO over the replicas left
    args = parser.parse_args()
    nncompile.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    base, batch_of = _model("gpt")
    ref = copy.deepcopy(base)
    want = store_loop(ref, ref, batch_of, rank=0)     # pm.train_step: the mean over M
    module = copy.deepcopy(base)
    cfg = ComputeConfig(2 * args.tp, world, use_zero=args.zero,
                        parallel={"pp": 2, "schedule": "1f1b", "microbatches": M})
    replicas = world // (2 * args.tp)        # a replica traces (and trains) its share
    pm = nncompile.parallelize(module, {k: v.chunk(replicas)[0] for k, v in batch_of(0).items()},
                               cfg, pas_policy="tp", gen_savedir=Path(args.savedir),
                               instance_name="store_pp")
    got = store_loop(pm, module, batch_of, rank)
    # a rank lists its stages' parameters, in the model's order
    subset = [n for n in want["names"] if n in set(got["names"])]
    got["names"] = want["names"] if got["names"] == subset and subset else got["names"]
    for habit in MERGED:                 # one device's view: every rank's together
        per_rank = [None] * world
        dist.all_gather_object(per_rank, got[habit])
        dicts = [r for r in per_rank if isinstance(r, dict)]
        words = [r for r in per_rank if isinstance(r, str)]
        if habit == "grad_item_rank0":
            got[habit] = per_rank[0]
        else:
            got[habit] = words[0] if words else {n: v for r in dicts for n, v in r.items()}
    calls = [None] * world               # each hook once per rank; every stage's together
    dist.all_gather_object(calls, got["opt_in_backward_calls"])
    once = all(len(c) == len(set(c)) for c in calls)
    got["opt_in_backward_calls"] = sorted({n for c in calls for n in c}) if once else calls[0]
    if rank == 0 and isinstance(got["grad_item_rank0"], dict):
        # rank 0 alone reads its own stage's parameters: compare those
        want["grad_item_rank0"] = {n: v for n, v in want["grad_item_rank0"].items()
                                   if n in got["grad_item_rank0"]}
    rows = [None] * world
    dist.all_gather_object(rows, table_row([got], want) if rank == 0 else
                           table_row([{**got, "grad_item_rank0": None}], want))
    if rank == 0:
        merged = {}
        for habit in HABITS:
            cells = [r[habit] for r in rows]
            words = [c for c in cells if isinstance(c, str)]
            merged[habit] = words[0] if words else max(cells)
        print("HABITS " + json.dumps(merged), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
