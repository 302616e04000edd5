"""ComputeConfig: how many ranks a plan spans and how many run it."""
from __future__ import annotations

import dataclasses
import difflib
import json
import numbers
from dataclasses import dataclass, field
from typing import Any

from .errors import ConfigError
from .float8_spec import Float8Spec, require_torchao
from .parallel_spec import LEGACY_KEYS, ParallelSpec

# The old pas_config keys (each now a ParallelSpec field, nncompile/parallel_spec.py). An
# unknown key is an error under every policy, so a typo never silently does nothing.
PAS_CONFIG_KEYS = frozenset(LEGACY_KEYS)
BOOL_FIELDS = ("constant_folding", "inference_only", "use_async_reducer", "reduce_in_fp32",
               "offload_params", "check", "compile", "init_sync", "check_lockstep")
ZERO_STAGES = (0, 1, 2, 3)
AUTO = "auto"


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_pas_config_keys(pas_config: dict) -> None:
    """ConfigError for keys no policy reads, with the closest known key as a suggestion."""
    unknown = sorted(k for k in pas_config if k not in PAS_CONFIG_KEYS)
    if not unknown:
        return
    hints = []
    for k in unknown:
        close = difflib.get_close_matches(str(k), sorted(PAS_CONFIG_KEYS), n=1)
        if close:
            hints.append(f"{k!r}: did you mean {close[0]!r}?")
    hint = (" (" + "; ".join(hints) + ")") if hints else ""
    raise ConfigError(f"unknown pas_config keys: {unknown}{hint}; known: "
                      f"{sorted(PAS_CONFIG_KEYS)} (pas_config is replaced by "
                      "ComputeConfig(parallel=nncompile.ParallelSpec(...)))")


