"""Activation bytes per rank, predicted from the compiled per-rank graph.

What a training step holds at its peak, beside the parameters, gradients and optimizer state,
is what autograd saved for backward: it is all alive when forward ends and backward begins.
`predict(g)` counts it without running the model: it runs the rank's localized graph op by op
on fake tensors (torch's FakeTensorMode: shapes, dtypes and storages, no data, no compute),
parameters requiring grad, under `torch.autograd.graph.saved_tensors_hooks` whose pack hook
records every tensor an op saves. Each storage counts once, whole (views share it: a saved
slice keeps its base alive); the storages of parameters, buffers, constants and the user's
inputs do not count (they are held anyway).

- A recompute region (passes/recompute.py, run by codegen under
  `torch.utils.checkpoint(..., use_reentrant=False)`) saves its inputs only: they are
  recorded, and what the ops inside save is counted apart, per region. Backward reruns
  one region at a time, when the backward of every op after it is done: alive then are
  what the ops up to the region saved (its inputs included) and what its rerun saves.
  `Activations.peak` is the larger of that (over regions) and all saved at the end of
  forward.
- Collectives run locally and give this rank's local shape: `sync_grad` aliases its input,
  `chunk` slices it, the others make a new tensor; one fused with the linears it feeds
  (overlap_grad_sync) then runs those linears, saving what they save. Random ops of a split
  tensor (runtime/program/rng.py) run the runtime's own code as rank 0 of the plan unit.
- An op the fake tensors cannot run (data-dependent output shapes, a user's custom op)
  saves nothing here and gives outputs of its traced local shapes; `unknown_ops` names them.

Before: plan.json has no activation estimate; nncompile.memory's table shows "-".
After:  plan.json `"memory": {"per_rank_bytes": {"activations": 4718592}, ...}` and the
        table's predicted column shows it.

Left out: pipelined plans (a pipeline rank holds its stages' activations once per micro-batch
in flight, which depends on the schedule; `predict_plan` gives none for them), and autocast
around the call (its casts save copies this count does not see).
"""
from __future__ import annotations

import time
import types
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ..collectives import axis_of
from ..ir import CONST, Graph, Value
from ..log import log
from ..modes import ModeArg, resolve
from ..ir.printer import DEVICE, Symbol

SOURCE = "the compiled graph's saved tensors (nncompile.tools.activation_memory)"


@dataclass
class Activations:
    """Bytes one rank's forward saves for backward, and where they come from."""
    bytes: int
    per_op: list[tuple[str, str, int]] = field(default_factory=list)  # (op, module, new bytes)
    largest: int = 0                    # the largest saved storage (bytes)
    unknown_ops: list[str] = field(default_factory=list)
    seconds: float = 0.0
    rerun: int = 0                      # the most alive while backward reruns a region

    @property
    def peak(self) -> int:
        """Activations at their largest: all saved at the end of forward, or, where regions
        are recomputed and that is more, while backward reruns one of them."""
        return max(self.bytes, self.rerun)

    def to_json(self, top: int = 10) -> dict[str, Any]:
        ops = sorted(self.per_op, key=lambda r: -r[2])[:top]
        return {"saved_bytes": self.bytes, "rerun_bytes": self.rerun,
                "peak_bytes": self.peak, "largest_storage_bytes": self.largest,
                "top_ops": [{"op": o, "module": m, "bytes": b} for o, m, b in ops],
                "unknown_ops": self.unknown_ops, "seconds": round(self.seconds, 3)}


def _rank0_view(module: types.ModuleType, n: int) -> dict[str, Any]:
    """`module`'s functions bound to globals where the plan group has n ranks and this is
    rank 0 (no process group needed), so the runtime's own code runs on fake tensors."""
    env = dict(vars(module))
    env["_size"] = lambda group: n
    env["_rank"] = lambda group: 0
    env["_reduce"] = lambda x, group: x.contiguous().clone()
    for k, f in list(env.items()):
        if isinstance(f, types.FunctionType) and f.__module__ == module.__name__:
            g = types.FunctionType(f.__code__, env, f.__name__, f.__defaults__, f.__closure__)
            g.__kwdefaults__ = f.__kwdefaults__
            env[k] = g
    return env


