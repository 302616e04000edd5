"""Measured memory per rank, by category, next to the predicted memory of the plan.

    prof = nncompile.memory.profile(pm, step_fn, steps=3, optimizer=opt)
    print(prof.table())                 # predicted vs measured, per category and peak
    prof.save("memory.json")            # then: python -m nncompile memory memory.json -o mem.png

`profile` runs `step_fn()` (one training step) `steps` times under torch.profiler
(profile_memory, record_shapes, with_stack) and sorts every allocation on this rank's device
into CATEGORIES (nncompile/tools/memory_timeline.py):

    parameters             storages of pm.parameters()
    gradients              what PyTorch's memory profiler calls a gradient
    optimizer_state        storages the optimizer holds after the run: optimizer.state and
                           copies of parameters it steps (ZeRO's flat shards)
    communication_buffers  made inside nncompile's collectives: a Python frame of
                           nncompile/runtime/program/comm.py, reducer.py or zero.py, or a
                           record_function named "nncompile.comm*", and not a gradient
    activations            made by the generated forward, or called an activation by PyTorch
    other                  the rest: backward and optimizer temporaries, inputs, autograd detail

PyTorch's categories come from torch.profiler._memory_profiler (the analysis behind the
deprecated `export_memory_timeline`; there is no public API for them). Parameters, gradients
and optimizer state are also counted from the tensors themselves (`tensors` in the result).
"""
from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch.distributed.tensor import DTensor

from ..errors import ConfigError

CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations",
              "communication_buffers", "other")
PERSISTENT = ("parameters", "gradients", "optimizer_state")
FORMAT, VERSION = "nncompile-memory-profile", 1
COMM_FILES = {"comm.py": "program", "reducer.py": "program",   # file -> its package in
              "zero.py": "store"}                            # nncompile/runtime/
COMM_SCOPE = "nncompile.comm"                           # record_function name prefix
STEP_SCOPE = "nncompile.memory.step"
COPY_SCOPE = "nncompile.offload."                      # offload's copies (runtime/store/zero.py)
MAX_POINTS = 2000                                       # timeline points kept per rank


@dataclass
class RankMemory:
    """One rank's measurement. Bytes are ints; times are ms since the first step began."""
    rank: int
    device: str
    peak_bytes: int                      # largest total of the timeline
    peak_ms: float
    peak_event: int                      # the number of the change that reached the peak
    at_peak: dict[str, int]              # each category at that moment
    max_bytes: dict[str, int]            # each category's own maximum over the run
    tensors: dict[str, int | None]       # counted from pm's tensors, grads, optimizer.state
    times_ms: list[float] = field(default_factory=list)
    events: list[int] = field(default_factory=list)             # each point's change number
    bytes: dict[str, list[int]] = field(default_factory=dict)   # per category, per time
    steps_ms: list[list[float]] = field(default_factory=list)   # [start, end] of each step
    # offload's host<->device copies (runtime/store/zero.py, optimizer.py): [start, end, name]
    copies_ms: list[list] = field(default_factory=list)
    allocator_peak_bytes: int | None = None      # CUDA: torch.cuda.max_memory_allocated
    allocator_reserved_bytes: int | None = None  # CUDA: torch.cuda.max_memory_reserved
    source: str = "torch.profiler memory profile"


