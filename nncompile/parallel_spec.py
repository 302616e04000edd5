"""ParallelSpec: the mesh a plan unit is cut into and the plan's options, typed and checked
once (ComputeConfig(parallel=...)).

    ComputeConfig(plan_ngpus=4, runtime_ngpus=8,
                  parallel=ParallelSpec(pp=2, microbatches=4, schedule="1f1b"))

A plan unit's plan_ngpus ranks are pp pipeline ranks x cp context ranks x tp tensor ranks
(tp = plan_ngpus // (pp * cp), the rest); ep splits each mixture-of-experts layer's experts
over ep of a stage's tensor ranks (ep = tp: experts and tensor plan on the same ranks; ep < tp:
an ep mesh axis of ep x tp // ep). runtime_ngpus // plan_ngpus units run data-parallel. Each
count means only that. A dict works too (`parallel={"pp": 2}`); plan.json prints the spec
that planned the code ("parallel").

Before, these options were `pas_config` keys. They still work for this release: each key maps
onto its field (LEGACY_KEYS) with a FutureWarning that names the field.
"""
from __future__ import annotations

import dataclasses
import difflib
import numbers
import os
import warnings
from dataclasses import dataclass, field
from typing import Any

from .errors import ConfigError

AUTO = "auto"


def _spec(default: Any, doc: str):
    return field(default=default, metadata={"doc": doc})


