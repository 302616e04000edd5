"""What a rank's state is made of: its plan, its shards, and its optimizer state by local name.

The checkpoint formats (dedup.py, merge.py, dcp.py, checkpoint.py) all go through these
helpers, so a plain torch optimizer and the ZeRO optimizer look the same to them:

    local optimizer state = {local param name: {"exp_avg": tensor shaped like the shard, ...}}

Under a pipelined plan a rank holds only its stages' parameters (its PARAMS rows), and a tied
weight (GPT's wte / lm_head) is held, equal, by every stage that uses it. plan_info records the
pipeline (`pipe_ranks`, this rank's `pipe_rank`, `tied`: {FQN: pipeline ranks holding it}), so
a tied weight is stored, counted and merged once: by the lowest pipeline rank holding it
(`first_holder`).
"""
from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor
import torch.distributed as dist

from nncompile.errors import CheckpointError

from ..protocol.groups import pipe_group
from ..store.pieces import local_parameters
from ..optim.optimizer import (PieceOptimizer, ZeroOptimizer, load_segment_state,
                               segment_state_by_name)
from ..optim.adoption import adopt
from ..store.segments import local_names, zero3_segments
from nncompile.rows import buffer_rows, param_rows
from ..store.holders import first_holder, pipe_rank, pipe_ranks, plan_info


# ---- pipelines: which ranks hold which parameters ------------------------------------------


def as_zero_state(info: dict, opt_sd: dict) -> dict:
    """A plain optimizer's state dict over ZeRO-3 flat pieces, with the layout that cut them
    (the form ZeroOptimizer.state_dict() has); unchanged otherwise."""
    z = info.get("zero3") if isinstance(info, dict) else None
    by_name = any(isinstance(k, str) for k in opt_sd.get("state", {}))    # deduped: local form
    if z is None or "nncompile_zero" in opt_sd or by_name or \
            any("lo" not in f for f in z["flats"]):       # only pieces cut as one flat vector
        return opt_sd
    indexed = sum(len(g.get("params", [])) for g in opt_sd.get("param_groups", []))
    flats = z["flats"] if indexed == len(z["flats"]) else [f for f in z["flats"] if f["trainable"]]
    return {**opt_sd, "nncompile_zero": {
        "zero_rank": z["zero_rank"], "zero_size": z["zero_size"], "ranks": z["ranks"],
        "shards": [{k: f[k] for k in ("names", "numels", "lo", "hi")} for f in flats]}}


def share_over_pipeline(pm, tensors: dict[str, torch.Tensor | None]
                        ) -> dict[str, torch.Tensor | None]:
    """Full tensors of this rank's stages by FQN -> those of every stage, in the original
    module's parameter order: each pipeline rank broadcasts the ones it is the first holder of
    (one flat buffer per dtype) over its pipeline group. Every rank of the job calls it."""
    if pm.PIPE_RANKS == 1 or not dist.is_initialized():
        return tensors
    group, ranks = pipe_group(pm.PLAN_NGPUS, pm.RUNTIME_NGPUS, pm.PIPE_RANKS, pm.mesh_axes)
    mine = {fqn: None if t is None else (tuple(t.shape), t.dtype)
            for fqn, t in tensors.items() if first_holder(pm, fqn)}
    specs: list[Any] = [None] * len(ranks)
    dist.all_gather_object(specs, mine, group=group)
    out: dict[str, torch.Tensor | None] = {}
    for p, spec in enumerate(specs):
        out.update({fqn: None for fqn, s in spec.items() if s is None})
        for dtype in sorted({s[1] for s in spec.values() if s is not None}, key=str):
            fqns = [fqn for fqn, s in spec.items() if s is not None and s[1] == dtype]
            sizes = [int(torch.Size(spec[fqn][0]).numel()) for fqn in fqns]
            if p == pipe_rank(pm):
                flat = torch.cat([tensors[fqn].reshape(-1).to(pm.device) for fqn in fqns])
            else:
                flat = torch.empty(sum(sizes), dtype=dtype, device=pm.device)
            dist.broadcast(flat, src=ranks[p], group=group)
            for fqn, piece in zip(fqns, flat.split(sizes)):
                out[fqn] = piece.view(spec[fqn][0]).clone()
    order = {fqn: i for i, fqn in enumerate(pm.PARAM_ORDER)}
    return dict(sorted(out.items(), key=lambda kv: order.get(kv[0], len(order))))


def describe(info: dict) -> str:
    pipe = f", {info['pipe_ranks']} pipeline ranks" if info.get("pipe_ranks", 1) > 1 else ""
    return (f"policy {info.get('policy')!r}, plan_ngpus {info.get('plan_ngpus')}{pipe}, "
            f"runtime_ngpus {info.get('runtime_ngpus')}, fingerprint "
            f"{str(info.get('fingerprint'))[:12]}")


