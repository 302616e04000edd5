"""pm.state_dict() and pm.load_state_dict() in the model's form: its names, its tensors.

A DDP or FSDP2 script saves and loads the model through the wrapper (`model.state_dict()`,
torch's `get_model_state_dict(model)` / `set_model_state_dict`, `dcp.save`). pm answers as
FSDP2 does: every key is the model's own name (FQN), in the model's order, and a tensor the
plan splits is a DTensor over this rank's piece (pm's own parameter object where it is one),
so DCP stores each piece once under one name and any plan reads it:

    before: pm.state_dict() -> {"h0_mlp_fc_weight": [64, 32], ..., "_extra_state": plan}
            dcp.save of it under tp 2: both ranks' pieces under one name, rank 0's kept
    after:  pm.state_dict() -> {"h.0.mlp_fc.weight": DTensor [128, 32] (R, S(0)), ...}

A plan that splits nothing (dp, ZeRO-1/2) gives plain tensors, pm's own. Where no DTensor is
pm's parameter (a weight held as q|k|v parts, a ZeRO-3 handle) the value is built: the parts
assembled whole (a collective over the plan unit), a ZeRO-3 shard gathered (over its group).
A pipeline rank gives its stages' entries. nncompile's own per-rank form, by the rank file's
names with the plan under `_extra_state`, is `pm.local_state_dict()`; `pm.load_state_dict`
takes either.
"""
from __future__ import annotations

from collections import OrderedDict

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from nncompile import compat
from nncompile.rows import ParamRow, state_rows, take

from ..store import model_names


def _split(pm) -> bool:
    """Whether the plan splits a tensor over ranks (its state is DTensors)."""
    return dist.is_initialized() and (
        pm.zero is not None or pm.PLAN_NGPUS > 1 or
        any(isinstance(p, DTensor) for p in pm._parameters.values()))


def _aliases(pm) -> dict[str, str]:
    """{another name of a tied tensor: its first name} in the model."""
    model = pm.module
    if model is None:
        return {}
    first: dict[int, str] = {}
    out = {}
    for fqn, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            out[fqn] = first[id(p)]
        else:
            first[id(p)] = fqn
    return out


def _key(row) -> str:
    """The model's name of what `row` holds (a part: the parameter it is a part of)."""
    return row.fqn if getattr(row, "part", None) is None else row.source


def model_state(pm, prefix: str = "", keep_vars: bool = False,
                destination: dict | None = None) -> dict:
    """pm's state under the model's names (see the module docstring)."""
    from ..store.dtensors import _dtensor
    from .dcp import _model_state
    split = _split(pm)
    live = dict(pm.named_parameters())
    built = None
    out: dict = {}
    for row in state_rows(pm):
        key = _key(row)
        if key in out:
            continue
        t = live.get(key) if isinstance(row, ParamRow) else getattr(pm, row.name)
        if t is None or t.is_meta or getattr(row, "part", None) is not None:
            if built is None:                     # parts whole, ZeRO-3 shards gathered
                built = _model_state(pm) if dist.is_initialized() else pm.local_tensors()
            t = built[key] if dist.is_initialized() else built[row.name]
            if dist.is_initialized() and not split:
                t = t.full_tensor()
        elif split and not isinstance(t, DTensor):
            t = _dtensor(pm, t if keep_vars else t.detach(), row)
        out[key] = t if keep_vars else t.detach()
    for other, fqn in _aliases(pm).items():
        if fqn in out:
            out[other] = out[fqn]
    _, order = model_names._names(pm)
    dest = OrderedDict() if destination is None else destination
    for key in sorted(out, key=lambda k: order.get(k, len(order))):
        dest[prefix + key] = out[key]
    return dest


@torch.no_grad()
def load_model_state(pm, state: dict, strict: bool = True):
    """Copy a state in the model's form (values DTensors of any plan, or full tensors) into
    pm's tensors; missing and unexpected keys as nn.Module.load_state_dict reports them."""
    from ..store.dtensors import _mesh
    expected: dict[str, list] = {}
    for row in state_rows(pm):
        expected.setdefault(_key(row), []).append(row)
    aliases = {other: fqn for other, fqn in _aliases(pm).items() if fqn in expected}
    for other in aliases:
        expected.setdefault(other, [])     # a tied name: loaded through its first
    mesh = _mesh(pm) if _split(pm) else None
    local: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        rows = expected.get(key)
        if not rows:
            continue
        for row in rows:
            if isinstance(value, DTensor) and value.device_mesh == mesh and \
                    getattr(row, "part", None) is None and \
                    tuple(value.to_local().shape) == tuple(row.local_shape):
                local[row.name] = value.to_local()        # this rank's piece, as saved
            else:
                full = value.full_tensor() if isinstance(value, DTensor) else value
                local[row.name] = take(row, full.to(pm.device))
    pm.load_local_tensors(local)
    missing = [k for k in expected if k not in state and aliases.get(k) not in state]
    unexpected = [k for k in state if k not in expected and k != "_extra_state"]
    if strict and (missing or unexpected):
        raise RuntimeError(f"Error(s) in loading state_dict for {type(pm).__name__}: "
                           f"missing keys {missing[:5]}, unexpected keys {unexpected[:5]} "
                           "(pm.state_dict() holds the model's names; nncompile's per-rank "
                           "form is pm.local_state_dict())")
    return compat.incompatible_keys(missing, unexpected)


__all__ = ["model_state", "load_model_state"]
