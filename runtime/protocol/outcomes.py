"""Every rank learns every rank's outcome of a step that may fail on some (a checkpoint's
write, a staging directory), so all raise the same error or none does.

    before: rank 1's disk is full; rank 0 renames the checkpoint into place, rank 1 raises
    after:  every rank raises CheckpointError("saving the checkpoint ...: rank 1: No space ...")
"""
from __future__ import annotations

import torch.distributed as dist

from nncompile.errors import CheckpointError


def agree_on_outcome(error: str | None, what: str) -> None:
    """A barrier that carries each rank's outcome: every rank learns every rank's `error`
    (None: fine) and, if any has one, every rank raises the same CheckpointError naming
    `what` and each failed rank, so no rank is left waiting for the others."""
    errors = [error]
    if dist.is_initialized() and dist.get_world_size() > 1:
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if failed:
        raise CheckpointError(f"{what}: " + ("; ".join(f"rank {r}: {e}" for r, e in failed)
                                             if len(errors) > 1 else failed[0][1]))
