"""What a rank's state is made of: its plan, its shards, and its optimizer state by local name.

The checkpoint formats (dedup.py, merge.py, dcp.py, checkpoint.py) all go through these
helpers, so a plain torch optimizer and the ZeRO optimizer look the same to them:

    local optimizer state = {local param name: {"exp_avg": tensor shaped like the shard, ...}}
"""
from __future__ import annotations

from typing import Any

import torch

from nncompile.errors import CheckpointError
from nncompile.ir.placement import Placement, Shard

from .optimizer import ZeroOptimizer, flat_state_by_name, flat_state_piece
from .rows import buffer_rows, param_rows


def plan_info(pm) -> dict[str, Any]:
    """The plan a rank's shards belong to; stored with every per-rank state dict."""
    return {"fingerprint": pm.FINGERPRINT, "policy": pm.POLICY, "rank": pm.RANK,
            "plan_ngpus": pm.PLAN_NGPUS, "runtime_ngpus": pm.RUNTIME_NGPUS,
            "params": [list(r.plain()) for r in param_rows(pm)],
            "buffers": [list(r.plain()) for r in buffer_rows(pm)],
            "param_order": list(pm.PARAM_ORDER), "frozen": list(pm.FROZEN),
            "state_keys": [list(k) for k in pm.STATE_KEYS],
            **({"zero3": zero3_layout(pm)} if pm.zero is not None else {})}


def zero3_layout(pm) -> dict[str, Any]:
    """Under ZeRO-3: how pm.parameters() (the flat pieces, in order) cut the local tensors, so
    a plain optimizer's indexed state over them can be merged (merge.py)."""
    z = pm.zero
    return {"zero_rank": z.rank, "zero_size": z.size,
            "ranks": list(z.ranks),
            "flats": [{"attr": u.attr, "names": u.layout.names, "numels": u.layout.numels,
                       "lo": u.layout.lo, "hi": u.layout.hi, "trainable": u.trainable}
                      for u in z.units]}


def as_zero_state(info: dict, opt_sd: dict) -> dict:
    """A plain optimizer's state dict over ZeRO-3 flat pieces, with the layout that cut them
    (the form ZeroOptimizer.state_dict() has); unchanged otherwise."""
    z = info.get("zero3") if isinstance(info, dict) else None
    if z is None or "nncompile_zero" in opt_sd:
        return opt_sd
    indexed = sum(len(g.get("params", [])) for g in opt_sd.get("param_groups", []))
    flats = z["flats"] if indexed == len(z["flats"]) else [f for f in z["flats"] if f["trainable"]]
    return {**opt_sd, "nncompile_zero": {
        "zero_rank": z["zero_rank"], "zero_size": z["zero_size"], "ranks": z["ranks"],
        "shards": [{k: f[k] for k in ("names", "numels", "lo", "hi")} for f in flats]}}


def describe(info: dict) -> str:
    return (f"policy {info.get('policy')!r}, plan_ngpus {info.get('plan_ngpus')}, "
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
                            "placement": row.placement, "slices": _plain(row.slices)}
    return out


def plan_mismatch(saved: dict, mine: dict) -> str | None:
    """The first difference that keeps shards saved under plan_info `saved` from loading
    under `mine`, in words; None when every shard matches. The fingerprint is not compared:
    a plan compiled from another directory, or after an unrelated edit, loads."""
    for key in ("plan_ngpus", "runtime_ngpus"):
        if saved.get(key) != mine.get(key):
            return f"{key} is {saved.get(key)} in the checkpoint but {mine.get(key)} here"
    theirs, ours = shard_layout(saved), shard_layout(mine)
    for fqn, row in ours.items():
        if fqn not in theirs:
            return f"{row['kind']} {fqn!r} is not in the checkpoint"
        for field in ("full shape", "placement", "slices", "local name"):
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
    same_size = all(saved.get(k) == mine[k] for k in ("plan_ngpus", "runtime_ngpus"))
    if same_size and saved.get("rank") != mine["rank"]:
        raise CheckpointError(f"{where} holds rank {saved.get('rank')}'s shards but this is rank "
                              f"{mine['rank']}; load the file named after this rank")
    why = plan_mismatch(saved, mine)
    if why is not None:
        raise CheckpointError(
            f"{where} was saved under plan [{describe(saved)}] but this module runs plan "
            f"[{describe(mine)}]; its shards differ: {why}. Shards only load into a plan "
            f"that holds the same ones. To load it here, save with format='dcp' "
            f"(nncompile.save_checkpoint) which reshards on load, or merge it (python -m "
            f"nncompile merge DIR -o merged.pt) and load the merged file with "
            f"nncompile.load_checkpoint / nncompile.load_merged_state_dict")


