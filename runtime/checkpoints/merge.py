"""Merged checkpoints: per-rank shards -> the state dicts the original single-device module and
its optimizer load, and back into any plan.

    before: rank0 {"h0_mlp_fc_weight": [64, 32] (rows 0..63), "_extra_state": plan}, rank1 ...
    after:  {"h.0.mlp_fc.weight": [128, 32], ...}          (every key of module.state_dict())
            {"state": {i: {"exp_avg": full, ...}}, "param_groups": [...]}   i: module.parameters()
            with several parameter groups, i numbers the groups' parameters group by group, as
            torch.optim.AdamW([{"params": decay, ...}, {"params": no_decay, ...}]) numbers them
            (each group's in module.parameters() order, its members under "param_names")

Each shard is placed by the slices recorded in its rank's plan (the `_extra_state` entry), so
sharded and deduped state dicts merge alike, and any set of ranks that covers every slice is
enough. Under a pipeline a rank's plan lists only its stages' tensors: the ranks of every
stage together cover the model (a tied weight, equal on each stage holding it, merges once).
"""
from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from nncompile.errors import CheckpointError

from nncompile.rows import BufferRow, param_rows, put, state_rows, take
from .state import (GROUP_FQNS, as_zero_state, group_fqns, hyper, load_local_optimizer_state,
                    optimizer_state_by_name, shard_layout)
from ..store.holders import pipe_rank, pipe_ranks


class _Assembler:
    """Full tensors filled piece by piece; complains about what no rank provided."""

    def __init__(self):
        self.full: dict[str, torch.Tensor] = {}
        self.covered: dict[str, torch.Tensor] = {}

    def put(self, key: str, row, piece: torch.Tensor) -> None:
        """Place a rank's local tensor of `row` into the full (original-layout) tensor `key`
        (rows.put: a part of a fused parameter lands in its rows of the source). The first
        rank given that holds a slice wins: ranks agree on parameters, but each data-parallel
        unit keeps its own buffers (BatchNorm statistics), and the merged state keeps the
        first unit's, as a DDP checkpoint saved by rank 0 does."""
        shape = row.source_shape
        if key not in self.full:
            self.full[key] = piece.new_zeros(shape)
            self.covered[key] = torch.zeros(shape, dtype=torch.bool)
        covered = take(row, self.covered[key])
        if covered.numel() and bool(covered.all()):
            return
        put(row, self.full[key], piece.detach().cpu())
        put(row, self.covered[key], torch.ones(row.local_shape, dtype=torch.bool))

    def result(self, what: str) -> dict[str, torch.Tensor]:
        missing = [k for k, c in self.covered.items() if not bool(c.all())]
        if missing:
            raise CheckpointError(f"the given ranks do not cover every slice of {what} "
                                  f"{missing[:5]}; pass the files of all ranks of one plan unit")
        return self.full


def _info(sd: dict, i: int) -> dict:
    info = sd.get("_extra_state")
    if not isinstance(info, dict) or "params" not in info:
        raise CheckpointError(f"state dict #{i} is not a ParallelModule state dict (no plan "
                              f"metadata under '_extra_state'); pass pm.local_state_dict() or "
                              f"nncompile.deduped_state_dict(pm, opt)[0] of every rank")
    return info


def _check_one_plan(infos: list[dict]) -> None:
    """The ranks' plans must agree on the plan size and, per FQN, on full shape, and ranks of
    one pipeline rank on their tensors and placements (their slices differ by design); under a
    pipeline every pipeline rank must be among them. The fingerprint is not compared."""
    first = infos[0]
    size_keys = ("plan_ngpus", "runtime_ngpus", "pipe_ranks")
    shapes: dict[str, tuple[int, Any]] = {}
    by_pipe: dict[int, tuple[int, dict]] = {}
    for i, info in enumerate(infos):
        j, why = 0, next((f"{k} {first.get(k, 1)} vs {info.get(k, 1)}" for k in size_keys
                          if first.get(k, 1) != info.get(k, 1)), None)
        layout = shard_layout(info)
        same_pipe, layout0 = by_pipe.setdefault(pipe_rank(info), (i, layout))
        if why is None and layout.keys() != layout0.keys():
            fqn = sorted(layout.keys() ^ layout0.keys())[0]
            why, j = f"{fqn!r} is in only one of them", same_pipe
        for fqn, row in layout.items():
            k, shape = shapes.setdefault(fqn, (i, row["full shape"]))
            if why is None and shape != row["full shape"]:
                why, j = f"{row['kind']} {fqn!r}: full shape {shape} vs {row['full shape']}", k
            if why is None and row["placement"] != layout0[fqn]["placement"]:
                why, j = (f"{row['kind']} {fqn!r}: placement {layout0[fqn]['placement']} vs "
                          f"{row['placement']}"), same_pipe
        if why is not None:
            raise CheckpointError(f"state dicts #{j} and #{i} come from different plans ({why}); "
                                  "merge the files of one checkpoint")
    missing = sorted(set(range(pipe_ranks(first))) - set(by_pipe))
    if missing:
        raise CheckpointError(
            f"the given state dicts hold pipeline ranks {sorted(by_pipe)} of "
            f"{pipe_ranks(first)}, so the parameters of pipeline ranks {missing} are missing; "
            "pass the files of all ranks of one plan unit (every stage)")


