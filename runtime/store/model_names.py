"""pm's parameters and buffers under the model's own names.

The rank file registers each parameter under a local attribute name its code reads
(`self.h0_mlp_fc_weight`); what a user's code sees is the model's name, in the model's order,
as on one device and under FSDP2:

    before: pm.named_parameters() -> ("h0_ln_1_bias", ...)      `n.endswith(".bias")` misses it
    after:  pm.named_parameters() -> ("h.0.ln_1.bias", ...)     the very same Parameter

A pipeline rank lists its stages' parameters (a subset, in order); a parameter held as parts
(nanoGPT's fused q|k|v rows split by heads) is listed per part as `fqn[i/n]`; constants the
plan computes once keep their local names. The runtime's own bookkeeping keys by local name
(runtime/store/pieces.py local_named_parameters). pm registers its tensors in the model's order, so
torch's traversal of a module holding pm (AveragedModel) lists them in the same order, and a
name's path leads to the parameter by attribute from pm (torch's distributed state-dict
functions walk it), through the model's children.
"""
from __future__ import annotations

from nncompile.rows import buffer_rows, param_rows


def _names(pm) -> tuple[dict[str, str], dict[str, int]]:
    """({local name: FQN}, {FQN: its place in the model}), computed once per module."""
    cached = pm.__dict__.get("_names_as_model")
    if cached is not None:
        return cached
    rows = [*param_rows(pm), *buffer_rows(pm)]
    fqns = {row.name: row.fqn for row in rows}
    model = pm.module
    names = [n for n, _ in [*model.named_parameters(remove_duplicate=False),
                            *model.named_buffers(remove_duplicate=False)]] \
        if model is not None else [row.source for row in rows]
    order: dict[str, int] = {}
    for i, name in enumerate(names):
        order.setdefault(name, i)
    pm.__dict__["_names_as_model"] = (fqns, order)
    return fqns, order


def _place(order: dict[str, int], fqn: str) -> int:
    return order.get(fqn.split("[")[0], len(order))       # a part: its parameter's place


def as_model(pm, items, prefix: str = ""):
    """(local name, tensor) pairs as (prefix + FQN, tensor), in the model's order."""
    fqns, order = _names(pm)
    named = sorted(((fqns.get(name, name), t) for name, t in items),
                   key=lambda item: _place(order, item[0]))
    for name, t in named:
        yield prefix + name, t


def order_as_model(pm) -> None:
    """Register pm's parameters and buffers in the model's order."""
    fqns, order = _names(pm)
    for table in (pm._parameters, pm._buffers):
        items = sorted(table.items(), key=lambda kv: _place(order, fqns.get(kv[0], kv[0])))
        table.clear()
        table.update(items)


def child_of(pm, name: str):
    """The model's child `name` (AttributeError where the model has none)."""
    model = pm.__dict__.get("_original_module")
    if model is not None and name in model._modules:
        return model._modules[name]
    raise AttributeError(f"'{type(pm).__name__}' object has no attribute '{name}'")


def children(pm):
    """(name, child) of the model pm was built from (none without it), as torch's
    named_children gives them."""
    model = pm.__dict__.get("_original_module")
    if model is None:
        return iter(())
    # a child holding pm (a LightningModule whose model attribute became pm) is not one:
    # walking it would come back here
    return ((name, child) for name, child in model.named_children()
            if not any(m is pm for m in child.modules()))