def _collective(kind: str, args: tuple, kwargs: dict, out: Value, n: int, comm_env,
                axes: dict | None = None, axis: str = "plan") -> Any:
    """A collective on this rank's piece: the runtime's output shape, aliasing as it does."""
    if kind == "cross_entropy_rows":
        return comm_env["cross_entropy_rows"](*args, **kwargs)
    x = args[0]
    linears = kwargs.get("linears")
    if kind == "sync_grad":
        y = x
    elif kind == "chunk":
        size = n if axis == "plan" else (axes or {}).get(axis, n)     # the group's ranks
        y = x.detach().chunk(size, dim=kwargs["dim"])[0].contiguous()
    else:
        shape = out.local_shape(n, axes) if out.is_tensor else None
        if linears is not None:         # the fused op's outputs are the linears'; x gathered
            shape = list(x.shape)
            shape[kwargs["dim"]] *= n
        y = x.new_empty(shape)
    if kind != "sync_grad":
        y = y.detach().requires_grad_(x.requires_grad)
    if linears is None:
        return y
    return tuple(torch.nn.functional.linear(y, w, b) for w, b in linears)


def _fake_input(v: Value, n: int, axes: dict | None = None) -> torch.Tensor:
    t = torch.empty(v.local_shape(n, axes), dtype=v.meta.dtype)
    return t.requires_grad_(bool(v.requires_grad and t.is_floating_point()))


