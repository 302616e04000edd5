"""Conformance cells that need real processes (tests/conformance.py): pipelines, dropout under
a plan-1 plan (the default generator is per process) and torch.compile. Each rank runs the
same `train_rank` as a simulated rank does and writes its records to
WORKDIR/<cell>/records.rank<r>.pt (or {"error": ...}); the test compares them.

    torchrun --nproc_per_node=N tests/workers/conformance.py --workdir DIR --cells a,b
    (every cell of a launch runs on N = its runtime_ngpus ranks)
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import conformance  # noqa: E402

import nncompile  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--cells", required=True)
    args = ap.parse_args()
    rank, _ = nncompile.init_distributed(backend="gloo", timeout_s=120)
    torch.set_num_threads(1)
    for name in args.cells.split(","):
        cell = conformance.BY_NAME[name]
        workdir = Path(args.workdir) / name
        workdir.mkdir(parents=True, exist_ok=True)
        if cell.compile:     # inductor draws its own random numbers unless told to use eager's
            import torch._inductor.config as inductor_config
            inductor_config.fallback_random = True
        t0 = time.time()
        try:
            rec = conformance.train_rank(cell, conformance.build_model(cell.loop), workdir,
                                         threaded=False)
        except Exception as e:                               # noqa: BLE001 - reported
            traceback.print_exc()
            rec = {"error": conformance._short(e)}
        torch.save(rec, workdir / f"records.rank{rank}.pt")
        print(f"cell {name} rank {rank}: {'error' if 'error' in rec else 'done'} "
              f"({time.time() - t0:.1f}s)", flush=True)
        status = [None] * dist.get_world_size()        # every rank failed alike: go on
        dist.all_gather_object(status, "error" in rec)
        if any(status) and not all(status):
            break
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
