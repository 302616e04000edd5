"""What a resume needs besides the weights: each rank's random-number state and the data
loader's position, saved in every checkpoint format and restored by load_checkpoint.

    save_checkpoint(dir, pm, opt, data=sampler)   # + "resume": [rank 0's, rank 1's, ...]
    load_checkpoint(dir, pm, opt, data=sampler)   # each rank: its own entry, when it can

Random numbers. The ranks of a plan unit draw alike (runtime/program/rng.py); data-parallel units may
not (a script that seeds by unit). Every rank's generators (torch CPU, the current CUDA device,
Python's `random`, NumPy's when it is imported) are saved. On the same layout (world size,
plan_ngpus, pipeline) each rank gets its own back, so dropout continues as if never stopped. On
another layout a rank's own state does not exist: each generator every rank saved alike is
restored everywhere; one that differed between ranks is left as the script seeded it (with a
warning for torch's generators, which dropout draws from).

Data. `data` is anything with state_dict() / load_state_dict() (nncompile.DataParallelSampler,
torchdata's StatefulDataLoader). On the same layout each rank loads its own state; on another
one, the state the ranks shared (a DataParallelSampler's is the global position, the same on
every rank), or a ConfigError when they differed.
"""
from __future__ import annotations

import random
import sys
import warnings
from typing import Any

import torch
import torch.distributed as dist

from nncompile.errors import ConfigError


def rng_state() -> dict[str, Any]:
    """This process's generator states, as tensors, numbers and tuples (weights_only-safe)."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    np = sys.modules.get("numpy")
    if np is not None:
        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        state["numpy"] = (kind, torch.from_numpy(keys.astype("int64")), int(pos),
                          int(has_gauss), float(gauss))
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Set the generators `state` names (rng_state's keys; absent ones are left alone)."""
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "python" in state:
        random.setstate(_tuples(state["python"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    np = sys.modules.get("numpy")
    if "numpy" in state and np is not None:
        kind, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, gauss))


def _tuples(v):
    """random.setstate wants tuples; a loaded state may hold lists."""
    return tuple(_tuples(x) for x in v) if isinstance(v, (list, tuple)) else v


def _equal(a: Any, b: Any) -> bool:
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and a.shape == b.shape and \
            bool(torch.equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def _check_data(data) -> None:
    if data is not None and not (callable(getattr(data, "state_dict", None)) and
                                 callable(getattr(data, "load_state_dict", None))):
        raise ConfigError(
            f"data={type(data).__qualname__} has no state_dict()/load_state_dict(); pass an "
            "nncompile.DataParallelSampler or a torchdata StatefulDataLoader")


def gather(data=None, rng: bool = True) -> list[dict[str, Any]]:
    """Every rank's {"rng", "data"} (each rank calls it; every rank gets the whole list)."""
    _check_data(data)
    mine = {"rng": rng_state() if rng else None,
            "data": data.state_dict() if data is not None else None}
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [mine]
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return every


def _layout(plan: dict) -> tuple:
    return tuple(plan.get(k) for k in ("plan_ngpus", "runtime_ngpus", "pipe_ranks"))


def restore(saved: list[dict[str, Any]] | None, saved_plan: dict, plan: dict, data=None,
            rng: bool = True, where: str = "the checkpoint") -> None:
    """Put back this rank's entry of `saved` (gather's list) as the module docstring says."""
    _check_data(data)
    if not saved:
        if data is not None:
            raise ConfigError(f"{where} holds no data state (it was saved without data=); "
                              "load it without data= and position the loader yourself")
        return
    rank = dist.get_rank() if dist.is_initialized() else 0
    same = _layout(saved_plan) == _layout(plan) and len(saved) == \
        (dist.get_world_size() if dist.is_initialized() else 1)
    if data is not None:
        states = [s["data"] for s in saved]
        if states[0] is None:
            raise ConfigError(f"{where} holds no data state (it was saved without data=); "
                              "load it without data= and position the loader yourself")
        if same:
            data.load_state_dict(states[rank])
        elif all(_equal(s, states[0]) for s in states):
            data.load_state_dict(states[0])
        else:
            raise ConfigError(
                f"{where} was saved by {len(saved)} ranks with different data states, which "
                "cannot be split over this job's layout; save an nncompile."
                "DataParallelSampler (one global position) to resume on other world sizes")
    states = [s["rng"] for s in saved]
    if not rng or states[0] is None:
        return
    if same:
        set_rng_state(states[rank])
        return
    shared = {k: v for k, v in states[0].items() if all(_equal(s.get(k), v) for s in states)}
    set_rng_state(shared)
    differing = [k for k in ("torch", "cuda") if k in states[0] and k not in shared]
    if differing:
        warnings.warn(
            f"{where} was saved by {len(saved)} ranks with different {' and '.join(differing)} "
            f"random-number states (layout {_layout(saved_plan)}, this job's is "
            f"{_layout(plan)}); they are not restored, so dropout and other random ops draw "
            "differently from an uninterrupted run", stacklevel=3)
