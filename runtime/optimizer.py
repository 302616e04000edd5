"""build_optimizer and ZeRO stage 1: optimizer state sharded over data-parallel ranks.

Without `use_zero` this is just `optimizer_cls(pm.parameters(), **kwargs)`: the reducer has
already averaged the gradients, so every replica takes the same step.

With `use_zero`, the ranks holding the same parameter shard (the data-parallel group, or one of
`zero_ngroups` slices of it) split the flattened parameters into equal contiguous pieces; each
rank keeps optimizer state for its piece only and steps it, then the pieces are all-gathered
back into the parameters:

    before: rank k of Z: AdamW state for all P local elements            (2P floats)
    after:  rank k of Z: state for elements [k*P/Z, (k+1)*P/Z)  + all-gather of P after step

Slicing elements across tensor boundaries is exact for element-wise optimizers (SGD, Adam,
AdamW, Adagrad, RMSprop, ...); the step reads `.grad` of the module's parameters, so gradient
clipping and loading weights into `pm` between steps need no extra call.
"""
from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist

from nncompile.errors import CheckpointError, ConfigError

from .groups import get_zero_group

ELEMENTWISE = ("SGD", "Adam", "AdamW", "Adamax", "Adagrad", "RMSprop", "NAdam", "RAdam",
               "ASGD", "Rprop", "Adadelta")


def build_optimizer(pm, optimizer_cls: type, **kwargs: Any) -> torch.optim.Optimizer:
    """The optimizer for a ParallelModule: ZeRO-1 when its ComputeConfig has use_zero=True
    (and there is more than one data-parallel rank to shard over), else a plain one."""
    if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
        raise ConfigError(f"build_optimizer needs a torch.optim.Optimizer class such as "
                          f"torch.optim.AdamW, got {optimizer_cls!r}")
    params = [p for p in pm.parameters() if p.requires_grad]
    cfg = pm.compute_config
    if not cfg.use_zero:
        return optimizer_cls(params, **kwargs)
    if optimizer_cls.__name__ not in ELEMENTWISE:
        warnings.warn(f"use_zero slices parameters element-wise; {optimizer_cls.__name__} must "
                      f"update each element independently of the others for this to be exact "
                      f"(known to be: {', '.join(ELEMENTWISE)})", stacklevel=2)
    return ZeroOptimizer(pm, optimizer_cls, **kwargs)