def merge_state_dicts(model_sds: list[dict], opt_sds: list[dict] | None = None
                      ) -> tuple[dict[str, torch.Tensor], dict | None]:
    """Per-rank model (and optimizer) state dicts of one plan -> (model state dict, optimizer
    state dict) of the original single-device module (optimizer built over module.parameters()).
    """
    if not model_sds:
        raise CheckpointError("merge_state_dicts needs at least one rank's state dict")
    infos = [_info(sd, i) for i, sd in enumerate(model_sds)]
    _check_one_plan(infos)
    params = _Assembler()
    for sd, info in zip(model_sds, infos):
        for row in state_rows(info):
            if row.name in sd:
                params.put(row.source, row, sd[row.name])
    full = params.result("the parameters")
    info = infos[0]
    model = {key: full[canon] for key, canon in info["state_keys"] if canon in full}
    if opt_sds is None:
        return model, None
    if len(opt_sds) != len(model_sds):
        raise CheckpointError(f"got {len(model_sds)} model and {len(opt_sds)} optimizer state "
                              "dicts; pass them rank by rank")
    return model, _merge_optimizer(infos, opt_sds)


def _merge_optimizer(infos: list[dict], opt_sds: list[dict]) -> dict:
    states = _unzero(infos, opt_sds)
    scalars: dict[str, dict[str, Any]] = {}
    tensors = _Assembler()
    groups: list[dict] = []
    for info, opt_sd, local in zip(infos, opt_sds, states):
        local = local if local is not None else optimizer_state_by_name(info, opt_sd)
        groups = _union_groups(groups, local["param_groups"])
        rows = {row.name: row for row in param_rows(info)}
        for name, st in local["state"].items():
            row = rows[name]
            for key, v in st.items():
                if isinstance(v, DTensor):     # an optimizer over pm's DTensor parameters
                    v = v.to_local()           # (saved as they are): this rank's piece
                if torch.is_tensor(v) and tuple(v.shape) != () and \
                        tuple(v.shape) == row.local_shape:
                    tensors.put(f"{row.source}\0{key}", row, v)
                else:
                    scalars.setdefault(row.source, {})[key] = _own(v)
    full = tensors.result("the optimizer state")
    by_fqn: dict[str, dict[str, Any]] = {}
    for fqn, st in scalars.items():
        by_fqn.setdefault(fqn, {}).update(st)
    for k, v in full.items():
        fqn, key = k.split("\0", 1)
        by_fqn.setdefault(fqn, {})[key] = v
    sources = {row.fqn: row.source for info in infos for row in param_rows(info)}
    return merged_optimizer(infos[0]["param_order"], by_fqn, as_sources(groups, sources))


def as_sources(groups: list[dict], sources: dict[str, str]) -> list[dict]:
    """Saved groups whose members name parts of a fused parameter (their unique keys) ->
    members by the original parameters' FQNs (each once)."""
    out = []
    for g in groups:
        if GROUP_FQNS in g:
            g = {**g, GROUP_FQNS: list(dict.fromkeys(sources.get(f, f) for f in g[GROUP_FQNS]))}
        out.append(g)
    return out


def _union_groups(groups: list[dict], mine: list[dict]) -> list[dict]:
    """Saved groups of the ranks so far and one more rank's: the first rank's hyper-parameters
    per group, the members (FQNs) of all."""
    if not groups:
        return [dict(g) for g in mine]
    if mine and len(mine) != len(groups):
        raise CheckpointError(f"the ranks' optimizers have {len(groups)} and {len(mine)} "
                              "parameter groups; merge the files of one checkpoint")
    for g, m in zip(groups, mine):
        if GROUP_FQNS in g and GROUP_FQNS in m:
            g[GROUP_FQNS] = [*g[GROUP_FQNS], *(f for f in m[GROUP_FQNS] if f not in g[GROUP_FQNS])]
        else:
            g.pop(GROUP_FQNS, None)
    return groups