def is_owner(pm, placement: Placement) -> bool:
    """Whether this rank stores a shard in a deduped checkpoint: the first data-parallel unit
    stores everything, and inside it a replicated tensor is stored by plan rank 0 only."""
    dp_index, plan_rank = divmod(pm.RANK, pm.PLAN_NGPUS)
    return dp_index == 0 and (isinstance(placement, Shard) or plan_rank == 0)


def owner_rank(pm, placement: Placement) -> int:
    """The global rank that stores a tensor with this placement (see is_owner)."""
    return pm.RANK % pm.PLAN_NGPUS if isinstance(placement, Shard) else 0


def _trainable(pm) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n, p) for n, p in pm.named_parameters() if p.requires_grad]


def local_optimizer_state(pm, opt) -> dict[str, Any]:
    """{"state": {local name: {key: value}}, "param_groups": [hyperparameters]} (for ZeRO a
    collective over the ZeRO group)."""
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    if isinstance(opt, ZeroOptimizer):
        return {"state": opt.local_state(), "param_groups": groups}
    if pm.zero is not None:                     # a plain optimizer over the ZeRO-3 pieces
        flats = [(getattr(pm, u.attr), u.layout) for u in pm.zero.units]
        return {"state": flat_state_by_name(opt.state, flats, pm.zero.gather_state),
                "param_groups": groups}
    names = {id(p): n for n, p in _trainable(pm)}
    state = {}
    for p, st in opt.state.items():
        if id(p) not in names:
            raise CheckpointError("the optimizer holds a tensor that is not a parameter of this "
                                  "ParallelModule; build it with nncompile.build_optimizer(pm, "
                                  "...) or over pm.parameters()")
        state[names[id(p)]] = {k: v.clone() if torch.is_tensor(v) else v for k, v in st.items()}
    return {"state": state, "param_groups": groups}


def load_local_optimizer_state(pm, opt, local: dict[str, Any]) -> None:
    """Inverse of local_optimizer_state."""
    if len(local.get("param_groups", [])) not in (0, len(opt.param_groups)):
        raise CheckpointError(f"the checkpoint has {len(local['param_groups'])} optimizer param "
                              f"groups but the optimizer has {len(opt.param_groups)}")
    for group, saved in zip(opt.param_groups, local.get("param_groups", [])):
        group.update({k: v for k, v in saved.items() if k != "params"})
    if isinstance(opt, ZeroOptimizer):
        opt.load_local_state(local["state"])
        return
    if pm.zero is not None:
        for u in pm.zero.units:
            flat = getattr(pm, u.attr)
            new = flat_state_piece(local["state"], u.layout, flat)
            if new:
                opt.state[flat] = new
        return
    params = dict(_trainable(pm))
    for name, st in local["state"].items():
        if name not in params:
            raise CheckpointError(f"the checkpoint has optimizer state for {name!r}, which this "
                                  f"module does not have")
        p = params[name]
        opt.state[p] = {k: v.to(p.device) if torch.is_tensor(v) and v.dim() else v
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
    names = [row.name for row in param_rows(pm)]
    frozen = set(pm.get("frozen", []) if isinstance(pm, dict) else pm.FROZEN)
    indexed = sum(len(g.get("params", [])) for g in opt_sd.get("param_groups", []))
    if frozen and indexed != len(names):      # built over the trainable parameters only
        names = [n for n in names if n not in frozen]
    return {"state": {names[i]: st for i, st in state.items()},
            "param_groups": [{k: v for k, v in g.items() if k != "params"}
                             for g in opt_sd.get("param_groups", [])]}