class _FlatShard:
    """The parameters of one dtype, flattened; this rank owns [lo, hi) of the flat vector."""

    def __init__(self, params: list, names: list[str], rank: int, size: int):
        self.params, self.names = params, names
        self.numels = [p.numel() for p in params]
        self.total = sum(self.numels)
        self.chunk = -(-self.total // size)
        self.lo = min(rank * self.chunk, self.total)
        self.hi = min(self.lo + self.chunk, self.total)
        self.param = torch.nn.Parameter(self.owned([p.detach() for p in params]))

    def owned(self, tensors: list) -> torch.Tensor:
        """Elements [lo, hi) of the flattened `tensors` (shaped like the parameters), copying
        only the tensors that overlap them."""
        pieces, offset = [], 0
        for t, n in zip(tensors, self.numels):
            a, b = max(self.lo, offset), min(self.hi, offset + n)
            if a < b:
                pieces.append(t.reshape(-1)[a - offset:b - offset])
            offset += n
        if not pieces:
            return self.params[0].new_zeros(0)
        return torch.cat(pieces)

    def padded(self, local: torch.Tensor) -> torch.Tensor:
        out = local.new_zeros(self.chunk)
        out[:local.numel()] = local
        return out

    def unflatten(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [t.view_as(p) for t, p in zip(flat[:self.total].split(self.numels), self.params)]


class ZeroOptimizer(torch.optim.Optimizer):
    """ZeRO-1 around `optimizer_cls`; use it like the optimizer it wraps (param_groups is the
    inner optimizer's, so LR schedulers work)."""

    def __init__(self, pm, optimizer_cls: type, **kwargs: Any):
        cfg = pm.compute_config
        self.pm = pm
        self.group, self.ranks = get_zero_group(pm.PLAN_NGPUS, pm.RUNTIME_NGPUS,
                                                cfg.zero_ngroups)
        self.zero_rank = self.ranks.index(dist.get_rank()) if dist.is_initialized() else 0
        self.zero_size = len(self.ranks)
        by_dtype: dict[torch.dtype, tuple[list, list]] = {}
        for name, p in pm.named_parameters():
            if p.requires_grad:
                by_dtype.setdefault(p.dtype, ([], []))
                by_dtype[p.dtype][0].append(p)
                by_dtype[p.dtype][1].append(name)
        self.shards = [_FlatShard(ps, names, self.zero_rank, self.zero_size)
                       for ps, names in by_dtype.values()]
        self.inner = optimizer_cls([s.param for s in self.shards], **kwargs)
        super().__init__([s.param for s in self.shards], self.inner.defaults)
        self.param_groups = self.inner.param_groups
        self.state = self.inner.state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for s in self.shards:
            s.param.copy_(s.owned([p.detach() for p in s.params]))  # pm's weights rule
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in s.params]
            s.param.grad = s.owned(grads).to(s.param.dtype)
        self.inner.step()
        for s in self.shards:
            s.param.grad = None
            full = self._gather(s, s.param.detach())
            for p, value in zip(s.params, s.unflatten(full)):
                p.copy_(value)
        return loss

    def _gather(self, s: _FlatShard, local: torch.Tensor) -> torch.Tensor:
        if self.group is None:
            return local
        parts = [torch.empty(s.chunk, dtype=local.dtype, device=local.device)
                 for _ in range(self.zero_size)]
        dist.all_gather(parts, s.padded(local).contiguous(), group=self.group)
        return torch.cat(parts)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.pm.zero_grad(set_to_none=set_to_none)
        for s in self.shards:
            s.param.grad = None

    # ---- state --------------------------------------------------------------------------
    def layout(self) -> dict:
        return {"zero_rank": self.zero_rank, "zero_size": self.zero_size, "ranks": self.ranks,
                "shards": [{"names": s.names, "numels": s.numels, "lo": s.lo, "hi": s.hi}
                           for s in self.shards]}

    def state_dict(self) -> dict:
        """This rank's piece of the optimizer state, with the layout it was cut by."""
        return {**self.inner.state_dict(), "nncompile_zero": self.layout()}

    def load_state_dict(self, state_dict: dict) -> None:
        saved = state_dict.get("nncompile_zero")
        if saved != self.layout():
            raise CheckpointError(
                "this ZeRO optimizer state was cut for another layout "
                f"(zero rank/size {saved and (saved['zero_rank'], saved['zero_size'])} vs "
                f"{(self.zero_rank, self.zero_size)}, or other parameters); load a deduped, "
                "merged or dcp checkpoint instead (nncompile.load_checkpoint)")
        self.inner.load_state_dict({k: v for k, v in state_dict.items()
                                    if k != "nncompile_zero"})

    def local_state(self) -> dict[str, dict[str, Any]]:
        """Full optimizer state of this rank's local parameters, by local name (gathered over
        the ZeRO group: a collective)."""
        out: dict[str, dict[str, Any]] = {}
        for s in self.shards:
            st = self.inner.state.get(s.param, {})
            for key in sorted(st):
                v = st[key]
                if isinstance(v, torch.Tensor) and v.numel() == s.param.numel() and v.dim() == 1:
                    for name, piece in zip(s.names, s.unflatten(self._gather(s, v))):
                        out.setdefault(name, {})[key] = piece.clone()
                else:
                    for name in s.names:
                        out.setdefault(name, {})[key] = v.clone() if torch.is_tensor(v) else v
        return out

    def load_local_state(self, state: dict[str, dict[str, Any]]) -> None:
        """Inverse of local_state: keep this rank's slice of each full local state tensor."""
        for s in self.shards:
            per_param = [state.get(n, {}) for n in s.names]
            keys = set().union(*[set(st) for st in per_param]) if per_param else set()
            if not keys:
                continue
            new = {}
            for key in sorted(keys):
                vals = [st.get(key) for st in per_param]
                if all(torch.is_tensor(v) and v.shape == p.shape
                       for v, p in zip(vals, s.params)):
                    new[key] = s.owned([v.to(s.param.device) for v in vals]).clone()
                else:
                    v = vals[0]
                    new[key] = v.clone() if torch.is_tensor(v) else v
            self.inner.state[s.param] = new
