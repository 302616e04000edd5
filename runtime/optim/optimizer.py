"""build_optimizer: ZeRO stages 1-3 and optimizer offload.

Without ZeRO or offload this is `optimizer_cls(params, **kwargs)` over this rank's tensors:
the reducer has already averaged the gradients, so every replica takes the same step. Where
pm's parameters are DTensor views of the pieces it computes with (tp), a PieceOptimizer holds
those DTensors in its param_groups and steps the pieces under them with that optimizer.

With ZeRO, the ranks holding the same parameter shard (the data-parallel group, or one of
`zero_ngroups` slices of it) split the flattened parameters into equal contiguous pieces; each
rank keeps optimizer state for its piece only and steps it:

    stage 1: rank k of Z: state for elements [k*P/Z, (k+1)*P/Z); after the step the pieces
             are all-gathered back into the parameters (every rank holds all P)
    stage 2: as 1, and the reduced gradient is kept only as that piece (the reducer hands each
             bucket over and frees it): .grad of the parameters is None after backward
    stage 3: the parameters themselves are the pieces (runtime/store/zero.py): the optimizer steps
             them in place, nothing is gathered after the step

With offload_optimizer the pieces, their gradients and the optimizer state live in host memory
(pinned on CUDA): gradients are copied to the host, the step runs there, the updated piece is
copied back. Without a GPU the host is the CPU the model runs on and the same code runs.

The inner optimizer steps one segment per local parameter: the run of the piece holding that
parameter's elements (runtime/store/segments.py), in the group the user put the parameter in,
so groups keep their own hyper-parameters at every stage:

    before: AdamW([piece of every parameter], weight_decay=?)     one group, hyper-parameters lost
    after:  AdamW([{"params": [h0_attn_q_proj_weight's run, ...], "weight_decay": 0.1},
                   {"params": [h0_ln_1_bias's run, ...], "weight_decay": 0.0}])

Slicing elements is exact only for element-wise optimizers: the known ones and those declared
with `declare_elementwise`; others are refused (elementwise.check_elementwise). A parameter
whose gradient no rank computed has no segment gradient and is not stepped. The step reads
`.grad` of the module's parameters, so gradient clipping and loading weights into `pm` between
steps need no extra call.
"""
from __future__ import annotations

import contextlib
import inspect
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from nncompile.errors import CheckpointError, ConfigError
from nncompile.log import log

from .carry_state import carry
from ..protocol.groups import get_zero_group
from ..store.pieces import local_named_parameters, local_parameters
from nncompile.rows import param_rows
from .elementwise import check_elementwise, check_pieces, declare_elementwise
from ..store.segments import cut, segment_layout, segment_params, zero3_segments, zero_stage
from .adoption import groups_by_name, watch_segments
from ..store.layouts import FlatLayout
from ..store.zero import copy_to_host, gather_piece, offload_copy
import weakref

ELEMENTWISE = ("SGD", "Adam", "AdamW", "Adamax", "Adagrad", "RMSprop", "NAdam", "RAdam",
               "ASGD", "Rprop", "Adadelta")        # declared in elementwise._ELEMENTWISE


