"""The module given to parallelize holds DTensor views of pm's parameters.

Under a plan that shards parameters (tp, tp_sp, autodist's splits, context and expert
parallelism) pm keeps one rank's piece of each weight, and the module's own copy is released
(runtime/param_handles.py). Each released parameter is then replaced, in the module, by a
DTensor Parameter on the plan's device mesh (the one DCP checkpoints use, runtime/dcp.py) whose
local tensor is a view of pm's piece; where every parameter has one, pm's own parameters
become the same DTensors (view_pieces; the pieces stay under them for the generated code,
runtime/pieces.py). Code that reads or edits `pm.module`'s weights (DDP's
`model.module` habit) works as on one device and acts on what pm trains:

    before: pm.module.h[0].mlp_fc.weight.norm()        -> the process crashed (no storage)
    after:  the DTensor norm over the plan (every rank calls it, as under FSDP2)
            pm.module.h[0].mlp_fc.weight.data.clamp_(-c, c)   -> clamps pm's piece
            pm.module.h[0].requires_grad_(False)       -> that block gets no gradient and no
                                                          update from the next forward on
            pm.module.state_dict()                     -> DTensors under the original names

A flag set on a view (`requires_grad_`) reaches pm's piece at pm's next forward; after each
backward a view's `.grad` is a DTensor over the piece's gradient. ZeRO-3's views are Shard(0)
DTensors over the flat pieces (runtime/zero3_views.py). Kept released (computing with them is
a clear error): a parameter held as parts of a fused one (q|k|v rows split by heads), and
pipelined plans'.
"""
from __future__ import annotations

import contextlib
import weakref

import torch
import torch.distributed as dist

from torch.distributed.tensor import DTensor

from nncompile.mesh import CP
from nncompile.rows import param_rows

from .dcp import _dtensor
from .param_handles import ReleasedParameter
from .pieces import local_parameters, pieces_of
from .user_hooks import ours


def view_released(pm, module: torch.nn.Module, rows) -> list[str]:
    """Replace `module`'s released parameters by DTensor views of pm's pieces where one
    DTensor describes the piece; returns the FQNs that stay released."""
    params = list(module.named_parameters(remove_duplicate=False))
    released = [fqn for fqn, p in params if isinstance(p, ReleasedParameter)]
    if released and pm.zero is not None:
        from .zero3_views import view_zero3
        released = view_zero3(pm, module, params, rows)
        follow_flags(pm, list(module.named_parameters(remove_duplicate=False)), rows)
    if pm.zero is not None or pm.INFERENCE_ONLY or not dist.is_initialized():
        return released
    whole_rows = {r.fqn: r for r in rows if r.part is None}
    row_of: dict[int, object] = {}       # id(parameter) -> its row (a tied one: its first FQN's)
    for fqn, p in params:
        if fqn in whole_rows:
            row_of.setdefault(id(p), whole_rows[fqn])
    local_of = {id(p): pm._parameters.get(row.name) for p in dict(params).values()
                if (row := row_of.get(id(p))) is not None}
    split_plan = pm.PLAN_NGPUS > 1 or dict(pm.mesh.dims).get(CP, 1) > 1
    # a pipeline rank holds its stages' parameters: every one of them viewed is "whole"
    mine = [(fqn, p) for fqn, p in params if id(p) in row_of] \
        if pm.PIPELINE is not None else params
    whole = split_plan and bool(mine) and all(
        (local := local_of.get(id(p))) is not None and local.is_contiguous() and
        local.device == p.device and (isinstance(p, ReleasedParameter) or p is local)
        for _, p in mine) and \
        {row_of[id(p)].name for _, p in mine} == set(pm._parameters)
    if not released and not whole:
        return released
    if whole:                 # every parameter: pm's own become these views too
        views = view_pieces(pm, {id(p): row_of[id(p)].name for _, p in mine})
        for fqn, p in mine:
            owner, _, leaf = fqn.rpartition(".")
            module.get_submodule(owner)._parameters[leaf] = views[row_of[id(p)].name]
        if not getattr(module, "_nnc_guard", False):
            from .param_handles import _released_forward
            module._nnc_guard = True
            module.register_forward_pre_hook(_released_forward(params[0][0]))
        return [fqn for fqn, p in params if id(p) not in row_of] \
            if pm.PIPELINE is not None else []
    made: dict[int, torch.nn.Parameter] = {}     # id(original) -> its view (ties share one)
    views, still = [], []
    for fqn, p in params:
        if not isinstance(p, ReleasedParameter):
            continue                              # shared with pm as it is (replicated)
        local = local_of.get(id(p))
        if local is None or not local.is_contiguous() or local.device != p.device:
            still.append(fqn)
            continue
        view = made.get(id(p))
        if view is None:
            view = _view(pm, local, row_of[id(p)], p.requires_grad, stepped=False)
            made[id(p)] = view
            views.append([view, local, view.requires_grad, None, local])
        owner, _, leaf = fqn.rpartition(".")
        module.get_submodule(owner)._parameters[leaf] = view
    _watch_entries(pm, views)
    return still