def _plain(x: Any) -> Any:
    """Tuples (and torch.Size) as lists, so saved and live plan rows compare equal."""
    return [_plain(e) for e in x] if isinstance(x, (list, tuple)) else x


def shard_layout(info: dict) -> dict[str, dict[str, Any]]:
    """{FQN: what this rank holds of it} for a plan_info's parameters and persistent buffers:
    kind, local name, full shape, placement (parsed: rows.py) and this rank's slices."""
    out: dict[str, dict[str, Any]] = {}
    for kind, rows in (("parameter", param_rows(info)), ("buffer", buffer_rows(info))):
        for row in rows:
            out[row.fqn] = {"kind": kind, "local name": row.name, "full shape": _plain(row.shape),
                            "placement": row.placement, "slices": _plain(row.slices),
                            "part": _plain(getattr(row, "part", None))}
    return out


def plan_mismatch(saved: dict, mine: dict) -> str | None:
    """The first difference that keeps shards saved under plan_info `saved` from loading
    under `mine`, in words; None when every shard matches. The fingerprint is not compared:
    a plan compiled from another directory, or after an unrelated edit, loads."""
    for key in ("plan_ngpus", "runtime_ngpus"):
        if saved.get(key) != mine.get(key):
            return f"{key} is {saved.get(key)} in the checkpoint but {mine.get(key)} here"
    if pipe_ranks(saved) != pipe_ranks(mine):
        return (f"the plan unit has {pipe_ranks(saved)} pipeline ranks in the checkpoint but "
                f"{pipe_ranks(mine)} here")
    theirs, ours = shard_layout(saved), shard_layout(mine)
    for fqn, row in ours.items():
        if fqn not in theirs:
            return f"{row['kind']} {fqn!r} is not in the checkpoint"
        for field in ("full shape", "placement", "slices", "local name", "part"):
            if theirs[fqn][field] != row[field]:
                what = "this rank's slices" if field == "slices" else field
                return (f"{row['kind']} {fqn!r}: {what} {theirs[fqn][field]} in the "
                        f"checkpoint, {row[field]} here")
    extra = [fqn for fqn in theirs if fqn not in ours]
    if extra:
        return (f"the checkpoint has {theirs[extra[0]]['kind']} {extra[0]!r}, which this "
                f"module does not")
    if [r.name for r in param_rows(saved)] != [r.name for r in param_rows(mine)]:
        return "the parameters are in another order (optimizer state is saved by position)"
    return None


def check_same_plan(saved: dict, pm, where: str) -> None:
    """Refuse shards that differ from this rank's (another plan, or another rank's file)."""
    mine = plan_info(pm)
    same_size = all(saved.get(k) == mine[k] for k in ("plan_ngpus", "runtime_ngpus")) and \
        pipe_ranks(saved) == pipe_ranks(mine)
    if same_size and saved.get("rank") != mine["rank"]:
        raise CheckpointError(f"{where} holds rank {saved.get('rank')}'s shards but this is rank "
                              f"{mine['rank']}; load the file named after this rank (a state "
                              "dict of pm saved with torch.distributed.checkpoint holds one "
                              "rank's shards: save and load pm.module's instead, "
                              "get_model_state_dict(pm.module))")
    why = plan_mismatch(saved, mine)
    if why is not None:
        raise CheckpointError(
            f"{where} was saved under plan [{describe(saved)}] but this module runs plan "
            f"[{describe(mine)}]; its shards differ: {why}. Shards only load into a plan "
            f"that holds the same ones. To load it here, save with format='dcp' "
            f"(nncompile.save_checkpoint) which reshards on load, or merge it (python -m "
            f"nncompile merge DIR -o merged.pt) and load the merged file with "
            f"nncompile.load_checkpoint / nncompile.load_merged_state_dict")


def _zero3_shards(pm) -> list[tuple]:
    """(layout, segments, flat piece) of every ZeRO-3 unit (runtime/store/segments.py)."""
    segs = zero3_segments(pm)
    return [(u.layout, [segs[n] for n in u.layout.names], pm.zero.flat(u))
            for u in pm.zero.units]


def _trainable(pm) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n, p) for n, p in local_parameters(pm) if p.requires_grad]


# each saved parameter group's members by original FQN (merged checkpoints rebuild the groups
# from it; a plain optimizer's state dict numbers parameters group by group)
GROUP_FQNS = "nncompile_fqns"