@dataclass
class MemoryProfile:
    """What nncompile.memory.profile measured: one RankMemory per rank (all ranks on rank 0
    when gathered), and the prediction the table compares with."""
    ranks: list[RankMemory]
    steps: int
    world_size: int = 1
    plan_ngpus: int = 1
    predicted: dict[str, Any] | None = None   # {"source": str, "per_rank_bytes": {cat: int}}
    torch_version: str = torch.__version__

    def rank(self, r: int) -> RankMemory:
        for m in self.ranks:
            if m.rank == r:
                return m
        raise KeyError(f"no rank {r} in this profile (ranks {[m.rank for m in self.ranks]})")

    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": VERSION, **asdict(self)}

    def save(self, path: str | os.PathLike) -> Path:
        """Write JSON (under a temporary name, then renamed into place)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(self.to_dict(), f, separators=(",", ":"))
                f.write("\n")
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return path

    def table(self) -> str:
        return format_table(self)

    def plot(self, path: str | os.PathLike, x: str = "events") -> Path:
        """Draw the timeline (.png, .svg, .pdf): x="events" spaces the memory changes evenly
        (waits take no room, like PyTorch's memory_viz), x="time" in ms."""
        from .memory_plot import plot_profile
        return plot_profile(self, Path(path), x)


# ---- loading ----------------------------------------------------------------------------------
def from_dict(d: Any, where: str = "the profile") -> MemoryProfile:
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        raise ConfigError(f"{where} is not an nncompile memory profile (no \"format\": "
                          f"\"{FORMAT}\"); write one with nncompile.memory.profile(...).save()")
    if d.get("version") != VERSION:
        raise ConfigError(f"{where} is a version {d.get('version')!r} memory profile; this "
                          f"nncompile reads version {VERSION}: profile again")
    try:
        ranks = []
        for r in d["ranks"]:
            m = RankMemory(**r)
            n = len(m.times_ms)
            if any(set(x) != set(CATEGORIES) for x in (m.bytes, m.at_peak, m.max_bytes)) \
                    or any(len(v) != n for v in [*m.bytes.values(), m.events]):
                raise ValueError(f"rank {m.rank} needs bytes, at_peak and max_bytes for each "
                                 f"of {', '.join(CATEGORIES)} ({n} timeline values each)")
            ranks.append(m)
        if not ranks:
            raise ValueError("it holds no rank")
        fields = {k: d[k] for k in ("steps", "world_size", "plan_ngpus", "predicted",
                                    "torch_version") if k in d}
        return MemoryProfile(ranks=ranks, **fields)
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"{where} is a damaged nncompile memory profile ({type(e).__name__}: "
                          f"{e}); profile again") from None


def load(path: str | os.PathLike) -> MemoryProfile:
    """A profile written by MemoryProfile.save (ConfigError, saying why, for anything else)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"no memory profile at {str(path)!r}" + (
            " (it is a directory)" if path.is_dir() else "") +
            "; write one with nncompile.memory.profile(pm, step_fn).save(PATH)")
    try:
        d = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{str(path)!r} is not valid JSON ({e}); it is not a memory profile "
                          "or was cut short: profile again") from None
    return from_dict(d, repr(str(path)))


# ---- predictions ------------------------------------------------------------------------------
def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's tensor: a DTensor's local one (pm's DTensor parameters, their state)."""
    return t._local_tensor if isinstance(t, DTensor) else t


def _tensor_bytes(t: torch.Tensor) -> int:
    t = _local(t)
    return t.numel() * t.element_size()


def _ptr(t: torch.Tensor) -> int:
    return _local(t).untyped_storage().data_ptr()


# optimizer class name -> (per-element state tensors, scalar state tensors), given its defaults
def _slots(opt: torch.optim.Optimizer, group: dict) -> tuple[int, int] | None:
    name = type(opt).__name__
    if name == "SGD":
        return (1 if group.get("momentum", 0) else 0), 0
    if name in ("Adam", "AdamW"):
        return 2 + bool(group.get("amsgrad")), 1
    if name in ("Adamax", "RAdam", "Adadelta", "Rprop"):
        return 2, 1
    if name == "NAdam":
        return 2, 2
    if name == "Adagrad":
        return 1, 1
    if name == "RMSprop":
        return 1 + bool(group.get("momentum", 0)) + bool(group.get("centered")), 1
    if name == "ASGD":
        return 1, 3
    return None


def _stored(pm):
    """The parameters holding storage (ZeRO-3: the flat pieces, not the per-parameter
    handles pm.parameters() shows)."""
    stored = getattr(pm, "stored_parameters", None)
    return iter(stored()) if stored is not None else pm.parameters()


def predicted_persistent(pm: torch.nn.Module, optimizer: Any = None) -> dict[str, int]:
    """Bytes per rank of parameters, gradients and optimizer state from the live tensors' shapes:
    every parameter of `pm` once, a gradient of each one that requires grad, and for a known
    element-wise optimizer (SGD, Adam, AdamW, ...) its state tensors per element stepped plus
    its 4-byte step counters; an optimizer of another type counts its current state. Copies of
    parameters the optimizer steps instead of pm's own (ZeRO's flat shards) are optimizer
    state."""
    params = {_ptr(p): p for p in _stored(pm)}
    out = {"parameters": sum(_tensor_bytes(p) for p in params.values()),
           "gradients": sum(_tensor_bytes(p) for p in params.values() if p.requires_grad)}
    if optimizer is None:
        return out
    opt = getattr(optimizer, "inner", optimizer)      # ZeRO wraps the optimizer it steps
    state, seen = 0, set(params)
    for group in opt.param_groups:
        slots = _slots(opt, group)
        for p in group["params"]:
            if _ptr(p) not in seen:                    # a copy the optimizer owns (whole:
                seen.add(_ptr(p))                      # ZeRO steps segments viewing it)
                state += _local(p).untyped_storage().nbytes()
            if slots is not None:
                state += slots[0] * _tensor_bytes(p) + slots[1] * 4
    if all(_slots(opt, g) is None for g in opt.param_groups):
        state += _state_bytes(opt, set())
    out["optimizer_state"] = state
    return out


