"""build_optimizer: ZeRO stages 1-3 and optimizer offload.

Without ZeRO or offload this is just `optimizer_cls(pm.parameters(), **kwargs)`: the reducer
has already averaged the gradients, so every replica takes the same step.

With ZeRO, the ranks holding the same parameter shard (the data-parallel group, or one of
`zero_ngroups` slices of it) split the flattened parameters into equal contiguous pieces; each
rank keeps optimizer state for its piece only and steps it:

    stage 1: rank k of Z: state for elements [k*P/Z, (k+1)*P/Z); after the step the pieces
             are all-gathered back into the parameters (every rank holds all P)
    stage 2: as 1, and the reduced gradient is kept only as that piece (the reducer hands each
             bucket over and frees it): .grad of the parameters is None after backward
    stage 3: the parameters themselves are the pieces (runtime/zero.py): the optimizer steps
             pm.parameters() in place, nothing is gathered after the step

With offload_optimizer the pieces, their gradients and the optimizer state live in host memory
(pinned on CUDA): gradients are copied to the host, the step runs there, the updated piece is
copied back. Without a GPU the host is the CPU the model runs on and the same code runs.

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
from .rows import param_rows
from .zero import FlatLayout, gather_piece

ELEMENTWISE = ("SGD", "Adam", "AdamW", "Adamax", "Adagrad", "RMSprop", "NAdam", "RAdam",
               "ASGD", "Rprop", "Adadelta")


def build_optimizer(pm, optimizer_cls: type, **kwargs: Any) -> torch.optim.Optimizer:
    """The optimizer for a ParallelModule as its ZeRO stage and offload say (pm.memory): a
    plain one without either, else a ZeroOptimizer."""
    if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
        raise ConfigError(f"build_optimizer needs a torch.optim.Optimizer class such as "
                          f"torch.optim.AdamW, got {optimizer_cls!r}")
    params = [p for p in pm.parameters() if p.requires_grad]
    memory = pm.memory
    if memory.zero == 0 and not memory.offload_optimizer:
        return optimizer_cls(params, **kwargs)
    if memory.zero == 3 and not memory.offload_optimizer:
        return ZeroOptimizer(pm, optimizer_cls, **kwargs)
    if optimizer_cls.__name__ not in ELEMENTWISE:
        warnings.warn(f"ZeRO and offload slice parameters element-wise; "
                      f"{optimizer_cls.__name__} must update each element independently of the "
                      f"others for this to be exact (known to be: {', '.join(ELEMENTWISE)})",
                      stacklevel=2)
    return ZeroOptimizer(pm, optimizer_cls, **kwargs)


class _Shard:
    """The optimizer's view of one flat piece: its layout, the parameters it is cut from
    (stages 0-2) or the flat parameter it is (stage 3), and the tensor the optimizer steps."""

    def __init__(self, layout: FlatLayout, params: list, sharded: bool, flat=None, host=None):
        self.layout, self.params, self.sharded, self.flat = layout, params, sharded, flat
        if flat is not None:          # ZeRO-3: step the module's own piece (or a host copy)
            self.param = flat if host is None or flat.device == host else \
                torch.nn.Parameter(_to_host(flat.detach(), host))
        else:
            piece = layout.owned([p.detach() for p in params])
            self.param = torch.nn.Parameter(_to_host(piece, host) if host is not None
                                            else piece.clone())
        self.grad: torch.Tensor | None = None       # ZeRO-2: the reduced gradient's piece

    @property
    def names(self):
        return self.layout.names


def _to_host(t: torch.Tensor, host: torch.device) -> torch.Tensor:
    out = t.to(host, copy=True)
    if host.type == "cpu" and torch.cuda.is_available():
        out = out.pin_memory()
    return out


class ZeroOptimizer(torch.optim.Optimizer):
    """ZeRO stage 1-3 and/or offload around `optimizer_cls`; use it like the optimizer it
    wraps (param_groups is the inner optimizer's, so LR schedulers work)."""

    def __init__(self, pm, optimizer_cls: type, **kwargs: Any):
        cfg, memory = pm.compute_config, pm.memory
        self.pm, self.stage = pm, memory.zero
        if memory.zero == 0:
            self.group, self.ranks = None, [dist.get_rank() if dist.is_initialized() else 0]
        else:
            self.group, self.ranks = get_zero_group(pm.PLAN_NGPUS, pm.RUNTIME_NGPUS,
                                                    cfg.zero_ngroups, pm.PIPE_RANKS)
        self.zero_rank = self.ranks.index(dist.get_rank()) if dist.is_initialized() else 0
        self.zero_size = len(self.ranks)
        self.host = torch.device("cpu") if memory.offload_optimizer else None
        if pm.zero is not None:
            rows = {row.name: row for row in param_rows(pm)}
            self.shards = [_Shard(u.layout, [], rows[u.layout.names[0]].sharded,
                                  flat=getattr(pm, u.attr), host=self.host)
                           for u in pm.zero.units if u.trainable]
        else:
            groups: dict[tuple, tuple[list, list]] = {}
            for row in param_rows(pm):
                p = getattr(pm, row.name)
                if p.requires_grad:
                    names, ps = groups.setdefault((p.dtype, row.sharded), ([], []))
                    names.append(row.name)
                    ps.append(p)
            self.shards = [_Shard(FlatLayout(names, [p.shape for p in ps], self.zero_rank,
                                             self.zero_size), ps, sharded, host=self.host)
                           for (_, sharded), (names, ps) in groups.items()]
        self.inner = optimizer_cls([s.param for s in self.shards], **kwargs)
        super().__init__([s.param for s in self.shards], self.inner.defaults)
        self.param_groups = self.inner.param_groups
        self.state = self.inner.state
        self._where = {id(p): (s, i) for s in self.shards for i, p in enumerate(s.params)}
        if self.stage == 2 and pm._reducer is not None:
            pm._reducer.sink = self.take_grads
            pm._grad_shards = self

    # ---- ZeRO-2: the reducer hands over each reduced bucket -----------------------------------
    @torch.no_grad()
    def take_grads(self, params: list, views: list) -> None:
        """Add this rank's piece of each reduced gradient to the shards' gradient pieces."""
        for p, view in zip(params, views):
            s, i = self._where[id(p)]
            if s.grad is None:
                s.grad = torch.zeros(s.layout.hi - s.layout.lo, dtype=s.param.dtype,
                                     device=view.device)
            offset = sum(s.layout.numels[:i])
            a, b = max(s.layout.lo, offset), min(s.layout.hi, offset + view.numel())
            if a < b:
                s.grad[a - s.layout.lo:b - s.layout.lo] += \
                    view.reshape(-1)[a - offset:b - offset].to(s.grad.dtype)

    def local_grads(self) -> dict[str, torch.Tensor]:
        """ZeRO-2: every local gradient, gathered from the pieces (a collective), plus any a
        reducer did not take (parameters with nothing to reduce)."""
        out = {}
        for s in self.shards:
            g = s.grad if s.grad is not None else torch.zeros(s.layout.hi - s.layout.lo,
                                                               dtype=s.param.dtype,
                                                               device=self.pm.device)
            for name, p, t in zip(s.names, s.params, s.layout.unflatten(self._gather_layout(s.layout, g))):
                out[name] = t.clone() if p.grad is None else t + p.grad.detach()
        for row in param_rows(self.pm):
            out.setdefault(row.name, None)
        return out

    def grad_pieces(self):
        """(gradient piece, sharded over the plan unit) for clipping (ZeRO-2)."""
        for s in self.shards:
            if s.grad is not None:
                yield s.grad, s.sharded

    # ---- the step -------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for s in self.shards:
            if s.flat is not None:                     # ZeRO-3: the piece is the parameter
                if s.param is not s.flat:
                    s.param.copy_(s.flat.detach())
                    s.param.grad = None if s.flat.grad is None else \
                        s.flat.grad.to(s.param.device, s.param.dtype)
                continue
            s.param.copy_(s.layout.owned([p.detach() for p in s.params]))  # pm's weights rule
            grad = s.layout.owned([p.grad if p.grad is not None else torch.zeros_like(p)
                                   for p in s.params])
            if s.grad is not None:               # ZeRO-2: what the reducer handed over
                grad = grad + s.grad.to(grad.device)
            s.param.grad = grad.to(s.param.device, s.param.dtype)
        self.inner.step()
        for s in self.shards:
            if s.flat is not None:
                if s.param is not s.flat:
                    s.flat.copy_(s.param.detach().to(s.flat.device, non_blocking=True))
                    s.param.grad = None
                continue
            s.param.grad = None
            local = s.param.detach().to(s.params[0].device, non_blocking=True)
            full = self._gather_layout(s.layout, local)
            for p, value in zip(s.params, s.layout.unflatten(full)):
                p.copy_(value)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.pm.zero_grad(set_to_none=set_to_none)
        for s in self.shards:
            s.param.grad = None
            s.grad = None

    # ---- state --------------------------------------------------------------------------
    def layout(self) -> dict:
        return {"zero_rank": self.zero_rank, "zero_size": self.zero_size, "ranks": self.ranks,
                "shards": [{"names": s.names, "numels": s.layout.numels, "lo": s.layout.lo,
                            "hi": s.layout.hi} for s in self.shards]}

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
        self.param_groups = self.inner.param_groups    # torch replaced both: keep LR
        self.state = self.inner.state                  # schedulers writing into the live ones

    def local_state(self) -> dict[str, dict[str, Any]]:
        """Full optimizer state of this rank's local parameters, by local name (gathered over
        the ZeRO group: a collective)."""
        return flat_state_by_name(self.inner.state, [(s.param, s.layout) for s in self.shards],
                                  self._gather_layout)

    def _gather_layout(self, layout: FlatLayout, v: torch.Tensor) -> torch.Tensor:
        return gather_piece(layout, v, self.zero_size, self.group, self.pm.device)

    def load_local_state(self, state: dict[str, dict[str, Any]]) -> None:
        """Inverse of local_state: keep this rank's slice of each full local state tensor."""
        for s in self.shards:
            new = flat_state_piece(state, s.layout, s.param)
            if new:
                self.inner.state[s.param] = new


def flat_state_by_name(opt_state: dict, flats: list, gather) -> dict[str, dict[str, Any]]:
    """Optimizer state of flat pieces -> {local name: {key: full local tensor or scalar}};
    `flats` is [(the stepped tensor, its FlatLayout)], `gather(layout, piece)` the full flat
    vector of a state piece (a collective)."""
    out: dict[str, dict[str, Any]] = {}
    for param, layout in flats:
        st = opt_state.get(param, {})
        for key in sorted(st):
            v = st[key]
            if isinstance(v, torch.Tensor) and v.numel() == param.numel() and v.dim() == 1:
                for name, piece in zip(layout.names, layout.unflatten(gather(layout, v))):
                    out.setdefault(name, {})[key] = piece.clone()
            else:
                for name in layout.names:
                    out.setdefault(name, {})[key] = v.clone() if torch.is_tensor(v) else v
    return out


def flat_state_piece(state: dict[str, dict[str, Any]], layout: FlatLayout,
                     param: torch.Tensor) -> dict[str, Any]:
    """This rank's piece of full local optimizer state tensors (inverse of
    flat_state_by_name for one flat), shaped like `param`."""
    per_param = [state.get(n, {}) for n in layout.names]
    keys = set().union(*[set(st) for st in per_param]) if per_param else set()
    new = {}
    for key in sorted(keys):
        vals = [st.get(key) for st in per_param]
        if all(torch.is_tensor(v) and tuple(v.shape) == shape
               for v, shape in zip(vals, layout.shapes)):
            piece = layout.owned([v.to(param.device) for v in vals])
            if piece.numel() != param.numel():
                piece = layout.padded(piece)
            new[key] = piece.clone()
        else:
            v = vals[0]
            new[key] = v.clone() if torch.is_tensor(v) else v
    return new