def group_fqns(pm, opt) -> list[list[str]] | None:
    """The FQNs each of `opt`'s parameter groups steps (None if it holds a tensor that is not
    one of pm's parameters, handles or segments)."""
    rows = {row.name: row.fqn for row in param_rows(pm)}
    out = []
    for g in opt.param_groups:
        fqns = []
        for p in g["params"]:
            span = getattr(p, "_nnc_span", None)
            names = [span[0]] if span is not None else local_names(pm, p)
            if not names or any(n not in rows for n in names):
                return None
            fqns += [rows[n] for n in names if rows[n] not in fqns]
        out.append(fqns)
    return out


def hyper(group: dict) -> dict:
    """A saved parameter group's hyper-parameters (without members)."""
    return {k: v for k, v in group.items() if k not in ("params", GROUP_FQNS)}


def local_optimizer_state(pm, opt, copy: bool = True) -> dict[str, Any]:
    """{"state": {local name: {key: value}}, "param_groups": [hyperparameters and the group's
    FQNs]} (for ZeRO a collective over the ZeRO group). copy=False: a plain optimizer's own
    state tensors, not copies (for a writer that copies or writes before the next step)."""
    fqns = group_fqns(pm, opt)
    groups = [{**{k: v for k, v in g.items() if k != "params"},
               **({GROUP_FQNS: fqns[i]} if fqns is not None else {})}
              for i, g in enumerate(opt.param_groups)]
    if isinstance(opt, ZeroOptimizer):
        return {"state": opt.local_state(), "param_groups": groups}
    adopt(opt)                  # handles or released originals: what the next step steps
    if pm.zero is not None:     # a plain optimizer over the ZeRO-3 segments (or DTensor views)
        by_seg = dict(opt.state)
        for seg, view in _viewed_segments(pm, opt).items():
            by_seg[seg] = {k: _local(v).reshape(-1) if isinstance(v, DTensor) else v
                           for k, v in opt.state.get(view, {}).items()}
        return {"state": segment_state_by_name(by_seg, _zero3_shards(pm),
                                               pm.zero.gather_state),
                "param_groups": groups}
    names = {id(p): n for n, p in _trainable(pm)}
    names.update({id(view): n for n, view in _stepped_views(opt).items()})
    state = {}
    for p, st in opt.state.items():
        if id(p) not in names:
            raise CheckpointError("the optimizer holds a tensor that is not a parameter of this "
                                  "ParallelModule; build it with nncompile.build_optimizer(pm, "
                                  "...) or over pm.parameters()")
        state[names[id(p)]] = {k: (_local(v).clone() if copy else _local(v))
                               if torch.is_tensor(v) else v for k, v in st.items()}
    return {"state": state, "param_groups": groups}


def _stepped_views(opt) -> dict[str, torch.Tensor]:
    """{local name: DTensor view} for the module's DTensor parameters `opt` steps as they are
    (runtime/store/module_views.py); their state is saved as its local pieces, like pm's own. A
    PieceOptimizer steps the pieces under them: none."""
    if isinstance(opt, PieceOptimizer):
        return {}
    return {p._nnc_handle[1]: p for g in opt.param_groups for p in g["params"]
            if getattr(p, "_nnc_view", False)}


def _viewed_segments(pm, opt) -> dict:
    """{ZeRO-3 segment: the module's DTensor view of it} for the views `opt` steps."""
    segs = zero3_segments(pm)
    return {segs[name]: view for name, view in _stepped_views(opt).items() if name in segs}


def _local(v: torch.Tensor) -> torch.Tensor:
    return v.to_local() if isinstance(v, DTensor) else v