def build_optimizer(pm, optimizer_cls, params=None, *, elementwise: bool | None = None,
                    **kwargs: Any) -> torch.optim.Optimizer:
    """The optimizer for a ParallelModule as its ZeRO stage and offload say (pm.memory): a
    plain one without either, else a ZeroOptimizer.

    Takes the optimizer's own arguments: `params` is None (every trainable parameter) or what
    the optimizer accepts, an iterable of parameters or of group dicts with their own
    hyper-parameters, taken from pm.named_parameters() or from the module pm was built from.
    `optimizer_cls` may also be an optimizer instance: its class, groups, defaults and state
    are rebuilt on pm (runtime/optim/carry_state.py; state it cannot cut exactly is refused).
    `elementwise=True` declares an optimizer outside the known list element-wise, which ZeRO
    and offload need (they step pieces of tensors)."""
    inst = None
    if isinstance(optimizer_cls, torch.optim.Optimizer):
        if isinstance(optimizer_cls, (ZeroOptimizer, PieceOptimizer)):
            raise ConfigError(f"build_optimizer got a {type(optimizer_cls).__name__}; it is "
                              "built already")
        inst = optimizer_cls
        optimizer_cls = type(inst)
        if params is None:
            params = [dict(g) for g in inst.param_groups]
        kwargs = {**_constructor_args(optimizer_cls, inst.defaults), **kwargs}
    if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
        raise ConfigError(f"build_optimizer needs a torch.optim.Optimizer class such as "
                          f"torch.optim.AdamW (or an optimizer to convert), got "
                          f"{optimizer_cls!r}")
    if elementwise:
        declare_elementwise(optimizer_cls)
    groups = _named_groups(pm, params)
    stage = zero_stage(pm)
    if stage is None:
        by_name = dict(local_parameters(pm))
        opt = optimizer_cls([{**g, "params": [by_name[n] for n in g["params"]]}
                             for g in groups], **kwargs)
        check_pieces(opt, opt.param_groups)    # not element-wise over a split piece: refused
        views = _views(pm, groups)
        if views is not None and pm.__dict__.get("_nnc_pieces"):
            opt = PieceOptimizer(pm, opt, views)
    else:
        check_elementwise(optimizer_cls, stage, elementwise)
        opt = ZeroOptimizer(pm, optimizer_cls, params=groups, **kwargs)
    if inst is not None:                  # its state (a resumed run's) comes along
        carry(pm, inst, opt)
    register_optimizer(pm, opt)           # full_optimizer_state_dict finds it on every rank
    return opt