def _state_bytes(opt: Any, skip: set[int]) -> int:
    seen, total = set(skip), 0
    for st in getattr(opt, "state", {}).values():
        for v in (st.values() if isinstance(st, dict) else ()):
            if isinstance(v, torch.Tensor) and _ptr(v) not in seen:
                seen.add(_ptr(v))
                total += _tensor_bytes(v)
    return total


def _plan_json(where: Path) -> Path:
    if where.is_file():
        return where
    if (where / "plan.json").is_file():
        return where / "plan.json"
    found = sorted(where.glob("*/plan.json")) if where.is_dir() else []
    if len(found) == 1:
        return found[0]
    raise ConfigError(f"no plan.json at {str(where)!r}" + (
        f" (it holds {len(found)} instances: name one of {[p.parent.name for p in found]})"
        if found else "") + "; pass predicted= a plan.json, its instance directory or the "
        "gen_savedir holding one instance")


def load_predicted(predicted: Any) -> dict[str, Any] | None:
    """{"source", "per_rank_bytes"} from the plan's memory estimates: `predicted` is such a
    dict ({"per_rank_bytes": ...}), the "autodist" dict or plan.json's content holding them,
    or a path to plan.json, an instance directory or a gen_savedir. plan.json holds two:
    autodist's (key "autodist" -> "memory": every category, when autodist planned) and the
    activations counted from the compiled graph (key "memory",
    nncompile/tools/activation_memory.py), which replace autodist's activations (its total follows). None when the plan has neither."""
    source = "autodist"
    if isinstance(predicted, (str, os.PathLike)):
        path = _plan_json(Path(predicted))
        try:
            predicted = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ConfigError(f"cannot read {str(path)!r} ({e})") from None
        source = f"autodist ({path})"
    if not isinstance(predicted, dict):
        raise ConfigError(f"predicted= must be a dict or a path, not {type(predicted).__name__}")
    graph = None
    if "per_rank_bytes" not in predicted and "policy" in predicted:    # plan.json's content
        graph = predicted.get("memory")
        graph = _per_rank(graph) if isinstance(graph, dict) and "per_rank_bytes" in graph \
            else None
        predicted = predicted.get("autodist")
        if not isinstance(predicted, dict):
            return None if graph is None else {"source": graph.get("source", "plan.json"),
                                               "per_rank_bytes": graph["per_rank_bytes"]}
    while "per_rank_bytes" not in predicted:           # plan.json -> "autodist" -> "memory"
        inner = [predicted[k] for k in ("autodist", "memory")
                 if isinstance(predicted.get(k), dict)]
        if not inner:
            return None if graph is None else {"source": graph.get("source", "plan.json"),
                                               "per_rank_bytes": graph["per_rank_bytes"]}
        predicted = inner[0]
    out = {"source": predicted.get("source", source),
           "per_rank_bytes": _per_rank(predicted)["per_rank_bytes"]}
    if graph is not None and "activations" in graph["per_rank_bytes"]:
        table = out["per_rank_bytes"]
        new = graph["per_rank_bytes"]["activations"]
        if "total" in table:
            table["total"] += new - table.get("activations", 0)
        table["activations"] = new
        out["source"] += "; activations: " + graph.get("source", "the compiled graph")
    return out


def _per_rank(d: dict) -> dict[str, Any]:
    per_rank = d["per_rank_bytes"]
    if not isinstance(per_rank, dict):
        raise ConfigError("predicted['per_rank_bytes'] must map categories to bytes")
    return {**d, "per_rank_bytes": {k: int(v) for k, v in per_rank.items() if v is not None}}


