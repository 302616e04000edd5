"""Ranks that stop agreeing (runtime/protocol/hang_report.py): tp 2 on 2 ranks, the tests' GPT, a
process-group timeout of TIMEOUT_S. After a training step, rank 0 evaluates alone while rank 1
waits in a barrier (the lockstep exchange and the input check off, so rank 0 waits in the
generated code's first collective). Each rank writes when it stopped agreeing and when its error came, then lets
the error end the program.

With --raise, rank 0 raises a ValueError of its own instead, while rank 1 trains on.

    torchrun --nproc_per_node=2 tests/workers/hang.py WORKDIR [--raise]
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import models  # noqa: E402

import nncompile  # noqa: E402

TIMEOUT_S = 8


def main() -> None:
    work = Path(sys.argv[1])
    fail = "--raise" in sys.argv
    nncompile.init_distributed(timeout_s=TIMEOUT_S)
    rank = dist.get_rank()
    pm = nncompile.parallelize(models.build("gpt"), models.batch("gpt", 0),
                               nncompile.ComputeConfig(2, 2, check_lockstep=False, check_inputs=0),
                               pas_policy="tp", gen_savedir=str(work / "gen"))
    pm(**models.batch("gpt", 0)).backward()
    dist.barrier()
    start = time.time()
    try:
        if fail:                                    # rank 0's own error; rank 1 trains on
            if rank == 0:
                raise ValueError("a bad batch on rank 0")
            pm(**models.batch("gpt", 1)).backward()
        elif rank == 0:
            pm.eval()
            with torch.no_grad():
                pm(**models.batch("gpt", 1))        # rank 0 alone: waits in a collective
        else:
            dist.barrier()                          # rank 1 went on
    except Exception:
        from nncompile.runtime.protocol.hang_report import report
        (work / f"rank{rank}.json").write_text(json.dumps({"diverged": start,
                                                           "error": time.time(),
                                                           "report": report()}))
        raise
    raise SystemExit(f"rank {rank} did not fail")


if __name__ == "__main__":
    main()
