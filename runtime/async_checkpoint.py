"""save_checkpoint(..., format="dcp", async_save=True): training goes on while the checkpoint
is written, through torch.distributed.checkpoint.async_save.

    before: save_checkpoint(d, pm, opt, format="dcp")     # the step waits for every byte
    after:  pending = save_checkpoint(d, pm, opt, format="dcp", async_save=True)
            ...                                           # training goes on
            pending.wait()                                # optional: every rank, when needed

The call blocks only while DCP copies the state into CPU memory (its stager; the copy is what
the write reads, so the next optimizer step may change the weights). The files are then
written by a background thread that talks over a gloo group of its own, so its collectives
never mix with training's. Visibility stays atomic: everything goes into `.<name>.partial/`,
and when rank 0's write completes (DCP's last step gathers every rank's result, so every rank
has written) its thread adds `extra.pt` and `checkpoint.json` and renames the directory into
place. A process killed before then leaves the previous checkpoint as the latest
(`latest_checkpoint` skips the partial directory).

One save is in flight at a time: the next save_checkpoint, `destroy_process_group()` and the
end of the program wait for it first. `wait()` (every rank calls it) returns the directory
once it is in place, or raises the same CheckpointError on every rank if any write failed.
"""
from __future__ import annotations

import atexit
import shutil
import sys
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Callable

import torch.distributed as dist

from nncompile.errors import CheckpointError

from .groups import _CACHE, default_timeout

_pending: list["AsyncCheckpoint"] = []


def checkpoint_group():
    """The gloo group (all ranks) the background writes use; one per job, made on first use
    (every rank reaches it in the same save_checkpoint call)."""
    cache = _CACHE.setdefault(dist.distributed_c10d._get_default_group(), {})
    if "async_checkpoint" not in cache:
        cache["async_checkpoint"] = dist.new_group(backend="gloo", timeout=default_timeout())
    return cache["async_checkpoint"]


class AsyncCheckpoint:
    """A checkpoint being written in the background (save_checkpoint(..., async_save=True))."""

    def __init__(self, target: Path, staging: Path, upload: Future,
                 finish: Callable[[], None] | None):
        self.path, self._staging = target, staging
        self._upload = upload
        self._finished = threading.Event()
        self._error: str | None = None
        self._waited = False

        def finish_when_written(fut: Future) -> None:
            try:
                fut.result()
                if finish is not None:          # rank 0: extra.pt, checkpoint.json, rename
                    finish()
            except BaseException as e:  # noqa: BLE001 - reported by wait() on every rank
                self._error = f"{type(e).__name__}: {e}"
                if finish is not None:
                    shutil.rmtree(staging, ignore_errors=True)
            finally:
                self._finished.set()
        upload.add_done_callback(finish_when_written)

    def done(self) -> bool:
        """Whether this rank's part is written (and, on rank 0, the checkpoint in place)."""
        return self._finished.is_set()

    def wait(self) -> Path:
        """Block until the checkpoint is in place on every rank (every rank calls it); a failed
        write raises the same CheckpointError everywhere. Waiting again returns at once."""
        self._finished.wait()
        if not self._waited:
            self._waited = True
            if self in _pending:
                _pending.remove(self)
            from .checkpoint import agree
            agree(self._error, f"writing the checkpoint {self.path} in the background failed")
        return self.path

    def __repr__(self) -> str:
        state = "written" if self.done() else "being written"
        return f"AsyncCheckpoint({str(self.path)!r}, {state})"


def wait_pending() -> None:
    """Wait for the save in flight, if any (before the next save, and before the end)."""
    while _pending:
        _pending[0].wait()


def start(target: Path, staging: Path, state: dict, planner, finish) -> AsyncCheckpoint:
    """DCP's async_save of `state` into `staging`; `finish` (rank 0's, else None) runs once
    this rank's write completed."""
    import torch.distributed.checkpoint as dcp
    upload = dcp.async_save(state, checkpoint_id=str(staging), planner=planner,
                            process_group=checkpoint_group())
    if not isinstance(upload, Future):          # a stager that stages in the background
        upload = upload.upload_completion
    handle = AsyncCheckpoint(target, staging, upload, finish)
    _pending.append(handle)
    return handle


def _finish_at_exit() -> None:
    """The end of the program waits for the save in flight, unless it ends by an exception
    (a crash must not wait; the partial directory is left, as for a killed process)."""
    if _pending and sys.exc_info()[0] is None and getattr(sys, "last_value", None) is None \
            and dist.is_initialized():
        wait_pending()


atexit.register(_finish_at_exit)