def _constructor_args(cls: type, defaults: dict) -> dict:
    """The defaults the class's constructor takes (AdamW's defaults name keys of Adam's that
    AdamW's __init__ does not accept)."""
    params = inspect.signature(cls.__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(defaults)
    return {k: v for k, v in defaults.items() if k in params}


def _views(pm, groups: list[dict]) -> list[list] | None:
    """pm's DTensor parameters (pm.parameters(), the module's) for the local names in `groups`,
    group by group; None where one of them is not a DTensor view."""
    out = []
    for g in groups:
        ps = [pm._parameters.get(n) for n in g["params"]]
        if not all(isinstance(p, DTensor) and getattr(p, "_nnc_view", False) for p in ps):
            return None
        out.append(ps)
    return out


# ---- an optimizer over pm's DTensor parameters that steps the tensors under them ------------
# param_groups (the inner optimizer's) hold the DTensors, which torch's get/set_optimizer_
# state_dict name, except while the inner optimizer steps, saves or loads: then the plain
# tensors it steps (tp's pieces, ZeRO-3's runs), one per DTensor. state_dict() gives state
# shaped like a parameter's local tensor as a DTensor like it: DCP stores each piece once.

@contextlib.contextmanager
def _holding(groups: list[dict], tensors: list):
    """`groups`' parameter lists hold `tensors` (in order) for the block, then what they held."""
    held = [list(g["params"]) for g in groups]
    lists = [g["params"] for g in groups]
    it = iter(tensors)
    for ps in lists:
        ps[:] = [next(it) for _ in ps]
    try:
        yield
    finally:
        for ps, old in zip(lists, held):
            ps[:] = old


def _as_views(sd: dict, views: list) -> dict:
    """The inner optimizer's state dict with each tensor that holds one element per element
    of its tensor as a DTensor like that tensor's parameter."""
    state = {}
    for i, st in sd["state"].items():
        view = views[i]
        local = view.to_local()
        state[i] = {k: DTensor.from_local(v.reshape(local.shape), view.device_mesh,
                                          view.placements, run_check=False, shape=view.shape,
                                          stride=view.stride())
                    if torch.is_tensor(v) and not isinstance(v, DTensor) and v.dim() and
                    v.numel() == local.numel() else v for k, v in st.items()}
    return {**sd, "state": state}


def _from_views(sd: dict, views: list | None, params: list) -> dict:
    """A state dict of this optimizer (by index, or by name as torch's
    set_optimizer_state_dict passes it, its groups naming the parameters in param_groups'
    order) as the inner optimizer's: by index, each DTensor as this rank's local tensor."""
    order = [key for g in sd.get("param_groups", []) for key in g.get("params", [])]
    index = {key: i for i, key in enumerate(order)}
    state = {}
    for key, st in sd.get("state", {}).items():
        i = key if isinstance(key, int) else index.get(key)
        if i is None or not 0 <= i < len(params):
            raise CheckpointError(f"the optimizer state dict has state for {key!r}, which its "
                                  "param_groups do not list among this optimizer's parameters; "
                                  "load a state dict of the same parameters and groups")
        state[i] = {k: _local_state(v, None if views is None else views[i], params[i], key, k)
                    for k, v in st.items()}
    groups = [{**g, "params": [index[key] for key in g.get("params", [])]}
              for g in sd.get("param_groups", [])]
    return {**sd, "state": state, "param_groups": groups}


def _local_state(v: Any, view, param: torch.Tensor, key, name: str) -> Any:
    """A state value as the inner optimizer holds it: a DTensor as this rank's local tensor,
    laid out like the DTensor parameter `view` (redistributed if it is not), shaped like
    `param`; anything else as it is."""
    if not isinstance(v, DTensor):
        return v
    if view is not None and v.device_mesh == view.device_mesh and \
            tuple(v.placements) != tuple(view.placements):
        v = v.redistribute(view.device_mesh, view.placements)
    local = v.to_local()
    if local.numel() != param.numel() or (view is not None and v.shape != view.shape):
        raise CheckpointError(
            f"the optimizer state {name!r} of {key!r} is a DTensor {list(v.shape)} with "
            f"{local.numel()} elements on this rank, which steps {param.numel()}: another "
            "model's, or laid out for another plan; load it through get_optimizer_state_dict "
            "(on this optimizer), dcp.load and set_optimizer_state_dict, or load_checkpoint")
    return local.reshape(param.shape)


class PieceOptimizer(torch.optim.Optimizer):
    """`inner`, the optimizer over the pieces pm computes with, where pm's parameters are
    DTensor views of them (tp): param_groups hold the DTensors, as `optimizer_cls(pm.
    parameters())`'s do, while the step runs on the plain pieces (no DTensor dispatch, one
    foreach kernel per group). param_groups and state are the inner optimizer's."""

    def __init__(self, pm, inner: torch.optim.Optimizer, views: list[list]):
        self.pm, self.inner = pm, inner
        super().__init__([p for ps in views for p in ps], inner.defaults)
        self._pieces = [p for g in inner.param_groups for p in g["params"]]
        self._views = [p for ps in views for p in ps]
        for g, ps in zip(inner.param_groups, views):
            g["params"][:] = ps
        self.param_groups, self.state = inner.param_groups, inner.state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for view, piece in zip(self._views, self._pieces):
            if piece.grad is None and view.grad is not None:   # set on the DTensor itself
                piece.grad = view.grad.to_local().reshape(piece.shape)
        with _holding(self.inner.param_groups, self._pieces):
            self.inner.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        with _holding(self.inner.param_groups, self._pieces):
            self.inner.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        with _holding(self.inner.param_groups, self._pieces):
            sd = self.inner.state_dict()
        return _as_views(sd, self._views)

    def load_state_dict(self, state_dict: dict) -> None:
        sd = _from_views(state_dict, self._views, self._pieces)
        with _holding(self.inner.param_groups, self._pieces):
            self.inner.load_state_dict(sd)
        self.param_groups, self.state = self.inner.param_groups, self.inner.state


def _named_groups(pm, params) -> list[dict]:
    """Group dicts of local names; None: one group of every trainable parameter."""
    if params is None:
        return [{"params": [n for n, p in local_named_parameters(pm) if p.requires_grad]}]
    return groups_by_name(pm, params)


class _Shard:
    """One flat piece the optimizer steps: its layout, the parameters it is cut from
    (stages 0-2) or the ZeRO-3 flat parameter it is, `param` (the piece the segments view: a
    copy for stages 1-2 and offload, the flat itself for ZeRO-3) and `segs`, a Parameter per
    tensor of the layout viewing its run of `param` (what the inner optimizer steps)."""

    def __init__(self, layout: FlatLayout, params: list, sharded: bool, flat=None, host=None,
                 segs=None):
        self.layout, self.params, self.sharded, self.flat = layout, params, sharded, flat
        if flat is not None:          # ZeRO-3: step the module's own piece (or a host copy)
            self.param = flat if host is None or flat.device == host else \
                copy_to_host(flat.detach())
        else:
            piece = layout.owned([p.detach() for p in params])
            self.param = copy_to_host(piece) if host is not None else piece.clone()
        self.segs = segs if segs is not None and self.param is flat else \
            segment_params(self.param, layout)
        self.cuts = cut(layout, self.param)
        self.grad: torch.Tensor | None = None       # ZeRO-2: the reduced gradient's piece
        self.got: set[int] = set()                  # ZeRO-2: tensors the reducer handed over

    @property
    def names(self):
        return self.layout.names


def _host_step(optimizer_cls: type, groups: list, kwargs: dict, shards: list, memory):
    """The inner optimizer. Where offloading puts the step on the host (its pieces in CPU
    memory while the model runs on a GPU, or offload asked for on a CPU), an optimizer with
    a fused CPU kernel (torch's Adam, AdamW, SGD, Adagrad) steps with it: one vectorised
    pass over each tensor instead of a kernel per operation (about 5x faster on a CPU; the
    sums round alike to a unit in the last place). `fused=` or `foreach=` given: as given."""
    on_host = (memory.offload_optimizer or memory.offload_params) and shards and \
        all(s.param.device.type == "cpu" for s in shards)
    if on_host and kwargs.get("fused") is None and kwargs.get("foreach") is None and \
            "fused" in inspect.signature(optimizer_cls.__init__).parameters:
        try:
            opt = optimizer_cls(groups, **{**kwargs, "fused": True})
        except (RuntimeError, ValueError, TypeError):   # no fused kernel for these tensors
            pass
        else:
            if not dist.is_initialized() or dist.get_rank() == 0:
                log(f"offload: the host steps {optimizer_cls.__name__} with its fused CPU "
                    "kernel (pass fused=False to keep the per-operation step)")
            watch_segments(opt)
            return opt
    opt = optimizer_cls(groups, **kwargs)
    watch_segments(opt)
    return opt


class ZeroOptimizer(torch.optim.Optimizer):
    """ZeRO stage 1-3 and/or offload around `optimizer_cls`; use it like the optimizer it
    wraps (param_groups: one per group given, so LR schedulers work). The inner optimizer
    steps one segment per parameter: the run of this rank's piece holding its elements, in
    the group the parameter was given in. Under ZeRO-3 without offload, where pm's parameters
    are Shard(0) DTensors over the segments, param_groups hold those, as PieceOptimizer's."""

    def __init__(self, pm, optimizer_cls: type, params=None, **kwargs: Any):
        cfg, memory = pm.compute_config, pm.memory
        self.pm, self.stage = pm, memory.zero
        self.__dict__["_nnc_warned"] = True       # shards and offloads: adoption.warn_unsharded
        if memory.zero == 0:
            self.group, self.ranks = None, [dist.get_rank() if dist.is_initialized() else 0]
        else:
            self.group, self.ranks = get_zero_group(pm.PLAN_NGPUS, pm.RUNTIME_NGPUS,
                                                    cfg.zero_ngroups, pm.PIPE_RANKS,
                                                    pm.mesh_axes)
        self.zero_rank = self.ranks.index(dist.get_rank()) if dist.is_initialized() else 0
        self.zero_size = len(self.ranks)
        self.host = torch.device("cpu") if memory.offload_optimizer else None
        if pm.zero is not None:
            rows = {row.name: row for row in param_rows(pm)}
            segs = zero3_segments(pm)
            self.shards = [_Shard(u.layout, [], rows[u.layout.names[0]].sharded,
                                  flat=getattr(pm, u.attr), host=self.host,
                                  segs=[segs[n] for n in u.layout.names])
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
        seg_of = {n: seg for s in self.shards for n, seg in zip(s.names, s.segs)}
        named = _named_groups(pm, params)
        for g in named:
            frozen = [n for n in g["params"] if n not in seg_of]
            if frozen:
                raise ConfigError(f"parameter {frozen[0]!r} does not require grad (it is "
                                  f"frozen), so {stage_name(pm)} keeps no piece of it to step; "
                                  f"leave it out of the optimizer's parameters")
        groups = [{**g, "params": [seg_of[n] for n in g["params"]]} for g in named]
        self.inner = _host_step(optimizer_cls, groups, kwargs, self.shards, memory)
        super().__init__([seg for g in self.inner.param_groups for seg in g["params"]],
                         self.inner.defaults)
        self.param_groups, self.state = self.inner.param_groups, self.inner.state
        self._segs = [seg for g in self.inner.param_groups for seg in g["params"]]
        # ZeRO-3 on the device: param_groups hold pm's DTensors where each segment has one
        views = _views(pm, named) if pm.zero is not None and self.host is None else None
        self._views = None if views is None else [p for ps in views for p in ps]
        self._view_of = {n: p for g, ps in zip(named, views or ()) for n, p in zip(g["params"], ps)}
        for g, ps in zip(self.inner.param_groups, views or ()):
            g["params"][:] = ps
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
            s.got.add(i)
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
            full = self._gather_layout(s.layout, g)
            for name, p, t in zip(s.names, s.params, s.layout.unflatten(full)):
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
                if s.flat.grad is None and self._view_of:
                    self._grad_from_views(s)
                g = s.flat.grad
                if s.param is not s.flat:
                    with offload_copy("to_host", self.host is not None):
                        s.param.copy_(s.flat.detach())
                        if g is not None:
                            g = copy_to_host(g, s.param.dtype) if g.device != s.param.device \
                                else g.to(dtype=s.param.dtype)
                for seg, (a, b, _, _) in zip(s.segs, s.cuts):
                    seg.grad = None if g is None else g.detach()[a:b]
                continue
            s.param.copy_(s.layout.owned([p.detach() for p in s.params]))  # pm's weights rule
            grad = s.layout.owned([p.grad if p.grad is not None else torch.zeros_like(p)
                                   for p in s.params])
            if s.grad is not None:               # ZeRO-2: what the reducer handed over
                grad = grad + s.grad.to(grad.device)
            with offload_copy("to_host", self.host is not None):
                grad = copy_to_host(grad, s.param.dtype) if grad.device != s.param.device \
                    else grad.to(dtype=s.param.dtype)
            for i, (seg, (a, b, _, _)) in enumerate(zip(s.segs, s.cuts)):
                # a parameter no rank computed a gradient for is skipped, as on one device
                seg.grad = grad[a:b] if (s.params[i].grad is not None or i in s.got) else None
        with self._holding_segments():
            self.inner.step()
        for s in self.shards:
            for seg in s.segs:
                seg.grad = None
            if s.flat is not None:
                if s.param is not s.flat:
                    with offload_copy("to_device", self.host is not None):
                        s.flat.copy_(s.param.detach().to(s.flat.device, non_blocking=True))
                continue
            with offload_copy("to_device", self.host is not None):
                local = s.param.detach().to(s.params[0].device, non_blocking=True)
            full = self._gather_layout(s.layout, local)
            for p, value in zip(s.params, s.layout.unflatten(full)):
                p.copy_(value)
        return loss

    def _grad_from_views(self, s: _Shard) -> None:
        """Gradients set on pm's DTensor parameters, not by a backward (torch's get_optimizer_
        state_dict steps zeros): into their piece's flat gradient, if every one has one."""
        views = [self._view_of.get(n) for n in s.names]
        if any(v is None or v.grad is None for v in views):
            return
        grad = torch.zeros_like(s.flat)
        for v, (a, b, _, _) in zip(views, s.cuts):
            grad[a:b] = v.grad.to_local().reshape(-1)
        s.flat.grad = grad

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.pm.zero_grad(set_to_none=set_to_none)      # clears the pieces too (ZeRO-2)
        self.clear_grads()

    def clear_grads(self) -> None:
        """ZeRO-2: drop the gradient pieces the reducer handed over (pm.zero_grad() calls it,
        as Hugging Face's Trainer clears gradients through the model)."""
        for s in self.shards:
            for seg in s.segs:
                seg.grad = None
            s.grad = None
            s.got = set()

    # ---- state --------------------------------------------------------------------------
    def _segments(self) -> list:
        return self._segs

    def _holding_segments(self):
        """The inner optimizer's groups hold the segments (not pm's DTensors) for the block."""
        return contextlib.nullcontext() if self._views is None else \
            _holding(self.inner.param_groups, self._segs)

    def layout(self) -> dict:
        """How the inner optimizer's parameters (one segment per local tensor, in its index
        order) cut the local tensors: the form merge.py reads."""
        return segment_layout(self._segments(), self.ranks, self.zero_rank, self.stage)

    def state_dict(self) -> dict:
        """This rank's piece of the optimizer state, with the layout it was cut by (where
        param_groups hold pm's DTensor parameters, its tensors as DTensors like them)."""
        with self._holding_segments():
            sd = {**self.inner.state_dict(), "nncompile_zero": self.layout()}
        return sd if self._views is None else _as_views(sd, self._views)

    def load_state_dict(self, state_dict: dict) -> None:
        saved = state_dict.get("nncompile_zero")
        by_name = any(isinstance(k, str) for k in state_dict.get("state", {})) or \
            any(isinstance(k, str) for g in state_dict.get("param_groups", [])
                for k in g.get("params", []))
        if saved != self.layout() and not (saved is None and by_name and self._views):
            raise CheckpointError(
                "this ZeRO optimizer state was cut for another layout "
                f"(zero rank/size {saved and (saved['zero_rank'], saved['zero_size'])} vs "
                f"{(self.zero_rank, self.zero_size)}, or other parameters or groups); load a "
                "deduped, merged or dcp checkpoint instead (nncompile.load_checkpoint)")
        sd = _from_views({k: v for k, v in state_dict.items() if k != "nncompile_zero"},
                         self._views, self._segs)
        with self._holding_segments():
            self.inner.load_state_dict(sd)
        self.param_groups = self.inner.param_groups    # torch replaced both: keep LR
        self.state = self.inner.state                  # schedulers writing into the live ones

    def local_state(self) -> dict[str, dict[str, Any]]:
        """Full optimizer state of this rank's local parameters, by local name (gathered over
        the ZeRO group: a collective)."""
        return segment_state_by_name(self.inner.state,
                                     [(s.layout, s.segs, s.param) for s in self.shards],
                                     self._gather_layout)

    def _gather_layout(self, layout: FlatLayout, v: torch.Tensor) -> torch.Tensor:
        return gather_piece(layout, v, self.zero_size, self.group, self.pm.device)

    def load_local_state(self, state: dict[str, dict[str, Any]]) -> None:
        """Inverse of local_state: keep this rank's slice of each full local state tensor."""
        load_segment_state(self.inner.state, [(s.layout, s.segs, s.param) for s in self.shards],
                           state)


def stage_name(pm) -> str:
    return zero_stage(pm) or "this plan"


def segment_state_by_name(opt_state: dict, shards: list, gather) -> dict[str, dict[str, Any]]:
    """Optimizer state of segments -> {local name: {key: full local tensor or value}};
    `shards` is [(FlatLayout, its segments, the piece they view)], `gather(layout, piece)` the
    full flat vector of a state piece (a collective over the ZeRO group)."""
    out: dict[str, dict[str, Any]] = {}
    for layout, segs, piece in shards:
        states = [opt_state.get(seg, {}) for seg in segs]
        keys = sorted({k for st, seg in zip(states, segs) for k, v in st.items()
                       if torch.is_tensor(v) and v.dim() == 1 and v.numel() == seg.numel()})
        for key in keys:
            parts = []
            for st, seg in zip(states, segs):
                v = st.get(key)
                parts.append(v.detach().to(piece.device, piece.dtype) if v is not None else
                             torch.zeros(seg.numel(), dtype=piece.dtype, device=piece.device))
            flat = layout.place(parts) if parts else piece.new_zeros(0)
            full = gather(layout, flat)
            for name, st, t in zip(layout.names, states, layout.unflatten(full)):
                if st:
                    out.setdefault(name, {})[key] = t.clone()
        for name, st in zip(layout.names, states):
            for k, v in st.items():
                if k not in keys:
                    out.setdefault(name, {})[k] = v.clone() if torch.is_tensor(v) else v
    return out


def load_segment_state(opt_state: dict, shards: list, state: dict[str, dict[str, Any]]) -> None:
    """This rank's runs of full local state tensors into the segments' optimizer state."""
    for layout, segs, piece in shards:
        for name, seg, shape in zip(layout.names, segs, layout.shapes):
            saved = state.get(name)
            if not saved:
                continue
            _, s, e, _ = seg._nnc_span
            new = {}
            for k, v in saved.items():
                if torch.is_tensor(v) and tuple(v.shape) == tuple(shape) and v.dim():
                    new[k] = v.reshape(-1)[s:e].to(seg.device, seg.dtype).clone()
                else:
                    new[k] = v.clone() if torch.is_tensor(v) else v
            opt_state[seg] = new


def register_optimizer(pm, optimizer) -> None:
    """Remember an optimizer build_optimizer made for pm (the ranks find theirs by index)."""
    pm.__dict__.setdefault("_nnc_optimizers", []).append(weakref.ref(optimizer))