@dataclass(frozen=True)
class ComputeConfig:
    """plan_ngpus ranks form a plan unit (the model is split across them); runtime_ngpus ranks
    run runtime_ngpus // plan_ngpus units data-parallel. runtime_ngpus defaults to the world
    size (1 without a process group)."""
    plan_ngpus: int
    runtime_ngpus: int | None = None
    constant_folding: bool = True
    inference_only: bool = False
    pas_config: dict = field(default_factory=dict)   # replaced by `parallel`: its keys map
                                                     # onto ParallelSpec's fields, with a warning
    user_config: dict = field(default_factory=dict)
    parallel: ParallelSpec | dict = field(default_factory=ParallelSpec)   # the mesh dims and
                                         # plan options (nncompile/parallel_spec.py)
    # ---- training runtime (not part of the plan: changing them reuses generated code) ----
    use_async_reducer: bool = False      # all-reduce gradient buckets while backward still runs
    reducer_bucket_cap_mb: float = 25.0  # gradients are reduced in buckets of about this size
    reduce_in_fp32: bool = False         # reduce low-precision gradients in float32
    use_zero: bool | int | str = False   # ZeRO stage 0-3 (True = 1) or "auto" (autodist picks):
                                         # 1 shards optimizer state over data-parallel ranks,
                                         # 2 also gradients, 3 also parameters (runtime/store/zero.py)
    zero_ngroups: int = 1                # shard within this many groups of data-parallel ranks
    offload_optimizer: bool | str = False  # optimizer state and step in host memory (or "auto")
    offload_params: bool = False         # ZeRO-3 parameter shards in host memory
    check: bool = False                  # after compiling, run every rank in one process and
                                         # refuse a plan whose loss or gradients differ
    compile: bool = False                # torch.compile each rank's generated forward (inductor,
                                         # collectives included): ParallelModule.compile
    init_sync: bool = True               # at load, every rank takes global rank 0's parameters
                                         # and buffers, as DDP does (runtime/program/consistency.py)
    check_inputs: int = 3                # the first N calls compare inputs (and random
                                         # generators) across each plan unit; 0 turns it off
    check_lockstep: bool = True          # before each forward whose collectives span ranks
                                         # (tp, ZeRO-3), they agree on the forward's count and
                                         # mode, or all raise (runtime/protocol/lockstep.py)
    float8: Float8Spec | str | None = None   # "tensorwise" | "rowwise" | Float8Spec: torchao's
                                         # float8 training for nn.Linear layers
                                         # (nncompile/float8_spec.py, docs/float8.md)

    def __post_init__(self):
        if not _is_int(self.plan_ngpus) or self.plan_ngpus < 1:
            raise ConfigError(f"plan_ngpus must be a positive int, got {self.plan_ngpus!r}")
        for name in BOOL_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ConfigError(f"{name}={value!r}; {name} must be a bool: choose one of "
                                  f"(True, False)")
        self._check_memory_fields()
        for name in ("pas_config", "user_config"):
            value = getattr(self, name)
            if not isinstance(value, dict):
                raise ConfigError(f"{name}={value!r}; {name} must be a dict (got "
                                  f"{type(value).__name__}), e.g. {name}={{}}")
        spec = self.parallel
        if isinstance(spec, dict):
            spec = ParallelSpec.from_dict(spec)
        elif not isinstance(spec, ParallelSpec):
            raise ConfigError(f"parallel={spec!r}; pass nncompile.ParallelSpec(...) or a dict "
                              "of its fields, e.g. parallel={'pp': 2, 'microbatches': 4}")
        if self.pas_config:
            check_pas_config_keys(self.pas_config)
            spec = spec.with_legacy(self.pas_config)
        object.__setattr__(self, "parallel", spec)
        object.__setattr__(self, "pas_config", {})
        self._check_context_parallel()
        self._check_expert_parallel()
        self._check_float8()
        if self.pipeline.enabled and self.check:     # (checks the pipeline options too)
            raise ConfigError("check=True runs the plan in one process through forward, which "
                              "a pipelined plan does not have; leave check off with "
                              "a pipeline (the parity tests cover pipelines)")
        if self.compile and self.pipeline.enabled:
            raise ConfigError("compile=True compiles the generated forward, which a pipelined "
                              "plan does not have (its stages run under torch's pipeline "
                              "schedules); leave compile off with a pipeline (parallel.pp)")
        if self.compile and self.zero_stage == 3:
            raise ConfigError("compile=True cannot trace ZeRO-3's parameter gathers (they "
                              "swap saved tensors through saved_tensors_hooks); use use_zero "
                              "0, 1 or 2 with compile, or leave compile off")
        if self.runtime_ngpus is not None:
            if not _is_int(self.runtime_ngpus) or self.runtime_ngpus < 1:
                raise ConfigError(f"runtime_ngpus must be a positive int, "
                                  f"got {self.runtime_ngpus!r}")
            if self.runtime_ngpus % self.plan_ngpus:
                raise ConfigError(
                    f"runtime_ngpus={self.runtime_ngpus} is not a multiple of plan_ngpus="
                    f"{self.plan_ngpus}: every data-parallel unit needs all plan_ngpus ranks; "
                    f"use a multiple of {self.plan_ngpus} for runtime_ngpus (and the ranks "
                    f"launched), or a plan_ngpus that divides {self.runtime_ngpus}")
        cap = self.reducer_bucket_cap_mb
        if isinstance(cap, bool) or not isinstance(cap, numbers.Real) or not cap > 0:
            raise ConfigError(f"reducer_bucket_cap_mb must be a positive number (megabytes), "
                              f"got {cap!r}")
        if not _is_int(self.check_inputs) or self.check_inputs < 0:
            raise ConfigError(f"check_inputs={self.check_inputs!r}; check_inputs is how many "
                              f"first calls compare inputs across each plan unit: an int >= 0 "
                              f"(0 turns the check off)")
        if not _is_int(self.zero_ngroups) or self.zero_ngroups < 1:
            raise ConfigError(f"zero_ngroups must be a positive int, got {self.zero_ngroups!r}")
        if self.runtime_ngpus is not None and self.dp_size % self.zero_ngroups:
            raise ConfigError(
                f"zero_ngroups={self.zero_ngroups} does not divide the {self.dp_size} "
                f"data-parallel ranks (runtime_ngpus // plan_ngpus); pick a divisor of "
                f"{self.dp_size}")

    def _check_float8(self) -> None:
        spec = Float8Spec.of(self.float8)
        object.__setattr__(self, "float8", spec)
        if spec is None:
            return
        require_torchao()
        if self.pipeline.enabled and spec.scales == "global":
            raise ConfigError("Float8Spec(scales='global') takes token amaxes over the whole "
                              "batch, which a pipeline runs micro-batch by micro-batch; use "
                              "scales='local' (each micro-batch scales its own tokens) with "
                              "parallel.pp")
        if self.check:
            raise ConfigError("check=True compares the plan with the eager model, which "
                              "float8 changes; leave check off with float8 (tests/"
                              "test_float8.py compares with torchao's float8 on one device)")

    @property
    def context_parallel(self) -> int | str:
        """C, the context-parallel ranks of a plan unit (parallel.cp, default 1): each unit
        is C context ranks x plan_ngpus // C tensor ranks; "auto": autodist chooses C."""
        return self.parallel.cp

    def _check_context_parallel(self) -> None:
        c = self.context_parallel
        if c == AUTO:
            c = 2               # the combinations below are refused for any C > 1
        elif self.plan_ngpus % c:
            divisors = [d for d in range(1, self.plan_ngpus + 1) if self.plan_ngpus % d == 0]
            raise ConfigError(f"parallel.cp={c!r}: the context-parallel ranks of a plan unit, "
                              f"an int that divides plan_ngpus={self.plan_ngpus}: one of "
                              f"{divisors}, or 'auto' (autodist chooses)")
        if c == 1:
            return
        if self.pipeline.enabled and self.context_parallel == AUTO:
            raise ConfigError("parallel.cp='auto' does not combine with a pipeline (parallel."
                              "pp) yet; give C")
        stages = self.pipeline.stages
        if self.pipeline.enabled and isinstance(stages, int) and (self.plan_ngpus // stages) % c:
            raise ConfigError(f"parallel.cp={c} splits each pipeline stage's "
                              f"ranks, but parallel.pp={stages} leaves "
                              f"{self.plan_ngpus // stages} per stage (plan_ngpus="
                              f"{self.plan_ngpus}); use a C that divides it, or more plan_ngpus")

    @property
    def expert_parallel(self) -> int | str:
        """E, the ranks each mixture-of-experts layer's experts and tokens split over
        (parallel.ep, default 1: the policy decides); "auto": autodist chooses each layer's
        split (nncompile/rules/experts.py)."""
        return self.parallel.ep

    def _check_expert_parallel(self) -> None:
        e = self.expert_parallel
        if e == AUTO and (self.context_parallel != 1 or self.pipeline.enabled):
            raise ConfigError("parallel.ep='auto' does not combine with parallel.cp or "
                              "parallel.pp yet; give E")
        if e in (1, AUTO):
            return
        stages = self.pipeline.stages if self.pipeline.enabled else 1
        width = self.plan_ngpus // stages if isinstance(stages, int) else None
        if width is not None and width % e:
            divisors = [d for d in range(1, (width or self.plan_ngpus) + 1)
                        if (width or self.plan_ngpus) % d == 0]
            raise ConfigError(
                f"parallel.ep={e!r}: the ranks each MoE layer's experts "
                f"split over, an int that divides the plan's {width or 'stage'} tensor ranks "
                f"(plan_ngpus={self.plan_ngpus}"
                f"{f', parallel.pp={stages}' if stages != 1 else ''}): one of {divisors}, "
                "or 'auto' (autodist decides). Data-parallel units (runtime_ngpus) multiply "
                "it: ep 2 x dp 2 is plan_ngpus=2, runtime_ngpus=4")
        if self.context_parallel != 1:
            raise ConfigError(f"parallel.ep={e} does not combine with parallel.cp yet; use "
                              "one of them")
        if width is not None and e < width:     # an "ep" mesh axis beside the tensor ranks
            if self.pipeline.enabled or self.use_zero not in (0, False) or \
                    self.offload_optimizer not in (False,) or self.offload_params:
                raise ConfigError(
                    f"parallel.ep={e} of plan_ngpus={self.plan_ngpus} (an "
                    f"ep axis of {e} x {width // e} tensor ranks) does not combine with "
                    "a pipeline, ZeRO or offloading yet; use parallel.ep="
                    f"{width} (experts and tensor plan on the same ranks) for those")

    def _check_memory_fields(self) -> None:
        z = self.use_zero
        if not (isinstance(z, bool) or z in ZERO_STAGES or z == AUTO) or \
                isinstance(z, float):
            raise ConfigError(f"use_zero={z!r}; use_zero is a ZeRO stage: one of 0, 1, 2, 3 "
                              f"(True is 1, False is 0) or 'auto' (autodist chooses)")
        o = self.offload_optimizer
        if not (isinstance(o, bool) or o == AUTO):
            raise ConfigError(f"offload_optimizer={o!r}; choose one of (True, False, 'auto')")
        if self.offload_params and self.zero_stage not in (3, AUTO):
            raise ConfigError(f"offload_params=True keeps ZeRO-3's parameter shards in host "
                              f"memory, but use_zero={z!r} does not shard parameters; use "
                              f"use_zero=3 (or 'auto') with it, or offload_optimizer=True alone")
        if self.inference_only and (self.zero_stage not in (0, 1) or o is not False):
            raise ConfigError("inference_only=True trains nothing: ZeRO stages 2/3 and "
                              "offload_optimizer need training; leave them at their defaults")

    @property
    def zero_stage(self) -> int | str:
        """use_zero as a stage number (True is 1, False is 0), or "auto"."""
        z = self.use_zero
        return int(z) if isinstance(z, bool) else z

    @property
    def code_fields(self) -> dict[str, Any]:
        """The memory fields that shape the generated code: ZeRO-3 gathers parameters in the
        forward, and "auto" values are resolved by the plan. Empty otherwise, so plans without
        them keep their fingerprints."""
        if self.zero_stage not in (3, AUTO) and self.offload_optimizer != AUTO:
            return {}
        return {"use_zero": self.zero_stage, "zero_ngroups": self.zero_ngroups,
                "offload_optimizer": self.offload_optimizer,
                "offload_params": self.offload_params}

    @property
    def pipeline(self):
        """The pipeline options (nncompile/pipeline_config.py)."""
        from .pipeline_config import pipeline_config
        return pipeline_config(self.parallel, self.plan_ngpus)

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
        return _plan_view(self.to_json())

    def diff(self, other: dict[str, Any]) -> list[str]:
        """Human-readable differences in plan fields from a saved config (as written by
        to_json)."""
        mine, other = _flat(self.plan_json()), _flat(_plan_view(other))
        return [f"{k}: {other.get(k)!r} -> {mine.get(k)!r}" for k in sorted(set(mine) | set(other))
                if mine.get(k) != other.get(k)]


RUNTIME_FIELDS = ("use_async_reducer", "reducer_bucket_cap_mb", "reduce_in_fp32", "use_zero",
                  "zero_ngroups", "offload_optimizer", "offload_params", "check", "compile",
                  "init_sync", "check_inputs", "check_lockstep")


def _plan_view(saved: dict[str, Any]) -> dict[str, Any]:
    """The plan fields of a to_json() dict, plus the memory fields when they shape code."""
    out = {k: v for k, v in saved.items() if k not in RUNTIME_FIELDS}
    if out.get("float8") is None:       # plans without float8 keep their fingerprints
        out.pop("float8", None)
    z = saved.get("use_zero", False)
    z = int(z) if isinstance(z, bool) else z
    o = saved.get("offload_optimizer", False)
    if z in (3, AUTO) or o == AUTO:
        out["memory"] = {"use_zero": z, "zero_ngroups": saved.get("zero_ngroups", 1),
                         "offload_optimizer": o,
                         "offload_params": saved.get("offload_params", False)}
    return out


def _flat(view: dict[str, Any]) -> dict[str, Any]:
    """The spec's fields as "parallel.<field>" entries, so a difference names the field."""
    out = {k: v for k, v in view.items() if k != "parallel"}
    out.update({f"parallel.{k}": v for k, v in (view.get("parallel") or {}).items()})
    return out
