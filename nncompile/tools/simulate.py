"""Run every rank of a job in one process: one thread per rank over PyTorch's threaded process
group (`torch.testing._internal.distributed.multi_threaded_pg`, the backend DTensor's own tests
use, installed through nncompile.compat), so collectives move real tensors between threads.

    results = run_ranks(4, lambda rank: train_one_step(rank))   # [result of rank 0, 1, 2, 3]

Each thread initializes its own default group (`rank`, `world_size`, a shared HashStore);
autograd runs backward on the calling thread while the threaded group is installed, so a
rank's collectives in backward meet its peers'. An exception on any rank is re-raised in the
caller naming the rank. The caller's own process group, if any, is restored afterwards.
"""
from __future__ import annotations

import sys
import threading
from typing import Any, Callable

import torch.distributed as dist

from .. import compat
from ..runtime.protocol.lockstep import finish

_LOCK = threading.Lock()       # one simulated job at a time per process


class RankFailed(RuntimeError):
    """A simulated rank raised; the original exception is the __cause__."""


def run_ranks(world_size: int, fn: Callable[[int], Any], timeout_s: float = 600.0) -> list[Any]:
    """fn(rank) on `world_size` threads with a threaded default process group each."""
    with _LOCK:
        store = dist.HashStore()
        results: list[Any] = [None] * world_size
        errors: list[BaseException | None] = [None] * world_size
        excepthook = sys.excepthook            # init_process_group wraps it on every call
        compat.install_threaded_pg()

        def worker(rank: int) -> None:
            try:
                dist.init_process_group("threaded", rank=rank, world_size=world_size,
                                        store=store)
                try:
                    results[rank] = fn(rank)
                finally:
                    try:
                        finish()                # what the job cached goes with it
                    finally:
                        dist.destroy_process_group()
            except BaseException as e:          # noqa: BLE001 - reported to the caller
                errors[rank] = e
                _abort_peers(world_size)

        threads = [threading.Thread(target=worker, args=(r,), name=f"nncompile-rank{r}",
                                    daemon=True) for r in range(world_size)]
        try:
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout_s)
            stuck = [r for r, t in enumerate(threads) if t.is_alive()]
        finally:
            compat.uninstall_threaded_pg()
            sys.excepthook = excepthook
        failed = [r for r, e in enumerate(errors) if e is not None]
        if failed:
            first = min(failed, key=lambda r: isinstance(errors[r], _PeerAborted))
            raise RankFailed(f"simulated rank {first} of {world_size} raised "
                             f"{type(errors[first]).__name__}: {errors[first]}") \
                from errors[first]
        if stuck:
            raise RankFailed(f"simulated ranks {stuck} of {world_size} did not finish in "
                             f"{timeout_s:.0f}s (a collective that not every rank reached)")
        return results


class _PeerAborted(RuntimeError):
    pass


def _abort_peers(world_size: int) -> None:
    """Wake ranks blocked in a collective that the failed rank will never join."""
    compat.abort_threaded_collectives(_PeerAborted("a peer rank failed"))