def _default_prediction(pm, optimizer, predicted) -> dict[str, Any] | None:
    if predicted is False:
        return None
    if predicted is not None:
        return load_predicted(predicted)
    gencode = getattr(pm, "gencode_path", None)
    plan = Path(gencode).parent / "plan.json" if gencode else None
    found = None
    if plan is not None and plan.is_file():
        try:
            found = load_predicted(plan)
        except ConfigError:
            found = None
    if found is not None and "parameters" in found["per_rank_bytes"]:
        return found
    persistent = predicted_persistent(pm, optimizer)
    if found is None:
        return {"source": "tensor shapes (nncompile.memory.predicted_persistent; no memory "
                          "estimate in plan.json)", "per_rank_bytes": persistent}
    return {"source": "tensor shapes (nncompile.memory.predicted_persistent); activations: "
                      + found["source"],
            "per_rank_bytes": {**persistent, **found["per_rank_bytes"]}}


# ---- measuring --------------------------------------------------------------------------------
def profile(pm: torch.nn.Module, step_fn: Callable[[], Any], steps: int = 3,
            optimizer: Any = None, predicted: Any = None, *, gather: bool = True,
            max_points: int = MAX_POINTS, cuda_snapshot: str | os.PathLike | None = None
            ) -> MemoryProfile:
    """Run `step_fn()` `steps` times under torch.profiler and measure this rank's memory.

    predicted: the plan's estimate (see load_predicted); None reads pm's plan.json (autodist's
    estimate, the compiled graph's activations) and predicts what it lacks of parameters,
    gradients and optimizer state with predicted_persistent(pm, optimizer); False for none.
    gather: under torch.distributed every rank calls profile and rank 0's result holds all
    ranks (the others hold their own).
    cuda_snapshot: on CUDA, also record the allocator's history and write its snapshot there
    (open it at https://pytorch.org/memory_viz)."""
    from torch.profiler import ProfilerActivity, record_function
    import torch.distributed as dist

    if steps < 1:
        raise ConfigError(f"steps={steps}: profile at least one step")
    device = torch.device(getattr(pm, "device", None) or next(_stored(pm)).device)
    cuda = device.type == "cuda" and torch.cuda.is_available()
    if cuda and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    grad_max: dict[int, int] = {}

    def on_grad(p):
        if p.grad is not None:
            grad_max[id(p)] = max(grad_max.get(id(p), 0), _tensor_bytes(p.grad))
    from nncompile.runtime.store.user_hooks import ours
    hooks = [p.register_post_accumulate_grad_hook(ours(on_grad))
             for p in _stored(pm) if p.requires_grad]
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        if cuda_snapshot is not None:
            torch.cuda.memory._record_memory_history(max_entries=200_000)
    try:
        with torch.profiler.profile(activities=activities, profile_memory=True,
                                    record_shapes=True, with_stack=True) as prof:
            for i in range(steps):
                with record_function(f"{STEP_SCOPE}{i}"):
                    step_fn()
                if cuda:
                    torch.cuda.synchronize(device)
    finally:
        for h in hooks:
            h.remove()
    extra = {}
    if cuda:
        extra = {"allocator_peak_bytes": int(torch.cuda.max_memory_allocated(device)),
                 "allocator_reserved_bytes": int(torch.cuda.max_memory_reserved(device))}
        if cuda_snapshot is not None:
            torch.cuda.memory._dump_snapshot(str(cuda_snapshot))
            torch.cuda.memory._record_memory_history(enabled=None)
    for p in _stored(pm):              # gradients kept after the step (zero_grad to zeros)
        on_grad(p)
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else \
        int(getattr(pm, "RANK", 0))
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else \
        int(getattr(pm, "RUNTIME_NGPUS", 1))
    tensors = _count_tensors(pm, optimizer, grad_max)
    from .memory_timeline import analyse
    mine = analyse(prof, device, rank, tensors, _live_storages(pm, optimizer), max_points,
                   _forward_files(pm))
    for k, v in extra.items():
        setattr(mine, k, v)
    ranks = [mine]
    if gather and world > 1 and dist.is_available() and dist.is_initialized():
        got = [None] * dist.get_world_size() if rank == 0 else None
        dist.gather_object(asdict(mine), got, dst=0)
        if rank == 0:
            ranks = [RankMemory(**d) for d in got]
    return MemoryProfile(ranks=ranks, steps=steps, world_size=world,
                         plan_ngpus=int(getattr(pm, "PLAN_NGPUS", 1)),
                         predicted=_default_prediction(pm, optimizer, predicted))


