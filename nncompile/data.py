"""Data-parallel batch arithmetic for a job that changes its number of data-parallel units.

    accumulation_steps(global_batch=32, micro_batch=4, dp_units=4)   # -> 2
    accumulation_steps(global_batch=32, micro_batch=4, dp_units=2)   # -> 4, after a resume
                                                                      #    on half the ranks
"""
from __future__ import annotations

from nncompile.errors import ConfigError


def accumulation_steps(global_batch: int, micro_batch: int, dp_units: int) -> int:
    """The gradient-accumulation steps that keep `global_batch` samples per optimizer step when
    each of `dp_units` data-parallel units (world size // plan_ngpus) runs micro-batches of
    `micro_batch` samples; a ConfigError when they do not divide it."""
    for name, v in (("global_batch", global_batch), ("micro_batch", micro_batch),
                    ("dp_units", dp_units)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ConfigError(f"accumulation_steps: {name}={v!r} must be a positive integer")
    per_step = micro_batch * dp_units
    if global_batch % per_step:
        raise ConfigError(
            f"accumulation_steps: a global batch of {global_batch} does not split into "
            f"micro-batches of {micro_batch} on {dp_units} data-parallel units "
            f"({per_step} samples per micro-step); choose a micro-batch that divides "
            f"{global_batch // dp_units if global_batch % dp_units == 0 else 'it'} or "
            f"another global batch")
    return global_batch // per_step
