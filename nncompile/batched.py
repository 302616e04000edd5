"""Which inputs micro-batches split: those whose dim 0 is the batch, decided by the model.

train_step splits a batch into parallel.microbatches pieces along dim 0 of the batched
inputs and passes the others whole to every micro-batch. A tensor whose dim 0 only happens to
equal the batch size (class weights of as many classes as the batch has rows) is not
per-sample, so shapes alone cannot decide. The forward runs once on fake tensors (no
compute) in which dim 0 of every such candidate is a size of its own; the sizes the
computation ties together say what each one is (torch's symbolic shapes):

    forward(x [4, 8], y [4], class_weight [4]):
        cross_entropy(head(x), y, weight=class_weight)       head: 4 classes
    sizes  x: s0   y: s1   class_weight: s2
    after  s1 = s0 (y indexes head(x)'s rows)   s2 = 4 (the number of classes)
    ->     batched: x, y          whole to every micro-batch: class_weight

An input whose dim 0 is tied to nothing (only summed, or used as a lookup table) is ambiguous:
it is passed whole, with a warning. parallel.batched_inputs (forward argument names)
declares the batched inputs and skips the probe; if the probe cannot run the forward, every
candidate is batched (with a warning naming the declaration).
"""
from __future__ import annotations

import time
import warnings
from typing import Any

import torch
from torch.utils import _pytree as pytree

from .errors import ConfigError
from .log import log as _log


def batched_inputs(module: torch.nn.Module, dummy_args: Any, microbatches: int,
                   declared: list[str] | None = None) -> list[bool] | None:
    """batched_leaves for a compile with `microbatches` (None: nothing is split, or the
    batch does not divide, which microbatch_dummy refuses)."""
    tensors = [x for x in pytree.tree_leaves(dummy_args)
               if isinstance(x, torch.Tensor) and x.dim() > 0]
    if microbatches == 1 or not tensors or tensors[0].shape[0] % microbatches:
        return None
    start = time.perf_counter()
    out = batched_leaves(module, dummy_args, tensors[0].shape[0], declared)
    _log(f"inputs split into micro-batches decided ({time.perf_counter() - start:.1f}s)")
    return out


def batched_leaves(module: torch.nn.Module, dummy_args: Any, batch: int,
                   declared: list[str] | None = None) -> list[bool]:
    """For each leaf of pytree.tree_leaves(dummy_args): whether it is split into
    micro-batches (only tensors whose dim 0 is `batch` may be)."""
    from .frontend import normalize_args
    from .arguments import entries, literal_defaults
    leaves = pytree.tree_leaves(dummy_args)
    cands = [i for i, x in enumerate(leaves)
             if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == batch]
    args, kwargs = normalize_args(module, dummy_args)
    items = entries(literal_defaults(module.forward)[0], args, kwargs)
    owner = [name for name, value in items for _ in pytree.tree_leaves(value)]
    if len(owner) != len(leaves):        # another flattening order: decide by shape (as ever)
        return [i in cands for i in range(len(leaves))]
    if declared is not None:
        return _declared(declared, items, owner, leaves, cands, batch)
    if len(cands) < 2:
        return [i in cands for i in range(len(leaves))]
    try:
        sizes = _probe(module, args, kwargs, cands)
    except Exception as e:  # noqa: BLE001 - any failure: fall back to shapes, say so
        why = str(e).strip().splitlines()[0] if str(e).strip() else ""
        warnings.warn(f"could not tell from the model which inputs are per-sample "
                      f"({type(e).__name__}: {why}); every input whose dim 0 is the batch "
                      f"({batch}) is split into micro-batches: "
                      f"{sorted({owner[i] for i in cands})}. If one of them is not per-sample, "
                      f"declare the others: parallel.batched_inputs = [...]",
                      stacklevel=6)
        return [i in cands for i in range(len(leaves))]
    free = [i for i in cands if not sizes[i].is_number]
    if not free:                        # the model fixes the batch itself: shapes decide
        return [i in cands for i in range(len(leaves))]
    ref = free[0]                       # the first tensor argument, unless its size is fixed
    out = [i in free and sizes[i] == sizes[ref] for i in range(len(leaves))]
    loose = sorted({owner[i] for i in free if not out[i]})
    if loose:
        batched = sorted({owner[i] for i, b in enumerate(out) if b})
        warnings.warn(
            f"input(s) {loose} have dim 0 equal to the batch ({batch}) but the model does not "
            f"tie it to the batch of {owner[ref]!r}, so they are passed whole to every "
            f"micro-batch. If they are per-sample, declare the batched inputs: "
            f"parallel.batched_inputs = {sorted(set(batched + loose))}; otherwise "
            f"parallel.batched_inputs = {batched}", stacklevel=6)
    return out


