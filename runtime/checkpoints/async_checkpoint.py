"""save_checkpoint(..., format="dcp", async_save=True): training goes on while the checkpoint
is written, through torch.distributed.checkpoint.async_save.

    before: save_checkpoint(d, pm, opt, format="dcp")     # the step waits for every byte
    after:  pending = save_checkpoint(d, pm, opt, format="dcp", async_save=True)
            ...                                           # training goes on
            pending.wait()                                # optional: every rank, when needed

The call blocks for the buffers' copy only (a forward updates BatchNorm statistics). DCP's
stager copies the weights and the optimizer state into CPU memory in a thread of its own while
the next forward and backward run (they read the weights; nothing else of nncompile's changes
them), and every optimizer's next `step()` waits until that copy is made. So change weights in
place only through an optimizer step, or after `pending.wait()`. A second background thread
writes the copy, talking over a gloo group of its own, so its collectives never mix with
training's. Visibility stays atomic: everything goes into `.<name>.partial/`,
and when rank 0's write completes (DCP's last step gathers every rank's result, so every rank
has written) its thread adds `extra.pt` and `checkpoint.json` and renames the directory into
place. A process killed before then leaves the previous checkpoint as the latest
(`latest_checkpoint` skips the partial directory).

One save is in flight at a time: the next save_checkpoint, `nncompile.finish()` and the end of
the program wait for it first (torch's `destroy_process_group()` does not: call `wait()` or
`nncompile.finish()` before it). `wait()` (every rank calls it) returns the directory
once it is in place, or raises the same CheckpointError on every rank if any write failed.
"""
from __future__ import annotations

import shutil
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_pre_hook


from ..protocol.groups import _CACHE, default_timeout, job_cache
from ..protocol.outcomes import agree_on_outcome
from ..protocol.lockstep import before_end

# per job (its default group): a simulated rank (nncompile.tools.simulate) has its own
_PENDING = job_cache()                  # default group -> [the AsyncCheckpoint in flight]
_COPYING = job_cache()                  # default group -> [the copy in progress]


def _job_list(cache) -> list:
    if not dist.is_initialized():
        return []
    return cache.setdefault(dist.distributed_c10d._get_default_group(), [])


def checkpoint_group():
    """The gloo group (all ranks) the background writes use (DCP's async save needs one, also
    for simulated ranks); one per job, made on first use (every rank reaches it in the same
    save_checkpoint call), dropped with the job (groups.forget_job)."""
    cache = _CACHE.setdefault(dist.distributed_c10d._get_default_group(), {})
    if "async_checkpoint" not in cache:
        cache["async_checkpoint"] = dist.new_group(backend="gloo", timeout=default_timeout())
    return cache["async_checkpoint"]


def _stager():
    """One DCP stager per job, copying in a thread of its own (the training thread goes on);
    it keeps the copy's storages from one save to the next, so later saves copy into memory
    already allocated."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    cache = _CACHE.setdefault(dist.distributed_c10d._get_default_group(), {})
    if "async_stager" not in cache:
        cache["async_stager"] = DefaultStager(StagingOptions(
            use_pinned_memory=torch.cuda.is_available(), use_shared_memory=False,
            use_async_staging=True, use_non_blocking_copy=torch.cuda.is_available()))
    return cache["async_stager"]


_step_hook: list = []


def _hold_steps_until(staged: Future) -> None:
    """Every optimizer's next step() waits until the copy is made (the step changes what is
    being copied). One global step pre-hook, installed once and never removed (torch runs
    the hooks from the live dict, which must not change while it does); it waits for the
    copy of the job of the rank that steps."""
    _job_list(_COPYING)[:] = [staged]
    if not _step_hook:
        def wait_for_copy(*_):
            copying = _job_list(_COPYING)
            if copying:
                copying[0].exception()          # waits; an error is reported by wait()
                copying.clear()
        _step_hook.append(register_optimizer_step_pre_hook(wait_for_copy))


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
            pending = _job_list(_PENDING)
            if self in pending:
                pending.remove(self)
            agree_on_outcome(self._error,
                             f"writing the checkpoint {self.path} in the background failed")
        return self.path

    def __repr__(self) -> str:
        state = "written" if self.done() else "being written"
        return f"AsyncCheckpoint({str(self.path)!r}, {state})"


def wait_pending() -> None:
    """Wait for the save in flight, if any (before the next save, and before the end)."""
    pending = _job_list(_PENDING)
    while pending:
        pending[0].wait()


def start(target: Path, staging: Path, state: dict, planner, finish) -> AsyncCheckpoint:
    """DCP's async_save of `state` into `staging`; `finish` (rank 0's, else None) runs once
    this rank's write completed."""
    import torch.distributed.checkpoint as dcp
    response = dcp.async_save(state, checkpoint_id=str(staging), planner=planner,
                              process_group=checkpoint_group(), async_stager=_stager())
    _hold_steps_until(response.staging_completion)
    handle = AsyncCheckpoint(target, staging, response.upload_completion, finish)
    _job_list(_PENDING).append(handle)
    return handle


before_end(wait_pending)   # the job's end waits for the save in flight (not a crash's: the partial
                           # directory is left, as for a killed process)
