"""ComputeConfig: how many ranks a plan spans and how many run it."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from .errors import ConfigError


@dataclass(frozen=True)
class ComputeConfig:
    """plan_ngpus ranks form a plan unit (the model is split across them); runtime_ngpus ranks
    run runtime_ngpus // plan_ngpus units data-parallel. runtime_ngpus defaults to the world
    size (1 without a process group)."""
    plan_ngpus: int
    runtime_ngpus: int | None = None
    constant_folding: bool = True
    inference_only: bool = False
    pas_config: dict = field(default_factory=dict)
    user_config: dict = field(default_factory=dict)
    # ---- training runtime (not part of the plan: changing them reuses generated code) ----
    use_async_reducer: bool = False      # all-reduce gradient buckets while backward still runs
    reducer_bucket_cap_mb: float = 25.0  # gradients are reduced in buckets of about this size
    reduce_in_fp32: bool = False         # reduce low-precision gradients in float32
    use_zero: bool = False               # ZeRO-1: shard optimizer state over data-parallel ranks
    zero_ngroups: int = 1                # shard within this many groups of data-parallel ranks
    check: bool = False                  # after compiling, run every rank in one process and
                                         # refuse a plan whose loss or gradients differ

    def __post_init__(self):
        if not isinstance(self.plan_ngpus, int) or self.plan_ngpus < 1:
            raise ConfigError(f"plan_ngpus must be a positive int, got {self.plan_ngpus!r}")
        if self.runtime_ngpus is not None:
            if not isinstance(self.runtime_ngpus, int) or self.runtime_ngpus < 1:
                raise ConfigError(f"runtime_ngpus must be a positive int, "
                                  f"got {self.runtime_ngpus!r}")
            if self.runtime_ngpus % self.plan_ngpus:
                raise ConfigError(
                    f"runtime_ngpus={self.runtime_ngpus} is not a multiple of plan_ngpus="
                    f"{self.plan_ngpus}: every data-parallel unit needs all plan_ngpus ranks; "
                    f"use runtime_ngpus in {[self.plan_ngpus * k for k in (1, 2, 4)]}...")
        if not self.reducer_bucket_cap_mb > 0:
            raise ConfigError(f"reducer_bucket_cap_mb must be > 0, got {self.reducer_bucket_cap_mb}")
        if not isinstance(self.zero_ngroups, int) or self.zero_ngroups < 1:
            raise ConfigError(f"zero_ngroups must be a positive int, got {self.zero_ngroups!r}")
        if self.runtime_ngpus is not None and self.dp_size % self.zero_ngroups:
            raise ConfigError(
                f"zero_ngroups={self.zero_ngroups} does not divide the {self.dp_size} "
                f"data-parallel ranks (runtime_ngpus // plan_ngpus); pick a divisor of "
                f"{self.dp_size}")

    @property
    def dp_size(self) -> int:
        return (self.runtime_ngpus or self.plan_ngpus) // self.plan_ngpus

    def resolved(self, world_size: int) -> "ComputeConfig":
        """This config with runtime_ngpus filled in from the world size."""
        if self.runtime_ngpus is not None:
            return self
        return dataclasses.replace(self, runtime_ngpus=world_size)

    def to_json(self) -> dict[str, Any]:
        return json.loads(json.dumps(dataclasses.asdict(self), default=repr, sort_keys=True))

    def plan_json(self) -> dict[str, Any]:
        """The fields that shape the generated code (what reuse compares)."""
        return {k: v for k, v in self.to_json().items() if k not in RUNTIME_FIELDS}

    def diff(self, other: dict[str, Any]) -> list[str]:
        """Human-readable differences in plan fields from a saved config (as written by
        to_json)."""
        mine = self.plan_json()
        other = {k: v for k, v in other.items() if k not in RUNTIME_FIELDS}
        return [f"{k}: {other.get(k)!r} -> {mine.get(k)!r}" for k in sorted(set(mine) | set(other))
                if mine.get(k) != other.get(k)]


RUNTIME_FIELDS = ("use_async_reducer", "reducer_bucket_cap_mb", "reduce_in_fp32", "use_zero",
                  "zero_ngroups", "check")