def merged_optimizer(order: list[str], by_fqn: dict[str, dict], groups: list[dict]) -> dict:
    """State by FQN and the saved groups (hyper-parameters, members by FQN) -> the state dict of
    a torch optimizer built over those groups on one device: parameters numbered group by
    group (each group's in the module's parameter order), each group with its own
    hyper-parameters and its members' names ("param_names", as torch records them). One group
    holds every parameter of module.parameters() (an optimizer over model.parameters())."""
    groups = groups or [{}]
    if len(groups) == 1:       # one group: indexed like module.parameters(), frozen ones too
        groups = [{**groups[0], GROUP_FQNS: list(order)}]
    elif not all(GROUP_FQNS in g for g in groups):
        raise CheckpointError(
            f"the optimizer state has {len(groups)} parameter groups but does not record "
            "which parameters each holds (saved by an older version, or a state dict passed "
            "in by hand); save it again with nncompile.save_checkpoint")
    at = {f: i for i, f in enumerate(order)}
    state: dict[int, dict[str, Any]] = {}
    out, index = [], 0
    for g in groups:
        fqns = sorted(g[GROUP_FQNS], key=lambda f: at.get(f, len(at)))
        ids = list(range(index, index + len(fqns)))
        index += len(fqns)
        for i, fqn in zip(ids, fqns):
            if by_fqn.get(fqn):
                state[i] = by_fqn[fqn]
        out.append({**hyper(g), "params": ids, "param_names": fqns})
    return {"state": state, "param_groups": out}


def _own(v: Any) -> Any:
    """A tensor of its own: torch.save keeps aliasing, and an optimizer loading one tensor as
    many parameters' `step` would advance it once per parameter and step."""
    return v.detach().clone() if torch.is_tensor(v) else v


def _runs(sd: dict) -> dict:
    """ZeRO pieces held as DTensors (an optimizer over pm's ZeRO-3 DTensor parameters) as the
    flat runs the layout describes (each local tensor is its parameter's run)."""
    if "nncompile_zero" not in sd:
        return sd
    state = {k: {key: v.to_local().reshape(-1) if isinstance(v, DTensor) else v
                 for key, v in st.items()} for k, st in sd.get("state", {}).items()}
    return {**sd, "state": state}


def _unzero(infos: list[dict], opt_sds: list[dict]) -> list[dict | None]:
    """ZeRO pieces -> each rank's local-name state (None for non-ZeRO state dicts): the pieces
    of ranks in one ZeRO group are concatenated back into the flat state."""
    opt_sds = [_runs(as_zero_state(info, sd)) for info, sd in zip(infos, opt_sds)]
    out: list[dict | None] = [None] * len(opt_sds)
    groups: dict[tuple, list[int]] = {}
    for i, sd in enumerate(opt_sds):
        if "nncompile_zero" in sd:
            layout = sd["nncompile_zero"]
            groups.setdefault((tuple(layout["ranks"]), infos[i]["rank"] % infos[i]["plan_ngpus"]),
                              []).append(i)
    for members in groups.values():
        layouts = {opt_sds[i]["nncompile_zero"]["zero_rank"]: i for i in members}
        size = opt_sds[members[0]]["nncompile_zero"]["zero_size"]
        if len(layouts) != size:
            continue        # an incomplete group; another group of the same shard may cover it
        ordered = [opt_sds[layouts[z]] for z in range(size)]
        local: dict[str, dict[str, Any]] = {}
        for k, shard in enumerate(ordered[0]["nncompile_zero"]["shards"]):
            per_rank = [sd["state"].get(k, {}) for sd in ordered]
            for key in per_rank[0]:
                vals = [st[key] for st in per_rank]
                if torch.is_tensor(vals[0]) and vals[0].dim() == 1:
                    flat = torch.cat(vals)
                    for name, piece in zip(shard["names"],
                                           flat[:sum(shard["numels"])].split(shard["numels"])):
                        local.setdefault(name, {})[key] = piece
                else:             # a per-piece scalar (AdamW's step): one copy per parameter
                    for name in shard["names"]:
                        local.setdefault(name, {})[key] = _own(vals[0])
        fqn = {row.name: row.fqn for row in param_rows(infos[members[0]])}
        shards = ordered[0]["nncompile_zero"]["shards"]
        hypers = [{**hyper(g), GROUP_FQNS: g[GROUP_FQNS] if GROUP_FQNS in g else
                   [fqn[n] for k in g["params"] for n in shards[k]["names"]]}
                  for g in ordered[0].get("param_groups", [])]
        for i in members:
            rows = {row.name: row for row in param_rows(infos[i])}
            out[i] = {"state": {n: {k: (v.view(rows[n].local_shape)
                                        if torch.is_tensor(v) and v.dim() == 1 else v)
                                    for k, v in st.items()} for n, st in local.items()},
                      "param_groups": hypers}
    for i, sd in enumerate(opt_sds):
        if "nncompile_zero" in sd and out[i] is None:
            out[i] = {"state": {}, "param_groups": []}   # covered by a complete group
    return out