def _like(p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """A saved local state tensor as state of `p`: a DTensor like p when p is one."""
    if isinstance(p, DTensor) and not isinstance(v, DTensor) and v.dim() and \
            tuple(v.shape) == tuple(p.to_local().shape):
        return DTensor.from_local(v.to(p.device), p.device_mesh, p.placements,
                                  run_check=False, shape=p.shape, stride=p.stride())
    return v


def state_like_params(opt) -> None:
    """After torch's `opt.load_state_dict`: each state tensor in the form of its parameter. A
    sharded checkpoint saved by an optimizer over pm's pieces (one built before parallelize,
    adopted) holds plain local tensors, one saved over pm's DTensor parameters DTensors;
    torch's loader only moves them to the parameter's device and dtype, and the next step
    would mix the two ("got mixed torch.Tensor and DTensor")."""
    for group in opt.param_groups:
        for p in group["params"]:
            st = opt.state.get(p)
            if not st:
                continue
            for k, v in list(st.items()):
                if not torch.is_tensor(v) or not v.dim():
                    continue
                if isinstance(p, DTensor):
                    st[k] = _like(p, v)
                elif isinstance(v, DTensor) and tuple(v.to_local().shape) == tuple(p.shape):
                    st[k] = v.to_local()


def load_local_optimizer_state(pm, opt, local: dict[str, Any]) -> None:
    """Inverse of local_optimizer_state."""
    if len(local.get("param_groups", [])) not in (0, len(opt.param_groups)):
        raise CheckpointError(f"the checkpoint has {len(local['param_groups'])} optimizer param "
                              f"groups but the optimizer has {len(opt.param_groups)}")
    for group, saved in zip(opt.param_groups, local.get("param_groups", [])):
        group.update(hyper(saved))
    if isinstance(opt, ZeroOptimizer):
        opt.load_local_state(local["state"])
        return
    adopt(opt)
    if pm.zero is not None:
        loaded: dict = {}
        load_segment_state(loaded, _zero3_shards(pm), local["state"])
        views = _viewed_segments(pm, opt)
        for seg, st in loaded.items():
            view = views.get(seg)
            opt.state[seg if view is None else view] = st if view is None else {
                k: _like(view, v.view(view.to_local().shape))
                if torch.is_tensor(v) and v.dim() == 1 and v.numel() == seg.numel() else v
                for k, v in st.items()}
        return
    params = {**dict(_trainable(pm)), **_stepped_views(opt)}
    for name, st in local["state"].items():
        if name not in params:
            raise CheckpointError(f"the checkpoint has optimizer state for {name!r}, which this "
                                  f"module does not have")
        p = params[name]
        opt.state[p] = {k: _like(p, v.to(p.device)) if torch.is_tensor(v) and v.dim() else v
                        for k, v in st.items()}


def optimizer_state_by_name(pm, opt_sd: dict) -> dict[str, Any]:
    """Normalize one rank's optimizer state dict to the local-name form. Accepts the local form
    itself or a plain torch optimizer's state_dict() built over pm.parameters() or over its
    trainable ones (what build_optimizer does when some are frozen)."""
    if "nncompile_zero" in opt_sd:
        raise CheckpointError("ZeRO optimizer state dicts are pieces of a flat vector; merge them "
                              "with merge_state_dicts(model_sds, opt_sds) over all ranks")
    state = opt_sd.get("state", {})
    if all(isinstance(k, str) for k in state):
        return {"state": state, "param_groups": [
            {k: v for k, v in g.items() if k != "params"} for g in opt_sd.get("param_groups", [])]}
    rows = param_rows(pm)
    names = [row.name for row in rows]
    fqn_of = {row.name: row.fqn for row in rows}
    frozen = set(pm.get("frozen", []) if isinstance(pm, dict) else pm.FROZEN)
    saved_groups = opt_sd.get("param_groups", [])
    indexed = sum(len(g.get("params", [])) for g in saved_groups)
    if frozen and indexed != len(names):      # built over the trainable parameters only
        names = [n for n in names if n not in frozen]
    members = group_members(rows, saved_groups)
    if members is None:         # one group over pm.parameters() (several: merge refuses)
        return {"state": {names[i]: st for i, st in state.items()},
                "param_groups": [hyper(g) for g in saved_groups]}
    index = {i: n for g, m in zip(saved_groups, members) for i, n in zip(g["params"], m)}
    return {"state": {index[i]: st for i, st in state.items()},
            "param_groups": [{**hyper(g), GROUP_FQNS: [fqn_of[n] for n in m]}
                             for g, m in zip(saved_groups, members)]}


def group_members(rows, saved_groups: list[dict]) -> list[list[str]] | None:
    """Each saved group's parameters by local name, in index order: from the FQNs
    save_checkpoint records, or torch's own "param_names" (an optimizer built over
    pm.named_parameters()); None when the state dict does not say."""
    if not saved_groups:
        return None
    by_fqn = {row.fqn: row.name for row in rows}
    if all(GROUP_FQNS in g for g in saved_groups) and \
            all(f in by_fqn for g in saved_groups for f in g[GROUP_FQNS]):
        return [[by_fqn[f] for f in g[GROUP_FQNS]] for g in saved_groups]
    local = {row.name for row in rows}
    if all(len(g.get("param_names", ())) == len(g["params"]) and
           set(g["param_names"]) <= local for g in saved_groups):
        return [list(g["param_names"]) for g in saved_groups]
    return None


def with_members(pm, opt, sd: dict) -> dict:
    """opt.state_dict() with each group's members by FQN (merging rebuilds the groups from
    them; a plain optimizer's state dict numbers parameters group by group)."""
    fqns = group_fqns(pm, opt)
    if fqns is None:
        return sd
    return {**sd, "param_groups": [{**g, GROUP_FQNS: f}
                                   for g, f in zip(sd["param_groups"], fqns)]}


def without_members(sd: dict) -> dict:
    """Inverse of with_members, for opt.load_state_dict."""
    return {**sd, "param_groups": [{k: v for k, v in g.items() if k != GROUP_FQNS}
                                   for g in sd.get("param_groups", [])]}