def _declared(declared: list[str], items: list, owner: list[str], leaves: list,
              cands: list[int], batch: int) -> list[bool]:
    if isinstance(declared, str) or not all(isinstance(n, str) for n in declared):
        raise ConfigError(f"parallel.batched_inputs must be a list of forward argument "
                          f"names, got {declared!r}")
    names = [name for name, _ in items]
    unknown = [n for n in declared if n not in names]
    if unknown:
        raise ConfigError(f"parallel.batched_inputs names {unknown}, which the dummy "
                          f"args do not pass; the forward's arguments here are {names}")
    out = [owner[i] in declared and i in cands for i in range(len(leaves))]
    for n in declared:
        bad = [i for i, o in enumerate(owner) if o == n and isinstance(leaves[i], torch.Tensor)
               and i not in cands]
        if bad:
            x = leaves[bad[0]]
            raise ConfigError(f"parallel.batched_inputs declares {n!r} batched, but its "
                              f"tensor of shape {list(x.shape)} does not have the batch "
                              f"({batch} rows, dim 0 of the first tensor argument) in dim 0")
    return out


def _probe(module: torch.nn.Module, args: tuple, kwargs: dict, cands: list[int]) -> dict:
    """Run forward on fake tensors, dim 0 of each candidate (a leaf index of (args, kwargs))
    a fresh size; returns each candidate's size after it, as the model constrained it: a
    number (fixed by the model), the same symbol as another candidate's (tied) or its own."""
    from .frontend import attributes
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import (DimDynamic, ShapeEnv,
                                                       StatelessSymbolicContext)
    env = ShapeEnv(duck_shape=False, specialize_zero_one=False)
    mode = FakeTensorMode(shape_env=env)

    def fake(t: torch.Tensor, dynamic: bool) -> torch.Tensor:
        dims = [DimDynamic.DYNAMIC if dynamic and d == 0 else DimDynamic.STATIC
                for d in range(t.dim())]
        return mode.from_tensor(t, symbolic_context=StatelessSymbolicContext(
            dynamic_sizes=dims, constraint_sizes=[None] * t.dim()))
    flat, spec = pytree.tree_flatten((args, kwargs))
    fakes = [fake(x, i in cands) if isinstance(x, torch.Tensor) else x
             for i, x in enumerate(flat)]
    symbols = {i: fakes[i].shape[0].node.expr for i in cands}
    state = {k: fake(v, False) for k, v in
             list(module.named_parameters(remove_duplicate=False))
             + list(module.named_buffers(remove_duplicate=False))}
    fargs, fkwargs = pytree.tree_unflatten(fakes, spec)
    saved = [(m, dict(m.__dict__)) for m in module.modules()]   # attributes forward may set
    rng = torch.get_rng_state()
    try:
        with attributes.kept(module), torch.no_grad(), mode:   # and objects the module holds
            torch.func.functional_call(module, state, fargs, fkwargs, strict=False)
    finally:
        for m, attrs in saved:
            m.__dict__.clear()
            m.__dict__.update(attrs)
        torch.set_rng_state(rng)
    return {i: env.replace(sym) for i, sym in symbols.items()}
