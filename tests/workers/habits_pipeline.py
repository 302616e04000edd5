"""The habits group under a pipeline (torchrun, 2 gloo ranks: 2 stages, 2 micro-batches):
tests/test_habits.py's loop with pm.train_step, against one device. Each rank holds one
stage, so what a rank reads per parameter (gradient norms) is merged over the ranks first.
Prints one line, `HABITS {json}`: per habit the largest difference, or what happened instead.

    torchrun --nproc_per_node=2 tests/workers/habits_pipeline.py --savedir DIR
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from test_habits import HABITS, _difference, _model, habits_loop  # noqa: E402

import nncompile  # noqa: E402
from nncompile import ComputeConfig  # noqa: E402

M = 2                   # micro-batches per step


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--savedir", required=True)
    args = parser.parse_args()
    nncompile.init_distributed()
    savedir = Path(args.savedir)
    base, batch_of, block = _model("gpt")
    ref = copy.deepcopy(base)
    want = habits_loop(ref, ref, batch_of, block, micro=M)
    want["dcp"] = want["saved"]
    module = copy.deepcopy(base)
    cfg = ComputeConfig(2, 2, parallel={"pp": 2, "schedule": "1f1b",
                                          "microbatches": M})
    pm = nncompile.parallelize(module, batch_of(0), cfg, pas_policy="tp",
                               gen_savedir=savedir / "gen", instance_name="habits_pp")
    got = habits_loop(pm, module, batch_of, block, savedir=savedir / "dcp", micro=M)
    # each rank reads its stage's gradients: one device's view is every rank's together
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, got["grad_norms"])
    got["grad_norms"] = [{n: v for rank in per_rank for n, v in rank[step].items()}
                         for step in range(len(got["grad_norms"]))]
    if not isinstance(got.get("dcp", ""), str):          # resumed under dp, torch's API only
        from torch.distributed.checkpoint.state_dict import (get_model_state_dict,
                                                             set_model_state_dict)
        import torch.distributed.checkpoint as dcp
        fresh = copy.deepcopy(base)
        pm2 = nncompile.parallelize(fresh, batch_of(0), ComputeConfig(1, 2), pas_policy="dp",
                                    gen_savedir=savedir / "gen", instance_name="habits_pp_dcp")
        state = get_model_state_dict(pm2.module)
        dcp.load(state, checkpoint_id=savedir / "dcp")
        set_model_state_dict(pm2.module, state)
        got["dcp"] = pm2.gather_params()
    row = {}
    for habit in HABITS:
        d = _difference(habit, got[habit], want[habit])
        row[habit] = d
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    if dist.get_rank() == 0:
        merged = {}
        for habit in HABITS:
            words = [r[habit] for r in rows if isinstance(r[habit], str)]
            merged[habit] = words[0] if words else max(r[habit] for r in rows)
        print("HABITS " + json.dumps(merged), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
