"""The state of an optimizer handed to `build_optimizer(pm, optimizer)`, carried over.

nanoGPT's resume loads the optimizer state into the optimizer `configure_optimizers` built
from the model, then wraps the model. `build_optimizer(pm, that_optimizer)` rebuilds the
optimizer on pm's parameters; its state comes along where that is exact: per parameter, every
state tensor shaped like the parameter it was kept for (Adam's moments, SGD's momentum) is cut
to this rank's slice (tp) and, under ZeRO, to this rank's run of it; scalars (`step`) are
copied. Other tensors (factored moments as in Adafactor) are carried only where the parameter
stays whole and unsplit, else refused with the fix:

    before: opt.load_state_dict(ckpt["optimizer"]); build_optimizer(pm, opt)  # state dropped
    after:  the same calls                            # moments and step carried, tp/ZeRO cut
"""
from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from nncompile.errors import ConfigError

from ..store.segments import local_names
from ..store.pieces import local_parameters
from nncompile.rows import param_rows, take


def _refuse(what: str) -> ConfigError:
    return ConfigError(
        f"build_optimizer cannot carry this optimizer's state over exactly: {what}; build the "
        f"optimizer first and load the state after build_optimizer (optimizer.load_state_dict "
        f"on the optimizer it returns where the parameters stay whole, or "
        f"nncompile.load_checkpoint(dir, pm, optimizer) for a checkpoint nncompile saved)")


def carried_state(pm, inst: torch.optim.Optimizer, pieces: bool) -> dict[str, dict[str, Any]]:
    """{local name: {key: value}} of `inst`'s state for pm's parameters, each tensor as the
    whole local parameter (this rank's tp slice); `pieces`: the new optimizer steps pieces of
    parameters (ZeRO, offload), which only parameter-shaped tensors can be cut into."""
    rows = {row.name: row for row in param_rows(pm)}
    out: dict[str, dict[str, Any]] = {}
    for g in inst.param_groups:
        for p in g["params"]:
            st = inst.state.get(p)
            if not st:
                continue
            for name in local_names(pm, p):   # an original held as parts: each part
                if name not in rows:
                    continue                 # a parameter this rank does not hold
                if getattr(p, "_nnc_span", None) is not None:
                    raise _refuse(f"the state of {name!r} was kept for a ZeRO-3 piece")
                shape = tuple(p.shape)
                if isinstance(p, DTensor) and pm.zero is None:   # pm's DTensor view: its
                    shape = tuple(p.to_local().shape)           # state as this rank's piece's
                    st = {k: v.to_local() if isinstance(v, DTensor) else v
                          for k, v in st.items()}
                out[name] = _cut(rows[name], shape, st, pieces)
    return out


def _cut(row, shape: tuple, st: dict[str, Any], pieces: bool) -> dict[str, Any]:
    """One parameter's state kept for a tensor of `shape` (pm's local one, or the original's
    full one) as the state of this rank's local tensor of `row`."""
    local = tuple(row.local_shape)
    whole = local == tuple(row.shape) and row.part is None
    new: dict[str, Any] = {}
    for k, v in st.items():
        if not torch.is_tensor(v) or v.dim() == 0:
            new[k] = v.clone() if torch.is_tensor(v) else v
        elif tuple(v.shape) == shape and (shape == local or shape == row.source_shape):
            if shape != local or row.part is not None:  # the original's full tensor: the slice
                v = take(row, v) if shape == row.source_shape else v
            new[k] = v.detach().clone()
        elif whole and not pieces:
            new[k] = v.detach().clone()  # the parameter is whole: exact as it is
        else:
            raise _refuse(f"its state {k!r} of {row.source!r} has shape "
                          f"{list(v.shape)}, not the parameter's {list(shape)}, and "
                          f"this plan steps a part of that parameter")
    return new


def carry(pm, inst: torch.optim.Optimizer, opt: torch.optim.Optimizer) -> None:
    """Put `inst`'s state into `opt`, the optimizer build_optimizer made from it for pm."""
    if not any(inst.state.get(p) for g in inst.param_groups for p in g["params"]):
        return
    if hasattr(opt, "load_local_state"):             # a ZeroOptimizer: each rank's runs
        opt.load_local_state(carried_state(pm, inst, pieces=True))
        return
    by_name = dict(local_parameters(pm))
    for name, st in carried_state(pm, inst, pieces=False).items():
        p = by_name[name]
        opt.state[p] = {k: v.to(p.device) if torch.is_tensor(v) and v.dim() else v
                        for k, v in st.items()}


def adopted_state(p, new: torch.Tensor, st: dict[str, Any], name: str | None = None
                  ) -> dict[str, Any]:
    """The state an optimizer kept for `p` (the original module's parameter, or a handle) as
    the state of `new` (local name `name`), what pm steps instead (its tp shard, a part of
    it, or a ZeRO-3 segment): tensors shaped like `p` are cut to this rank's slice and run;
    others are refused."""
    tag = getattr(p, "_nnc_origin", None) or getattr(p, "_nnc_handle", None)
    pm = tag[0]() if tag is not None else None
    name = name if name is not None else (tag[1] if tag is not None else None)
    row = next((r for r in param_rows(pm) if r.name == name), None) if pm is not None else None
    parts = row is not None and row.part is not None
    span = getattr(new, "_nnc_span", None)
    out: dict[str, Any] = {}
    for k, v in st.items():
        if not torch.is_tensor(v) or v.dim() == 0 or (v.shape == new.shape and not parts):
            out[k] = v.clone() if parts and torch.is_tensor(v) else v   # one step per part
        elif row is not None and tuple(v.shape) == tuple(p.shape):
            if parts:
                v = take(row, v)                                    # this rank's part
            elif tuple(p.shape) == tuple(row.shape) and row.local_shape != tuple(row.shape):
                v = v[tuple(slice(a, b) for a, b in row.slices)]   # this rank's tp slice
            if span is not None:
                v = v.reshape(-1)[span[1]:span[2]]                  # this rank's ZeRO-3 run
            out[k] = v.detach().to(new.device).clone()
        else:
            raise _refuse(f"its state {k!r} of {row.fqn if row else 'a parameter'!r} has "
                          f"shape {list(v.shape)}, not the parameter's {list(p.shape)}, and "
                          f"this plan steps a part of that parameter")
    return out