def predict(g: Graph, training: bool = True) -> Activations:
    """Bytes the localized graph `g` saves for backward on one rank (module docstring)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ..runtime.program import comm, rng

    start = time.perf_counter()
    n = g.plan_ngpus
    envs = {"comm": _rank0_view(comm, n), "rng": _rank0_view(rng, n)}
    saved: dict[int, int] = {}          # storage id -> bytes
    held: set[int] = set()              # storages of parameters, buffers, constants, inputs
    keep: list[torch.Tensor] = []       # storage ids stay unique while their tensors live
    new_bytes = [0]
    largest = [0]

    def record(t: torch.Tensor) -> None:
        s = t.untyped_storage()
        key = s._cdata
        if key in held or key in saved:
            return
        saved[key] = s.nbytes()
        keep.append(t)
        new_bytes[0] += saved[key]
        largest[0] = max(largest[0], saved[key])

    def pack(t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, torch.Tensor):
            record(t)
        return t

    again: list[dict[int, int]] = []    # per recompute region: what it saves when rerun
    before: list[int] = []              # per region: bytes saved up to its inputs

    def pack_again(t: torch.Tensor) -> None:
        if isinstance(t, torch.Tensor):
            st = t.untyped_storage()
            if st._cdata not in held and st._cdata not in saved:
                again[-1][st._cdata] = st.nbytes()
                keep.append(t)
        return None

    env: dict[int, Any] = {}

    def get(x: Any) -> Any:
        if isinstance(x, Value):
            return env[id(x)]
        if isinstance(x, ModeArg):
            return resolve(x, training)
        if isinstance(x, Symbol):
            return torch.device("cpu") if x == DEVICE else None
        if isinstance(x, torch.device):
            return torch.device("cpu")
        return x

    per_op: list[tuple[str, str, int]] = []
    unknown: list[str] = []
    region_args: dict[int, list[Value]] = {}    # id(first op of a region) -> its inputs
    runs: list[list] = []
    program = [op for op in g.ops if not op.is_structural]    # lowering markers compute nothing
    for i, op in enumerate(program):            # maximal runs of one mark, as codegen's
        if op.recompute is not None:
            if i and program[i - 1].recompute == op.recompute:
                runs[-1].append(op)
            else:
                runs.append([op])
    for ops in runs:
        made = {id(v) for o in ops for v in o.outputs}
        region_args[id(ops[0])] = list({id(v): v for o in ops for v in o.inputs()
                                        if id(v) not in made and v.is_tensor}.values())

    with FakeTensorMode(), torch.enable_grad(), \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        for v in g.inputs + g.params + g.buffers:
            if v.is_tensor:
                t = _fake_input(v, n, g.axes)
                env[id(v)] = t
                held.add(t.untyped_storage()._cdata)
                keep.append(t)
            else:
                env[id(v)] = None
        with torch.no_grad():           # constants: computed once when the code loads
            for op in g.const_ops:
                _run(op, get, env, n, envs, unknown, g.axes)
                for v in op.outputs:
                    t = env.get(id(v))
                    if isinstance(t, torch.Tensor) and v.kind == CONST:   # this rank's piece
                        local = v.local_shape(n, g.axes)
                        if tuple(t.shape) != tuple(local) and t.dim() == len(local):
                            t = env[id(v)] = t[tuple(slice(0, s) for s in local)]
                    if isinstance(t, torch.Tensor):
                        held.add(t.untyped_storage()._cdata)
                        keep.append(t)
        for op in program:
            new_bytes[0] = 0
            for v in region_args.get(id(op), ()):   # checkpoint keeps a region's inputs
                if isinstance(env.get(id(v)), torch.Tensor):
                    record(env[id(v)])
            if op.recompute is not None:
                if id(op) in region_args:
                    again.append({})
                    before.append(sum(saved.values()))     # alive while it is rerun
                with torch.autograd.graph.saved_tensors_hooks(pack_again, lambda t: t):
                    _run(op, get, env, n, envs, unknown, g.axes)
            else:
                _run(op, get, env, n, envs, unknown, g.axes)
            if new_bytes[0]:
                per_op.append((op.name, op.module_path, new_bytes[0]))
    return Activations(sum(saved.values()), per_op, largest[0], unknown,
                       time.perf_counter() - start,
                       max((b + sum(r.values()) for b, r in zip(before, again)), default=0))


def _run(op, get, env: dict[int, Any], n: int, envs: dict, unknown: list[str],
         axes: dict | None = None) -> None:
    """Run one op on fake tensors into `env` (outputs of its traced local shapes if it
    cannot run)."""
    from ..custom_ops import REGISTRY, is_custom_op
    args, kwargs = pytree.tree_map(get, (op.args, op.kwargs))
    target = op.target
    try:
        if isinstance(target, str):
            space, _, kind = target.partition(".")
            if space == "comm":
                out = _collective(kind, args, kwargs, op.outputs[0], n, envs["comm"], axes,
                                  axis_of(op))
            else:
                out = envs[space][kind](*args, **kwargs)
        elif is_custom_op(target):
            out = REGISTRY[target._opname].impl(*args, **kwargs)
        else:
            out = target(*args, **kwargs)
    except Exception:           # noqa: BLE001 - counted as unknown, shapes as traced
        unknown.append(op.name)
        outs = [_fake_input(v, n, axes) if v.is_tensor else None for v in op.outputs]
        out = outs if op.multi_output else (outs[0] if outs else None)
    if op.multi_output:
        for v, o in zip(op.outputs, out):
            env[id(v)] = o
    elif op.outputs:
        env[id(op.outputs[0])] = out


def predict_plan(g: Graph) -> dict[str, Any] | None:
    """plan.json's "memory" entry for the localized graph `g`: {"source", "per_rank_bytes":
    {"activations"}, "activations": details}; None for an inference-only program."""
    if g.trace_info.inference_only:
        return None
    if g.plan_state.pipeline is not None:   # per stage, per micro-batch in flight: not yet
        return None
    try:
        a = predict(g)
    except Exception as e:                  # noqa: BLE001 - an estimate never stops a compile
        log(f"no activation estimate ({type(e).__name__}: {e})")
        return None
    return {"source": SOURCE, "per_rank_bytes": {"activations": a.peak},
            "activations": a.to_json()}
