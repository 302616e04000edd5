"""init_distributed: start the process group with a timeout, so a dead rank fails the job.

When a rank dies, its peers' next collective fails (gloo: the connection drops) or waits at
most `timeout_s` (NCCL: the watchdog aborts); groups nncompile creates inherit the timeout.
"""
from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 1800.0


def init_distributed(backend: str | None = None, timeout_s: float | None = None) -> tuple[int, int]:
    """Initialize torch.distributed from torchrun's environment (NCCL on GPUs, gloo on CPUs);
    timeout_s defaults to $NNCOMPILE_TIMEOUT_S or 30 minutes. Returns (rank, world size)."""
    if not dist.is_initialized():
        if timeout_s is None:
            timeout_s = float(os.environ.get("NNCOMPILE_TIMEOUT_S", DEFAULT_TIMEOUT_S))
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()
