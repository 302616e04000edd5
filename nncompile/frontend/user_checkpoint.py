"""Activation checkpointing written in the user's model (`torch.utils.checkpoint.checkpoint`).

While exporting, `checkpoint(fn, *args, use_reentrant=True)` runs as `use_reentrant=False`,
which computes the same values and gradients. The reentrant form runs fn under no_grad (and
recomputes it in its own backward), so its ops would be traced as needing no gradient and a
plan would give them no backward collectives (wrong gradients under tp).

The recomputation itself is kept as the plan's own: a checkpointed module of the model (the
function is a submodule, its bound method or a partial of one (also of the unbound forward
with the module as its first argument), as in Hugging Face's gradient
checkpointing) is recomputed in backward by the recompute pass, as if it were named in
`parallel.recompute_modules`:

    model:      x = checkpoint(self.h[0], x, use_reentrant=True)
    generated:  def recompute_h0(x): ...          # the block's ops, collectives included
                x, = checkpoint(recompute_h0, x, use_reentrant=False)

A checkpointed function that is no module of the model keeps its activations (a log line
says so).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, Iterator

import torch

_SEEN: list[Any] = []       # the functions checkpointed during the current trace


@contextlib.contextmanager
def traced() -> Iterator[None]:
    """Record checkpointed functions and run reentrant checkpoints as non-reentrant."""
    from torch.utils import checkpoint as ckpt
    from ..compat import checkpoint_generator_name
    name = checkpoint_generator_name()
    fn, gen = ckpt.CheckpointFunction, getattr(ckpt, name)

    def apply(cls, function, preserve_rng_state, *args):
        return ckpt.checkpoint(function, *args, use_reentrant=False,
                               preserve_rng_state=preserve_rng_state)

    def generator(function, *args, **kwargs):
        if not any(f is function for f in _SEEN):
            _SEEN.append(function)
        return gen(function, *args, **kwargs)

    own = fn.__dict__.get("apply")
    fn.apply = classmethod(apply)
    setattr(ckpt, name, generator)
    try:
        yield
    finally:
        setattr(ckpt, name, gen)
        if own is None:
            del fn.apply
        else:
            fn.apply = own


def start() -> None:
    _SEEN.clear()


def checkpointed_modules(module: torch.nn.Module) -> list[str]:
    """The module paths of the submodules checkpointed in the trace just made ("" is the
    root), in call order; logs the checkpointed functions that are no module of the model."""
    paths = {id(m): p for p, m in module.named_modules()}
    out, other = [], 0
    for f in _SEEN:
        owner = None
        while isinstance(f, functools.partial):
            if f.args and isinstance(f.args[0], torch.nn.Module):   # partial(forward, layer):
                owner = f.args[0]                                    # transformers 5.x's form
            f = f.func
        owner = f if isinstance(f, torch.nn.Module) else getattr(f, "__self__", owner)
        path = paths.get(id(owner))
        if path is None:
            other += 1
        elif path not in out:
            out.append(path)
    if other:
        from ..log import log
        log(f"{other} checkpointed function(s) of the model are no module of it: traced with "
            "their gradients, their activations kept (name a module in "
            "parallel.recompute_modules to recompute it)")
    _SEEN.clear()
    return out


def with_recompute(config: Any, paths: list[str]) -> Any:
    """`config` whose recompute_modules also name the checkpointed module paths (unless
    autodist chooses them: "auto")."""
    if not paths:
        return config
    given = config.parallel.recompute_modules
    if given == "auto":
        return config
    if "" in paths:                     # the whole model checkpointed: every op
        paths = ["*"]
    merged = list(given or []) + [p for p in paths if p not in (given or [])]
    return dataclasses.replace(config, parallel=dataclasses.replace(
        config.parallel, recompute_modules=merged))