@dataclass(frozen=True)
class ParallelSpec:
    """The mesh dims within a plan unit and the plan's options (module docstring)."""
    # ---- mesh dims
    pp: int | str = _spec(1, "pipeline ranks S of a plan unit (its layers cut into S * "
                             "stages_per_rank stages), or 'auto': autodist picks S")
    cp: int | str = _spec(1, "context-parallel ranks: the sequence split over them inside "
                             "each pipeline rank, or 'auto': autodist picks")
    ep: int | str = _spec(1, "expert-parallel ranks each mixture-of-experts layer's experts "
                             "and tokens split over, or 'auto': autodist decides per layer")
    # ---- pipeline
    schedule: str | None = _spec(None, "'1f1b' (the default), 'gpipe', 'interleaved_1f1b', "
                                       "'zero_bubble', 'dualpipev', or 'auto': autodist "
                                       "prices each from its action list (docs/pipeline.md)")
    microbatches: int = _spec(1, "M: each unit's batch is split into M micro-batches (without "
                                 "a pipeline, train_step accumulates over them)")
    stages_per_rank: int = _spec(1, "V: stages each pipeline rank holds (interleaved and "
                                    "zero-bubble schedules)")
    # ---- context parallelism
    cp_attention: str = _spec("allgather", "'allgather' (each rank's queries against gathered "
                                           "keys and values) or 'ulysses' (all-to-all from "
                                           "sequence to heads)")
    cp_order: str | None = _spec(None, "'zigzag' (causal work balanced; the default with "
                                       "allgather) or 'contiguous'")
    # ---- memory and overlap
    recompute_modules: list | str | None = _spec(None, "module classes or path globs whose "
                                                       "activations are recomputed in "
                                                       "backward, or 'auto' (autodist)")
    overlap_grad_sync: bool = _spec(True, "all-reduce column-split linears' input gradient "
                                          "while their weight gradients are computed")
    batched_inputs: list | None = _spec(None, "forward argument names train_step splits into "
                                              "micro-batches (default: those with the batch "
                                              "dimension)")
    # ---- autodist (passes/autodist/__init__.py)
    device: str | None = _spec(None, "device profile: a built-in name ('cpu', 'a100-80g', "
                                     "'h100-80g', 'h200') or a profile .json; default: this "
                                     "machine's accelerator, else 'cpu'")
    mem_limit_gb: float | None = _spec(None, "memory per rank the plan must fit (default: the "
                                             "profile's capacity)")
    optimizer: str = _spec("adam", "'adam', 'adamw', 'sgd', 'sgd_momentum' or 'none' (its "
                                   "state counts in memory)")
    optimizer_state_bytes: float | None = _spec(None, "optimizer state bytes per parameter "
                                                      "element (overrides optimizer)")
    solver_time_limit: float = _spec(60.0, "seconds the ILP solver may take")
    constraints: list | None = _spec(None, "pinned partitions: dicts with 'module' or 'op' "
                                           "(a glob) and 'dims', 'partial', 'replicate'")
    save_plan_path: str | None = _spec(None, "write the chosen plan to this file")
    load_plan_path: str | None = _spec(None, "reuse a saved plan (skips the ILP)")

    def __post_init__(self):
        for name in ("pp", "cp", "ep"):
            _count(name, getattr(self, name), auto=True)
        _count("microbatches", self.microbatches)
        _count("stages_per_rank", self.stages_per_rank)
        from .pipeline_config import AUTO, SCHEDULES
        if self.schedule is not None and self.schedule not in SCHEDULES \
                and self.schedule != AUTO:
            raise ConfigError(f"parallel.schedule={self.schedule!r} is not a schedule "
                              f"torch.distributed.pipelining offers here; choose one of "
                              f"{sorted(SCHEDULES)}, or 'auto' (autodist prices each)")
        if self.cp_attention not in ("allgather", "ulysses"):
            raise ConfigError(f"parallel.cp_attention={self.cp_attention!r}: 'allgather' (each "
                              "rank's query rows against gathered keys and values, the "
                              "default) or 'ulysses' (all-to-all from sequence to heads)")
        if self.cp_order not in (None, "zigzag", "contiguous") or \
                (self.cp_order == "zigzag" and self.cp_attention == "ulysses"):
            raise ConfigError(f"parallel.cp_order={self.cp_order!r}: 'zigzag' (rank r holds "
                              "chunks r and 2C-1-r of 2C, the default with 'allgather' "
                              "attention: causal work balanced) or 'contiguous' (the only "
                              "order 'ulysses' runs)")
        if not isinstance(self.overlap_grad_sync, bool):
            raise ConfigError(f"parallel.overlap_grad_sync={self.overlap_grad_sync!r}: pass "
                              "True (the default: backward all-reduces the input gradient of "
                              "column-split linears while their weight gradients are "
                              "computed) or False")
        rc = self.recompute_modules
        if not (rc is None or rc == AUTO or isinstance(rc, (list, tuple))
                and all(isinstance(x, str) for x in rc)):
            raise ConfigError(f"parallel.recompute_modules={rc!r}: a list of module class "
                              "names or module-path globs (['Block'], ['h.*']), or 'auto'")
        b = self.batched_inputs
        if not (b is None or isinstance(b, (list, tuple)) and all(isinstance(x, str) for x in b)):
            raise ConfigError(f"parallel.batched_inputs={b!r}: a list of forward argument "
                              "names, e.g. ['input_ids', 'labels']")
        for name in ("device", "save_plan_path", "load_plan_path"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, (str, os.PathLike)):
                raise ConfigError(f"parallel.{name}={v!r}: a string (a name or a path)")
        if not isinstance(self.optimizer, str):
            raise ConfigError(f"parallel.optimizer={self.optimizer!r}: 'adam', 'adamw', 'sgd', "
                              "'sgd_momentum' or 'none'")
        for name, low in (("mem_limit_gb", 0), ("optimizer_state_bytes", -1),
                          ("solver_time_limit", 0)):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, numbers.Real)
                                  or not v > low):
                raise ConfigError(f"parallel.{name}={v!r}: a number"
                                  + (" >= 0" if low < 0 else " > 0"))
        if self.constraints is not None and not isinstance(self.constraints, (list, tuple)):
            raise ConfigError("parallel.constraints must be a list of dicts like "
                              "{'module': 'layers.*.mlp', 'dims': [-1], 'replicate': False}")

    @staticmethod
    def from_dict(given: dict) -> "ParallelSpec":
        """A spec from `{"pp": 2, ...}`: ConfigError naming an unknown field (and the closest
        one, or the field an old pas_config key became)."""
        unknown = [k for k in given if k not in FIELDS]
        if unknown:
            hints = []
            for k in unknown:
                close = LEGACY_KEYS.get(k) or next(
                    iter(difflib.get_close_matches(str(k), FIELDS, n=1)), None)
                hints.append(f"{k!r}" + (f" (did you mean {close!r}?)" if close else ""))
            raise ConfigError(f"parallel has no field {', '.join(hints)}; its fields: "
                              f"{', '.join(FIELDS)} (nncompile/parallel_spec.py)")
        return ParallelSpec(**given)

    def with_legacy(self, pas_config: dict, stacklevel: int = 4) -> "ParallelSpec":
        """This spec with an old `pas_config`'s keys mapped onto their fields, and one
        FutureWarning naming the fields; ConfigError where a key and the field disagree."""
        moved = {LEGACY_KEYS[k]: v for k, v in pas_config.items()}
        clash = [f for f, v in moved.items()
                 if getattr(self, f) != FIELDS[f].default and getattr(self, f) != v]
        if clash:
            raise ConfigError(
                "pas_config and parallel both set " + ", ".join(
                    f"{f} (pas_config[{_key_of(f)!r}]={moved[f]!r}, parallel.{f}="
                    f"{getattr(self, f)!r})" for f in clash) + "; give it once, in parallel")
        spec = dataclasses.replace(self, **moved)
        warnings.warn(
            "pas_config is replaced by ComputeConfig(parallel=nncompile.ParallelSpec(...)) and "
            "goes in the next release; here: " + ", ".join(
                f"pas_config[{k!r}] -> parallel.{LEGACY_KEYS[k]}" for k in pas_config)
            + f" (that is, parallel=ParallelSpec({spec.changed_text()}))",
            FutureWarning, stacklevel=stacklevel)
        return spec

    def changed(self) -> dict[str, Any]:
        """The fields that differ from their defaults."""
        return {f: getattr(self, f) for f, fd in FIELDS.items() if getattr(self, f) != fd.default}

    def changed_text(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.changed().items())


FIELDS = {f.name: f for f in dataclasses.fields(ParallelSpec)}
# the pas_config key each field replaces (the rest kept their names)
LEGACY_KEYS = {"pipeline_stages": "pp", "pipeline_schedule": "schedule",
               "context_parallel": "cp", "context_parallel_attention": "cp_attention",
               "context_parallel_order": "cp_order", "expert_parallel": "ep",
               **{name: name for name in ("microbatches", "stages_per_rank", "recompute_modules",
                                          "overlap_grad_sync", "batched_inputs", "device",
                                          "mem_limit_gb", "optimizer", "optimizer_state_bytes",
                                          "solver_time_limit", "constraints", "save_plan_path",
                                          "load_plan_path")}}
assert set(LEGACY_KEYS.values()) == set(FIELDS), "every field replaces one pas_config key"


def _key_of(name: str) -> str:
    return next(k for k, f in LEGACY_KEYS.items() if f == name)


def _count(name: str, v: Any, auto: bool = False) -> None:
    ok = isinstance(v, int) and not isinstance(v, bool) and v >= 1
    if not ok and not (auto and v == AUTO):
        raise ConfigError(f"parallel.{name}={v!r}; give a positive int"
                          + (" or 'auto' (autodist chooses)" if auto else ""))