def _forward_files(pm) -> list[str]:
    """The files defining pm's forward: the generated gencode{R}.py."""
    import inspect
    files = [getattr(pm, "gencode_path", None)]
    try:
        files.append(inspect.getsourcefile(type(pm)))
    except (TypeError, OSError):
        pass
    return [f for f in files if f]


def _count_tensors(pm, optimizer, grad_max: dict[int, int]) -> dict[str, int | None]:
    params = {_ptr(p): p for p in _stored(pm)}
    out: dict[str, int | None] = {
        "parameters": sum(_tensor_bytes(p) for p in params.values()),
        "gradients": sum(grad_max.get(id(p), 0) for p in params.values()),
        "optimizer_state": None}
    if optimizer is not None:
        opt = getattr(optimizer, "inner", optimizer)
        copies = {_ptr(p): p for g in opt.param_groups for p in g["params"]
                  if _ptr(p) not in params}
        out["optimizer_state"] = sum(_local(p).untyped_storage().nbytes()
                                     for p in copies.values()) + \
            _state_bytes(opt, set(params) | set(copies))
    return out


def _live_storages(pm, optimizer) -> dict[int, str]:
    """Storage address -> category for the persistent tensors alive now."""
    live = {}
    if optimizer is not None:
        opt = getattr(optimizer, "inner", optimizer)
        for g in opt.param_groups:
            for p in g["params"]:
                live[_ptr(p)] = "optimizer_state"
        for st in opt.state.values():
            for v in (st.values() if isinstance(st, dict) else ()):
                if isinstance(v, torch.Tensor):
                    live[_ptr(v)] = "optimizer_state"
    for p in _stored(pm):
        live[_ptr(p)] = "parameters"
    return live


# ---- the table --------------------------------------------------------------------------------
def _fmt(b: int | float | None) -> str:
    if b is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(b) < 1024 or unit == "GiB":
            return f"{b:.0f} {unit}" if unit == "B" else f"{b:.2f} {unit}"
        b /= 1024
    return f"{b:.2f} GiB"


def format_table(prof: MemoryProfile) -> str:
    """Per rank: predicted next to measured bytes, per category and in total."""
    pred = (prof.predicted or {}).get("per_rank_bytes", {})
    head = ("category", "predicted", "at peak", "max", "tensors", "max/pred")
    lines = [f"memory per rank over {prof.steps} step(s) (torch {prof.torch_version}); "
             f"predicted: {(prof.predicted or {}).get('source', 'none')}"]
    for m in sorted(prof.ranks, key=lambda m: m.rank):
        rows = []
        for c in CATEGORIES:
            p = pred.get(c)
            rows.append((c, _fmt(p), _fmt(m.at_peak.get(c)), _fmt(m.max_bytes.get(c)),
                         _fmt(m.tensors.get(c)) if c in PERSISTENT else "",
                         f"{m.max_bytes[c] / p:.2f}" if p else "-"))
        p = pred.get("total")
        rows.append(("total / peak", _fmt(p), _fmt(m.peak_bytes), "",
                     _fmt(sum(v or 0 for v in m.tensors.values())),
                     f"{m.peak_bytes / p:.2f}" if p else "-"))
        widths = [max(len(str(r[i])) for r in rows + [head]) for i in range(len(head))]
        step = next((i for i, (a, b) in enumerate(m.steps_ms) if a <= m.peak_ms <= b), None)
        lines += ["", f"rank {m.rank} ({m.device}): peak {_fmt(m.peak_bytes)} at "
                      f"{m.peak_ms:.1f} ms" + (f", in step {step + 1} of {len(m.steps_ms)}"
                                               if step is not None else "")
                  + (f"; allocator peak {_fmt(m.allocator_peak_bytes)}, reserved "
                     f"{_fmt(m.allocator_reserved_bytes)}"
                     if m.allocator_peak_bytes is not None else "")
                  + (f" [{m.source}]" if m.source != RankMemory.source else "")]
        for r in [head] + rows:
            lines.append("  ".join(str(v).ljust(w) if i == 0 else str(v).rjust(w)
                                   for i, (v, w) in enumerate(zip(r, widths))).rstrip())
    return "\n".join(lines)
