"""init_distributed: start the process group with a timeout, so a dead rank fails the job.

When a rank dies, its peers' next collective fails (gloo: the connection drops) or waits at
most `timeout_s` (NCCL: the watchdog aborts); groups nncompile creates inherit the timeout.
Each rank also starts a watch (hang_report.py) that says where every rank was when they stop
agreeing.

Under `torchrun --max-restarts=N` the job then starts again. torch's own env:// start keeps
its keys in the agent's store, which outlives the attempt, so the restarted ranks read the
dead attempt's addresses ("Gloo connectFullMesh failed ... Connection refused"; plain torch
2.13 here too). init_distributed gives each attempt its own key space in that store
(`attempt_<TORCHELASTIC_RESTART_COUNT>/`), so a restart connects.
"""
from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from nncompile.errors import ConfigError

DEFAULT_TIMEOUT_S = 1800.0


def _check_gpu(local_rank: int) -> None:
    """NCCL runs one process per GPU: local rank i takes cuda:i, which must exist."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if 0 <= local_rank < count:
        return
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    sees = f"{count} GPU{'' if count == 1 else 's'}" + (
        f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else "")
    fewer = (f"start at most {count} process{'' if count == 1 else 'es'} per node "
             f"(torchrun --nproc_per_node={count}), make more GPUs visible with "
             f"CUDA_VISIBLE_DEVICES, or " if count else "")
    raise ConfigError(
        f"init_distributed: local rank {local_rank} (LOCAL_RANK={local_rank}) asks for GPU "
        f"cuda:{local_rank} for the NCCL backend, but this process sees {sees}; NCCL runs "
        f"one process per GPU, so {fewer}run on CPUs with "
        f"init_distributed(backend=\"gloo\")")


def init_distributed(backend: str | None = None, timeout_s: float | None = None) -> tuple[int, int]:
    """Initialize torch.distributed from torchrun's environment (NCCL on GPUs, gloo on CPUs);
    timeout_s defaults to $NNCOMPILE_TIMEOUT_S or 30 minutes. Returns (rank, world size).
    With NCCL, local rank i runs on cuda:i; a local rank without its GPU (more processes per
    node than visible GPUs) raises ConfigError saying what to do."""
    if not dist.is_initialized():
        if timeout_s is None:
            timeout_s = float(os.environ.get("NNCOMPILE_TIMEOUT_S", DEFAULT_TIMEOUT_S))
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if backend == "nccl":
            local = int(os.environ.get("LOCAL_RANK", 0))
            _check_gpu(local)
            torch.cuda.set_device(local)
        timeout = datetime.timedelta(seconds=timeout_s)
        os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "256")   # torch's Flight Recorder, which
        store = _attempt_store(timeout)                        # hang reports read
        if store is None:
            dist.init_process_group(backend, timeout=timeout)
        else:
            dist.init_process_group(backend, store=store, rank=int(os.environ["RANK"]),
                                    world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)
        from .hang_report import start as watch_hangs
        watch_hangs(timeout_s)          # where each rank is, if they stop agreeing
    return dist.get_rank(), dist.get_world_size()


def _attempt_store(timeout: datetime.timedelta):
    """Under torchelastic: the rendezvous store with this attempt's prefix (module
    docstring); None outside torchrun (init_process_group's own env:// start)."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or "MASTER_ADDR" not in os.environ:
        return None
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          int(os.environ["WORLD_SIZE"]),
                          is_master=not agent and int(os.environ["RANK"]) == 0,
                          timeout=timeout)
    return dist.PrefixStore(f"attempt_{attempt}", store)
