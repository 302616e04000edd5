"""Buffer values for a model built on `meta`: parameters can wait for load_pretrained, but the
generated module computes its constants (rotary tables, masks) from the buffers when it is
built, so those need values then.

    before: model.model.rotary_emb.inv_freq  meta[64]     (with torch.device("meta"): ...)
    after:  the values transformers gives it when from_pretrained loads on meta (the model's
            own _init_weights on the buffer's module), computed on a copy of that module

A Hugging Face model's buffers are recomputed so (where its _init_weights gives them values);
any other meta buffer is an error that says how to build the model with real buffers.
"""
from __future__ import annotations

import copy

import torch

from nncompile.errors import ConfigError
from nncompile.pretrained_layout import find_pretrained


def with_real_buffers(module: torch.nn.Module | None, state: dict[str, torch.Tensor],
                      fqns: list[str]) -> dict[str, torch.Tensor]:
    """`state` with each buffer of `fqns` that is on meta replaced by its value."""
    meta = [f for f in fqns if f in state and state[f].is_meta]
    if not meta:
        return state
    found = find_pretrained(module)
    out = dict(state)
    done: dict[str, torch.nn.Module] = {}
    for fqn in meta:
        owner, _, name = fqn.rpartition(".")
        prefix, model = found if found is not None else ("", None)
        if model is not None and owner.startswith(prefix.rstrip(".")) and owner not in done:
            sub = copy.deepcopy(module.get_submodule(owner))
            sub.to_empty(device="cpu", recurse=False)
            for b in sub.buffers(recurse=False):
                if b.is_floating_point():
                    b.fill_(float("nan"))        # what _init_weights leaves alone stays NaN
            model._init_weights(sub)
            done[owner] = sub
        value = getattr(done[owner], name, None) if owner in done else None
        if value is None or value.is_meta or not value.is_floating_point() or \
                bool(value.isnan().any()):
            raise ConfigError(
                f"buffer {fqn!r} is on meta, and nncompile computes the generated module's "
                f"constants from buffer values when it builds it; build the model with real "
                f"buffers (parameters on meta only: accelerate's "
                f"init_empty_weights(include_buffers=False)), or give the buffer its value "
                f"before parallelize")
        out[fqn] = value
    return out
