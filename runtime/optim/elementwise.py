"""Which optimizers may step pieces of tensors.

An optimizer that updates each element from its own gradient and state (SGD, Adam, AdamW, ...:
"element-wise") steps a ZeRO piece or a tensor-parallel shard exactly as it steps the whole
tensor. One that looks across elements (Adafactor's factored moments, LAMB's per-tensor norms,
Muon-style orthogonalisation, LBFGS's line search) does not: under ZeRO it is refused
(check_elementwise), and over a split parameter's plain piece too (check_pieces), where the
module's DTensor parameters give it the whole tensors' meaning instead:

    before: build_optimizer(pm, NormalizedSGD)   under tp: norms of this rank's pieces,
                                                 silently another model
    after:  ConfigError naming pm.parameters(); NormalizedSGD(pm.parameters()) steps
            DTensors and equals one device
"""
from __future__ import annotations

import torch

from nncompile.errors import ConfigError

_ELEMENTWISE: set[type] = {torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW,
                           torch.optim.Adagrad, torch.optim.RMSprop, torch.optim.Adamax,
                           torch.optim.NAdam, torch.optim.RAdam, torch.optim.ASGD,
                           torch.optim.Rprop, torch.optim.Adadelta}


def declare_elementwise(cls: type) -> type:
    """Declare that `cls` updates every element from that element's gradient and state alone
    (plus per-tensor scalars such as a step count), so ZeRO may step it on pieces of
    parameters. Usable as a class decorator."""
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise ConfigError(f"declare_elementwise needs a torch.optim.Optimizer class, got "
                          f"{cls!r}")
    _ELEMENTWISE.add(cls)
    return cls


def is_elementwise(cls: type) -> bool:
    """A declared class, or a subclass that keeps a declared class's step."""
    if cls in _ELEMENTWISE:
        return True
    return any(issubclass(cls, k) and cls.step is k.step for k in _ELEMENTWISE)


def check_elementwise(cls: type, stage: str, declared: bool | None = None) -> None:
    """Refuse an optimizer ZeRO would step on pieces of tensors unless it is element-wise."""
    if cls is torch.optim.LBFGS or (cls.__name__ == "LBFGS"):
        raise ConfigError(
            f"{cls.__name__} cannot run under {stage}: it re-evaluates the closure several "
            f"times per step and reads whole gradients (a line search over all parameters), "
            f"but under {stage} each rank steps only its pieces; train with use_zero=0 "
            f"(no optimizer sharding) for {cls.__name__}")
    if declared or is_elementwise(cls):
        return
    known = ", ".join(sorted(k.__name__ for k in _ELEMENTWISE))
    raise ConfigError(
        f"{cls.__module__}.{cls.__name__} is not known to be element-wise, and {stage} steps "
        f"each rank's contiguous piece of the flattened parameters (a 2-D weight becomes 1-D "
        f"pieces), which gives another model for an optimizer that looks across elements "
        f"(factored moments as in Adafactor, per-tensor norms as in LAMB, line searches as in "
        f"LBFGS). If every element's update depends only on that element, declare it: "
        f"nncompile.build_optimizer(pm, {cls.__name__}, ..., elementwise=True) or "
        f"nncompile.declare_elementwise({cls.__name__}); otherwise train with use_zero=0. "
        f"Known element-wise: {known}")


def check_pieces(opt, groups) -> None:
    """An optimizer that is not element-wise (Adafactor's factored moments, per-tensor norms,
    Muon-style orthogonalisation) would step this rank's piece of a split parameter as if it
    were the whole tensor: refused, naming the DTensor parameters that give it the whole
    tensor's meaning. Element-wise ones (and unsplit parameters) pass."""
    if is_elementwise(type(opt)):
        return
    _check_dtensor_safe(opt, groups)
    from nncompile.rows import param_rows
    from ..store.pieces import _LIVE
    from ..store.pieces import local_parameters

    split = {pm: {row.name for row in param_rows(pm)          # pieces of split parameters
                  if row.sharded or row.part is not None or row.name in pm.PARAM_AXES}
             for pm in list(_LIVE) if pm.zero is None}
    owners = {id(q): n for pm, names in split.items()
              for n, q in local_parameters(pm) if n in names}
    for g in groups:
        ps = g["params"]
        for p in [ps] if isinstance(ps, torch.Tensor) else ps:
            if getattr(p, "_nnc_view", False):
                continue                    # a DTensor: the whole tensor's meaning
            tag = getattr(p, "_nnc_handle", None) or getattr(p, "_nnc_origin", None)
            name = owners.get(id(p))
            if tag is not None and tag[0]() in split:
                names = tag[1] if isinstance(tag[1], tuple) else (tag[1],)
                name = next((n for n in names if n in split[tag[0]()]), None)
            if name is not None:
                raise ConfigError(
                    f"{type(opt).__name__} is not known to be element-wise, and it was given "
                    f"this rank's piece of the split parameter {name!r}: it would compute over "
                    f"the piece as if it were the whole tensor (factored moments, norms and "
                    f"matrix products over a piece differ from one device). Build it over "
                    f"pm.parameters(), which are DTensors with the whole tensor's meaning (the "
                    f"module's parameters are the same objects), or declare it element-wise "
                    f"if it is: "
                    f"nncompile.declare_elementwise({type(opt).__name__})")


# torch optimizers whose step DTensor refuses (Adafactor: an in-place pow_ of a partial norm)
_NOT_DTENSOR_SAFE = (torch.optim.Adafactor,) if hasattr(torch.optim, "Adafactor") else ()


def _check_dtensor_safe(opt, groups) -> None:
    """A clear error, before its first step, for an optimizer DTensor cannot
    run over pm's DTensor parameters (instead of DTensor's sharding-propagation error)."""
    if not isinstance(opt, _NOT_DTENSOR_SAFE):
        return
    for g in groups:
        ps = g["params"]
        if any(getattr(p, "_nnc_view", False) for p in ([ps] if isinstance(ps, torch.Tensor)
                                                        else ps)):
            name = type(opt).__name__
            raise ConfigError(
                f"torch.optim.{name} cannot step DTensor parameters (its step takes an "
                f"in-place power of a norm that DTensor keeps partial, which DTensor refuses), "
                f"and under this plan pm.parameters() are DTensors split across ranks, where "
                f"{name}'s factored moments must see the whole tensors. Use {name} with a plan "
                f"that keeps parameters whole (dp, ZeRO-1/2), or an element-wise optimizer "
                f"such as torch.optim.AdamW")


__all__ = ["declare_elementwise", "is_elementwise", "check_elementwise", "check_pieces"]
