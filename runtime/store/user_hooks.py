"""The user's post-accumulate-grad hooks run once a gradient is complete.

torch runs a parameter's post-accumulate-grad hooks (`p.register_post_accumulate_grad_hook`,
torch's optimizer-in-backward recipe) as soon as autograd adds a gradient to `p.grad`. Under a
plan that is too early: before the reducer averages it over the data-parallel replicas (DDP
runs them there too, on this rank's part), or, in a pipeline, after one micro-batch while the
schedule still needs the weights for the next:

    before: the hook steps p with this rank's gradient (replicas drift apart), or a pipeline
            fails with "modified by an inplace operation"
    after:  the hook runs once, with the reduced gradient of every micro-batch, as on one
            device after `loss.backward()`

`defer(params)` marks each user hook so torch's own call of it does nothing (removing it with
its handle still works); `run(params)` calls the marked hooks of those with a gradient. The
reducer does both around its reduction, a pipeline's train_step around its schedule. Hooks
nncompile registers itself are marked `ours` and left in place.
"""
from __future__ import annotations

import functools


def ours(hook):
    """Mark a post-accumulate-grad hook as nncompile's own (defer leaves it in place)."""
    if hasattr(hook, "__self__"):            # a bound method takes no attributes
        hook = functools.partial(hook)
    hook._nncompile = True
    return hook


class _Deferred:
    """A user's hook that run() calls; torch's own call of it does nothing."""
    __slots__ = ("hook",)
    _nncompile = True

    def __init__(self, hook):
        self.hook = hook

    def __call__(self, param) -> None:
        return None


def _ours(hook) -> bool:
    return getattr(hook, "_nncompile", False) and not isinstance(hook, _Deferred)


def defer(params) -> dict:
    """Mark the user's hooks on `params`; {id: param} of those that have one."""
    held = {}
    for p in params:
        if p.is_meta:                 # a ZeRO-3 handle: no gradient of its own
            continue
        hooks = p._post_accumulate_grad_hooks
        if not hooks or all(map(_ours, hooks.values())):
            continue
        for key, hook in list(hooks.items()):
            if not getattr(hook, "_nncompile", False):
                hooks[key] = _Deferred(hook)
        held[id(p)] = p
    return held


def run(held: dict) -> None:
    """Call the marked hooks of each held parameter that has a gradient (in the order they
    were registered; a hook removed since is not called)."""
    for p in held.values():
        if p.grad is None:
            continue
        for h in list((p._post_accumulate_grad_hooks or {}).values()):
            if isinstance(h, _Deferred):
                h.hook(p)


__all__ = ["ours", "defer", "run"]
