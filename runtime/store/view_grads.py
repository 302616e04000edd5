"""The gradients and hooks of the DTensor views the module holds (module_views.py,
zero3_views.py): after each backward a view's `.grad` is a DTensor over its piece's gradient,
and the user's hooks on the view run once, on that gradient, at the end of backward.

    before: view.grad is None after loss.backward() (the view is not in the autograd graph)
    after:  view.grad = DTensor over pm's piece's reduced gradient; view.register_hook(f) runs
"""
from __future__ import annotations

import contextlib

import torch
from torch.distributed.tensor import DTensor
from .user_hooks import ours


def add_entries(pm, entries: list) -> None:
    """Entries [view, what its flag sets, the flag seen, the gradient linked, the tensor
    whose .grad the view's shows (None: none)] that pm's forward syncs (sync_views)."""
    if "_nnc_views" not in pm.__dict__:
        pm.__dict__["_nnc_views"] = []
        pm.register_forward_pre_hook(sync_views)
    pm.__dict__["_nnc_views"].extend(entries)


def watch_grad(entry) -> None:
    """Link the view's .grad each time pm's piece accumulates one (registered after the
    reducer's hooks: the gradient has landed); a frozen piece gets it when unfrozen."""
    local = entry[1]
    if entry[4] is not local:
        return                      # ZeRO-3: linked when the unit's flat gradient lands
    key = (id(local), id(entry))    # a copy of the piece (deepcopy) or a new view: again
    if local.requires_grad and getattr(local, "_nnc_watched", None) != key:
        local._nnc_watched = key
        local.register_hook(lambda g, entry=entry: follow_cleared(entry))
        local.register_post_accumulate_grad_hook(ours(lambda _, entry=entry: landed(entry)))


def landed(entry) -> None:
    """pm's gradient behind a view accumulated: link the view's .grad, and run the hooks
    the user put on the view once this backward's gradients are complete."""
    link_grad(entry)
    view = entry[0]
    if view._backward_hooks or view._post_accumulate_grad_hooks:
        handle = getattr(view, "_nnc_handle", None)
        pm = handle[0]() if handle is not None else None
        if pm is not None:
            hooks_due(pm, entry)


def hooks_due(pm, entry) -> None:
    """The view's own hooks (`register_hook`, `register_post_accumulate_grad_hook`: it is not
    in the autograd graph, so torch never runs them) run when this backward ends, after the
    reduction (run_view_hooks)."""
    due = pm.__dict__.setdefault("_nnc_hooks_due", [])
    if not due:
        torch.autograd.Variable._execution_engine.queue_callback(lambda: run_view_hooks(pm))
    due.append(entry)


@contextlib.contextmanager
def hold_view_hooks(pm):
    """Inside (a pipeline's schedule: a backward per micro-batch), the views' hooks wait; on
    leaving, each runs once, on the complete gradient."""
    pm.__dict__["_nnc_hold_view_hooks"] = True
    try:
        yield
    finally:
        pm.__dict__.pop("_nnc_hold_view_hooks", None)


def run_view_hooks(pm) -> None:
    """Once per backward, after the reduction (queued after the reducer's own end-of-backward
    callback): for each view whose gradient came in this backward, its `register_hook` hooks
    on the complete DTensor gradient (a returned tensor replaces it, in place: pm's
    gradient under it changes too), then its post-accumulate-grad hooks, as one device runs
    them after each backward. Under no_sync() (a gradient not reduced yet) they wait for the
    backward that reduces; in a pipeline, for the end of the schedule (hold_view_hooks)."""
    if pm.__dict__.get("_nnc_hold_view_hooks"):
        return                  # a pipeline's schedule: its train_step runs them at the end
    due = pm.__dict__.pop("_nnc_hooks_due", [])
    reducer = pm._reducer
    if reducer is not None and not reducer.sync:
        return
    link_grads(pm)
    seen: set[int] = set()
    for entry in due:
        view = entry[0]
        if id(view) in seen or view.grad is None:
            continue
        seen.add(id(view))
        with torch.no_grad():
            for hook in list((view._backward_hooks or {}).values()):
                new = hook(view.grad)
                if new is not None and new is not view.grad:
                    view.grad.copy_(new)
        for hook in list((view._post_accumulate_grad_hooks or {}).values()):
            hook(view)


def link_grad(entry) -> None:
    """The view's .grad: a DTensor (the view's placements) over pm's piece's gradient, the
    same storage, so `p.grad.norm()`, `.isnan()` and in-place edits of it mean what they mean
    on one device; None where the piece has none."""
    view, _, _, linked, source = entry
    if source is None:
        return
    g = source.grad
    if g is linked and (g is None) == (view.grad is None):
        return
    if g is not None and g is linked:      # cleared through the view since (zero_grad after
        follow_cleared(entry)              # forward) and no gradient came: it stays cleared
        return
    with torch.no_grad():
        # the view's own spec (mesh, placements, global shape and stride): a gradient has
        # them all, and building the DTensor from it costs microseconds where from_local's
        # checks cost a millisecond per parameter per step
        view.grad = None if g is None else DTensor(g.view(view._local_tensor.shape),
                                                   view._spec, requires_grad=False)
    entry[3] = g


def _cleared(source) -> bool:
    """Whether pm's gradient behind a view is gone (a ZeRO-3 segment's: its unit's)."""
    flat = getattr(source, "_nnc_flat", None)
    return source.grad is None or (flat is not None and flat[0].grad is None)


def link_grads(pm) -> None:
    for entry in pm.__dict__.get("_nnc_views", ()):
        link_grad(entry)


def sync_views(pm, args) -> None:
    """Before pm's forward, pm's pieces follow what was done to the views since the last one:
    a changed requires_grad (pm.module's `requires_grad_(False)` to freeze, or True to
    unfreeze), and a gradient cleared through the view (`zero_grad()` of an optimizer over
    pm.module's parameters, `p.grad = None`), which the next backward must not add to."""
    for entry in pm.__dict__.get("_nnc_views", ()):
        view, local, seen, linked, source = entry
        flag = view.requires_grad
        if flag != seen:
            local.requires_grad_(flag)
            entry[2] = flag
            if source is local:
                watch_grad(entry)
        follow_cleared(entry)


def follow_cleared(entry) -> None:
    """A gradient cleared through the view clears pm's (a piece's, or a ZeRO-3 segment's run
    of its unit's flat gradient), and one cleared in pm clears the view's. Called before pm's
    forward and, where `zero_grad()` comes after forward (Lightning's closure), from a hook
    on pm's tensor before a gradient accumulates into it."""
    view, local, _, linked, source = entry
    if linked is None:
        return
    if view.grad is None and source.grad is linked:
        if source is local:
            local.grad = None
        else:                       # a ZeRO-3 segment: its run of the unit's flat gradient
            linked.zero_()
        entry[3] = None
    elif _cleared(source):          # pm's gradient cleared (zero_grad): so is the view's,
        view.grad = None            # which must not keep the old one's memory alive
        entry[3] = None
