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

    def diff(self, other: dict[str, Any]) -> list[str]:
        """Human-readable differences from a saved config (as written by to_json)."""
        mine = self.to_json()
        return [f"{k}: {other.get(k)!r} -> {mine.get(k)!r}" for k in sorted(set(mine) | set(other))
                if mine.get(k) != other.get(k)]
