"""The module given to parallelize holds DTensor views of pm's parameters.

Under a plan that shards parameters (tp, tp_sp, autodist's splits, context and expert
parallelism) pm keeps one rank's piece of each weight, and the module's own copy is released
(runtime/store/released.py). Each released parameter is then replaced, in the module, by a
DTensor Parameter on the plan's device mesh (the one DCP checkpoints use, runtime/checkpoints/dcp.py) whose
local tensor is a view of pm's piece; where every parameter has one, pm's own parameters
become the same DTensors (view_pieces; the pieces stay under them for the generated code,
runtime/store/pieces.py). Code that reads or edits `pm.module`'s weights (DDP's
`model.module` habit) works as on one device and acts on what pm trains:

    before: pm.module.h[0].mlp_fc.weight.norm()        -> the process crashed (no storage)
    after:  the DTensor norm over the plan (every rank calls it, as under FSDP2)
            pm.module.h[0].mlp_fc.weight.data.clamp_(-c, c)   -> clamps pm's piece
            pm.module.h[0].requires_grad_(False)       -> that block gets no gradient and no
                                                          update from the next forward on
            pm.module.state_dict()                     -> DTensors under the original names

A flag set on a view (`requires_grad_`) reaches pm's piece at pm's next forward; after each
backward a view's `.grad` is a DTensor over the piece's gradient. ZeRO-3's views are Shard(0)
DTensors over the flat pieces (runtime/store/zero3_views.py). Kept released (computing with them is
a clear error): a parameter held as parts of a fused one (q|k|v rows split by heads), and
pipelined plans'.
"""
from __future__ import annotations

import contextlib
import weakref

import torch
import torch.distributed as dist


from nncompile.mesh import CP
from nncompile.rows import param_rows

from .dtensors import _dtensor
from .released import ReleasedParameter
from .pieces import pieces_of
from .view_grads import add_entries, link_grads, watch_grad


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
    # a fused parameter held as parts (q|k|v rows split by heads) stays released in the
    # module; pm's parts are viewed each as a DTensor of its own (a part of the fused one)
    part_names = {r.name for r in rows if r.part is not None and r.name in pm._parameters}
    whole_mine = [(fqn, p) for fqn, p in mine if id(p) in row_of]
    whole = split_plan and bool(mine) and all(
        (local := local_of.get(id(p))) is not None and local.is_contiguous() and
        local.device == p.device and (isinstance(p, ReleasedParameter) or p is local)
        for _, p in whole_mine) and \
        all(isinstance(p, ReleasedParameter) for fqn, p in mine if id(p) not in row_of) and \
        all(pm._parameters[n].is_contiguous() for n in part_names) and \
        {row_of[id(p)].name for _, p in whole_mine} | part_names == set(pm._parameters)
    if not released and not whole:
        return released
    if whole:                 # every parameter: pm's own become these views too
        views = view_pieces(pm, {**{id(p): row_of[id(p)].name for _, p in whole_mine},
                                 **{n: n for n in part_names}})
        mine = whole_mine
        for fqn, p in mine:
            owner, _, leaf = fqn.rpartition(".")
            module.get_submodule(owner)._parameters[leaf] = views[row_of[id(p)].name]
        if not getattr(module, "_nnc_guard", False):
            from .released import _released_forward
            module._nnc_guard = True
            module.register_forward_pre_hook(_released_forward(params[0][0]))
        return [fqn for fqn, p in params if id(p) not in row_of] \
            if pm.PIPELINE is not None or part_names else []
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
    rows = {row.name: row for row in param_rows(pm)}      # a part: a DTensor of its own
    wanted = list(pm._parameters) if names is None else list(dict.fromkeys(names.values()))
    views, entries = {}, []
    for name in wanted:
        piece = pieces_of(pm).get(name, pm._parameters[name])
        view = _view(pm, piece, rows[name], piece.requires_grad, stepped=True)
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