def _view(pm, local: torch.Tensor, row, requires_grad: bool, stepped: bool):
    """A DTensor Parameter over pm's piece `local` (row's placements on pm's mesh)."""
    view = torch.nn.Parameter(_dtensor(pm, local.detach(), row), requires_grad=requires_grad)
    view._nnc_handle = (weakref.ref(pm), row.name)    # what it views
    view._nnc_view = stepped    # stepped as a DTensor (else: pm's piece is stepped)
    return view


def _watch_entries(pm, entries: list) -> None:
    if not entries:
        return
    add_entries(pm, entries)
    for entry in entries:
        watch_grad(entry)
    if pm._reducer is not None:   # reduction may hand .grad another tensor (or None)
        pm._reducer.on_finish.append(lambda: link_grads(pm))


def view_pieces(pm, names=None) -> dict[str, torch.nn.Parameter]:
    """pm's parameters become DTensor Parameters over its pieces: pm.parameters() (and the
    module's, where view_released puts them) are these, while the generated code computes
    with the pieces, kept in pm.__dict__ (`self.<name>` finds them first):

        before: pm._parameters["h0_mlp_fc_weight"]   this rank's piece  [64, 32]
        after:  pm._parameters["h0_mlp_fc_weight"]   DTensor [128, 32] (Shard(0),) over it
                pm.__dict__["h0_mlp_fc_weight"]      the piece (what forward_impl reads)

    `names`: the local names to view (default: every parameter); {local name: view}."""
    rows = {row.name: row for row in param_rows(pm) if row.part is None}
    wanted = list(pm._parameters) if names is None else list(dict.fromkeys(names.values()))
    views, entries = {}, []
    for name in wanted:
        piece = pieces_of(pm).get(name, pm._parameters[name])
        view = _view(pm, piece, rows[name], piece.requires_grad, stepped=True)
        view._nnc_piece = piece
        pm.__dict__[name] = piece
        pm._parameters[name] = view
        views[name] = view
        entries.append([view, piece, view.requires_grad, None, piece])
    pm.__dict__["_nnc_pieces"] = {n: pm.__dict__[n] for n in pm._parameters
                                  if n in pm.__dict__}
    _watch_entries(pm, entries)
    return views


@contextlib.contextmanager
def pieces_registered(pm):
    """Inside: pm._parameters holds the pieces (state_dict by local name, load_state_dict,
    .to()/.half() act on them); after: the views again, rebuilt over any piece whose storage
    moved (a .to() across devices or dtypes)."""
    pieces = pieces_of(pm)
    if not pieces:
        yield
        return
    views = {n: pm._parameters[n] for n in pieces}
    for n, piece in pieces.items():
        pm._parameters[n] = piece
    try:
        yield
    finally:
        stale = [n for n, v in views.items()
                 if pm._parameters[n] is not pieces[n] or
                 v._local_tensor.dtype != pieces[n].dtype or
                 v._local_tensor.device != pieces[n].device or
                 v._local_tensor.data_ptr() != pieces[n].data_ptr()]
        for n in pieces:
            pm._parameters[n] = views[n]
        if stale:
            _rebuild(pm, stale)


def _rebuild(pm, names: list[str]) -> None:
    """New views over pieces whose storage moved; the module holds them in the old ones'
    places."""
    old = {n: pm._parameters[n] for n in names}
    pm.__dict__["_nnc_views"] = [
        e for e in pm.__dict__.get("_nnc_views", ())
        if e[0] is not old.get(getattr(e[0], "_nnc_handle", (None, None))[1])]
    for n in names:
        pm._parameters[n] = pm.__dict__[n]
    new = view_pieces(pm, {n: n for n in names})
    module = pm.__dict__.get("_original_module")
    if module is not None:
        swap = {id(old[n]): new[n] for n in names}
        for sub in module.modules():
            for leaf, p in list(sub._parameters.items()):
                if id(p) in swap:
                    sub._parameters[leaf] = swap[id(p)]


def follow_flags(pm, params, rows) -> None:
    """Under ZeRO-3 the module's parameters stay released; freezing one of them
    (`pm.module.h[0].requires_grad_(False)`) reaches its handle in pm at pm's next forward."""
    by_fqn = {row.fqn: row for row in rows if row.part is None}
    entries = []
    for fqn, p in params:
        row = by_fqn.get(fqn)
        handle = pm._parameters.get(row.name) if row is not None else None
        if isinstance(p, ReleasedParameter) and handle is not None:
            entries.append([p, handle, p.requires_grad, None, None])
    if entries:
        add_entries(pm, entries)


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


__all__ = ["view_released", "view_pieces", "pieces_of", "local_parameters", "pieces_registered",
           "sync_views", "follow_cleared", "link_grad", "link_grads", "landed"]