def load_merged_state_dict(pm, state_dict: dict[str, torch.Tensor], optimizer=None,
                           optimizer_state_dict: dict | None = None) -> None:
    """Load a full state dict (the original module's, or merge_state_dicts' output) into this
    rank's shards, and the optimizer's full state (indexed like module.parameters())."""
    by_canon = {}
    for key, canon in pm.STATE_KEYS:
        if key in state_dict:
            by_canon.setdefault(canon, state_dict[key])
    local = {}
    in_state_dict = {canon for _, canon in pm.STATE_KEYS}
    for row in state_rows(pm):
        fqn = row.source
        full = by_canon.get(fqn, state_dict.get(fqn))
        if full is None and isinstance(row, BufferRow) and fqn not in in_state_dict:
            continue        # a non-persistent buffer (rotary inv_freq): not in state dicts
        if full is None:
            raise CheckpointError(f"the state dict has no {fqn!r} (it has "
                                  f"{len(state_dict)} keys, e.g. {list(state_dict)[:3]})")
        shape = row.source_shape
        if tuple(full.shape) != shape:
            raise CheckpointError(f"the state dict's {fqn!r} has shape {tuple(full.shape)} but "
                                  f"this module's is {shape}; load a state dict of the same "
                                  f"model")
        local[row.name] = take(row, full)
    pm.load_local_tensors(local)
    if optimizer is None:
        return
    if optimizer_state_dict is None:
        raise CheckpointError("pass optimizer_state_dict together with optimizer")
    load_merged_optimizer_state(pm, optimizer, optimizer_state_dict)


def load_merged_optimizer_state(pm, optimizer, optimizer_state_dict: dict) -> None:
    """This rank's slices of a merged optimizer state dict (indexed like module.parameters())."""
    saved = optimizer_state_dict.get("state", {})
    saved_groups = optimizer_state_dict.get("param_groups", [])
    at = {fqn: i for i, fqn in _indexed_fqns(pm, optimizer, saved_groups).items()}
    local: dict[str, dict[str, Any]] = {}
    for row in param_rows(pm):
        st = saved.get(at[row.source]) if row.source in at else None
        if st is None:
            continue
        local[row.name] = {}
        for key, v in st.items():
            if torch.is_tensor(v) and tuple(v.shape) == row.source_shape and v.dim():
                v = take(row, v)
            local[row.name][key] = v.clone() if torch.is_tensor(v) else v
    groups = [{k: v for k, v in hyper(g).items() if k != "param_names"} for g in saved_groups]
    load_local_optimizer_state(pm, optimizer, {"state": local, "param_groups": groups})


def _indexed_fqns(pm, optimizer, saved_groups: list[dict]) -> dict[int, str]:
    """{index: FQN} of a merged (or one-device) optimizer state dict: by its groups'
    "param_names"; else, with several groups, by this optimizer's groups when they have the
    same sizes (built the same way); else module.parameters() order."""
    order = list(pm.PARAM_ORDER)
    indices = [i for g in saved_groups for i in g.get("params", [])]
    if saved_groups and all("param_names" in g for g in saved_groups):
        names = [n for g in saved_groups for n in g["param_names"]]
        if set(names) <= set(order):
            return dict(zip(indices, names))
    if len(saved_groups) > 1:
        live = group_fqns(pm, optimizer)
        if live is not None:        # parts of a fused parameter: its FQN once
            sources = {row.fqn: row.source for row in param_rows(pm)}
            live = [g[GROUP_FQNS] for g in as_sources([{GROUP_FQNS: f} for f in live], sources)]
        if live is None or [len(f) for f in live] != [len(g["params"]) for g in saved_groups]:
            raise CheckpointError(
                f"the optimizer state has {len(saved_groups)} parameter groups of sizes "
                f"{[len(g['params']) for g in saved_groups]} without parameter names, and this "
                f"optimizer's groups do not match them"
                f"{'' if live is None else f' (sizes {[len(f) for f in live]})'}; build the "
                "optimizer's groups as they were built when it was saved")
        return dict(zip(indices, (f for fqns in live for f in fqns)))
    return dict(enumerate(order))
