"""ZeRO-3: parameters stored as flat shards over the data-parallel ranks (and the context
ranks: nncompile.mesh.replica_dims), gathered per layer.

The generated file lists ZERO_UNITS: one flat parameter per layer unit (a block of a
ModuleList such as `transformer.h.3`, else a top-level module), holding that unit's local
parameters (their plan-unit shards). Each tensor is cut by rows over the Z ranks of the ZeRO
group, as a Shard(0) DTensor is (runtime/store/layouts.py, RowShardLayout), and a rank stores its
rows of every tensor of the unit, one after the other:

    before (ZeRO-1/2):  self.h_0_attn_w   [D, 3D]                 every data-parallel rank: all
    after  (ZeRO-3):    self.zero_h_0     [sum ceil(rows / Z) * width]   rank k: rows
                                                                  [k*c, (k+1)*c) of each tensor

and the forward gathers a unit right before its first use, issues the next unit's gather
asynchronously (prefetch), and drops the full tensor after the unit's last use:

    comm.zero_prefetch(self.zero_h_1, group=ZERO)            # starts while h.0 computes
    h_0_attn_w, h_0_attn_b = comm.zero_gather(self.zero_h_0, group=ZERO)
    ...                                                      # the unit's ops
    del h_0_attn_w, h_0_attn_b                               # its full copy is freed

Backward needs some of those weights again (a matmul saves its weight). Saved-tensor hooks
(`ZeroRuntime.pack/unpack`) save a reference into the unit instead of the tensor, and the
first unpack in backward gathers the unit again (the gather is recomputed, not saved); the
gather's backward reduces the unit's gradient over the ranks `nncompile.mesh.grad_reduction`
names and keeps this rank's piece (a reduce-scatter over the ZeRO group; an all-reduce and a
slice where the sum spans more ranks: partial sums over the plan unit, zero_ngroups > 1), so
`.grad` of the flat parameter is a shard too. With offload_params the shards and their
gradients live in host memory and each gather first copies the piece to the device. Under
float8 training (tensorwise) a unit's float8 weights are cast before the gather and travel as
float8 bytes (runtime/store/zero_float8.py).
"""
from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from nncompile import compat
from nncompile.errors import ConfigError
from nncompile.ir import MemoryChoice
from nncompile.mesh import grad_reduction, replica_dims

from ..protocol.groups import get_zero_group, group_along
from ..protocol.hang_report import wait_for
from nncompile.rows import param_rows

from .layouts import FlatLayout, RowShardLayout  # noqa: F401 (FlatLayout: imported from here)
from .zero_float8 import Float8Unit, SavedFloat8, float8_data


_ALL_GATHER = compat.all_gather_single()           # the spelling this torch prefers
_REDUCE_SCATTER = compat.reduce_scatter_single()


def gather_piece(layout: "FlatLayout", piece: torch.Tensor, size: int, group,
                 device) -> torch.Tensor:
    """The full flat vector of a piece cut by `layout` (a parameter, a gradient or an optimizer
    state piece; hi - lo or chunk elements), gathered on `device` (a collective)."""
    local = layout.padded(piece.detach().reshape(-1).to(device, non_blocking=True))
    return layout.to_full(all_gather_flat(local, size, group)[0])


def copy_to_host(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A copy of `t` in host memory, pinned when `t` is on a GPU (a copy into pageable memory
    runs at a fraction of the link's speed: offload's gradients cross it every step). The
    copy has finished when this returns."""
    dtype = dtype or t.dtype
    if t.device.type != "cuda":
        return t.to("cpu", dtype, copy=True)
    out = torch.empty(t.shape, dtype=dtype, device="cpu", pin_memory=True)
    out.copy_(t)
    return out


def offload_copy(direction: str, on: bool, what: str = ""):
    """A host<->device copy of offloaded state, named on the profiler's timeline
    (`nncompile.offload.to_device h.3`; nncompile.memory draws them); nothing where `on` is
    False."""
    if not on:
        return contextlib.nullcontext()
    return torch.profiler.record_function(f"nncompile.offload.{direction}" +
                                          (f" {what}" if what else ""))


def all_gather_along(t: torch.Tensor, dim: int, size: int, group) -> torch.Tensor:
    """Equal pieces of `group`'s ranks joined along `dim`, gathered into one buffer (along
    dim 0 that buffer is the result: no copy)."""
    flat, _ = all_gather_flat(t.contiguous().reshape(-1), size, group)
    joined = flat.view(size, *t.shape).movedim(0, dim)
    return joined.reshape(*t.shape[:dim], size * t.shape[dim], *t.shape[dim + 1:])


def all_gather_flat(local: torch.Tensor, size: int, group, async_op: bool = False):
    """Equal pieces of every rank of `group` concatenated: (full, work or None)."""
    full = torch.empty(local.numel() * size, dtype=local.dtype, device=local.device)
    if group is None:
        full.copy_(local)
        return full, None
    work = _ALL_GATHER(full, local.contiguous(), group=group, async_op=async_op)
    return full, work


@dataclass
class Unit:
    """One flat parameter of ZERO_UNITS."""
    attr: str
    path: str
    layout: FlatLayout
    trainable: bool
    reduce_dims: tuple | None = None  # mesh dims the full gradient is summed over (None: none)
    scale: float = 1.0
    pending: tuple | None = None      # a prefetch in flight: (gathered, work, float8 scales)
    again: tuple | None = None        # the unit's buffers gathered again in backward
    live: dict = field(default_factory=dict)
    float8: Float8Unit | None = None  # its float8 weights gathered in float8 (zero_float8.py)


class _Saved:
    """What a saved gathered weight becomes: where it sits in one of its unit's gathered
    buffers (`index`: the full vector; a float8 unit's high-precision part)."""
    __slots__ = ("unit", "index", "offset", "size", "stride")

    def __init__(self, unit, index: int, t):
        self.unit, self.index = unit, index
        self.offset, self.size, self.stride = t.storage_offset(), t.size(), t.stride()


class _Gather(torch.autograd.Function):
    """The unit's tensors (views of its full vector); backward copies their gradients
    straight into the pieces' order for the reduce-scatter (no joined gradient first)."""

    @staticmethod
    def forward(ctx, flat, zero, unit):
        ctx.zero, ctx.unit = zero, unit
        ctx.set_materialize_grads(False)
        return tuple(zero.tensors(unit))

    @staticmethod
    def backward(ctx, *grads):
        unit = ctx.unit
        unit.again = None             # the unit's backward is done: drop its second gather
        return ctx.zero.reduce_grad(unit, grads), None, None


class ZeroRuntime:
    """The ZeRO-3 units of one ParallelModule and the collectives on them."""

    def __init__(self, pm, units: list[tuple], offload_params: bool, ngroups: int):
        self.pm = pm
        self.group, self.ranks = get_zero_group(pm.PLAN_NGPUS, pm.RUNTIME_NGPUS, ngroups,
                                                 pm.PIPE_RANKS, pm.mesh_axes)
        self.size = len(self.ranks)
        self.rank = self.ranks.index(dist.get_rank()) if dist.is_initialized() else 0
        self.device = pm.device
        self.host = torch.device("cpu") if offload_params else pm.device
        self.offload = offload_params
        self.same_group = ngroups == 1
        mesh = pm.mesh
        self.mesh = mesh
        rows = {row.name: row for row in param_rows(pm)}
        partial = pm._partial_grad
        in_float8 = (pm.FLOAT8 or {}).get("gathered", {})    # ZeRO-3 gathers them in float8
        self.units: list[Unit] = []
        self.by_attr: dict[str, Unit] = {}
        for attr, path, names in units:
            shapes = [rows[n].local_shape for n in names]
            trainable = not pm.INFERENCE_ONLY and names[0] not in pm.FROZEN
            u = Unit(attr, path, RowShardLayout(names, shapes, self.rank, self.size),
                     trainable)
            red = grad_reduction(mesh, names[0] in partial, trainable,
                                 tuple(a for a, ns in pm.PARTIAL_GRAD_AXES.items()
                                       if names[0] in ns)) \
                if dist.is_initialized() else None
            if red is not None:
                u.reduce_dims, u.scale = red.dims, red.scale
            if any(n in in_float8 for n in names):
                u.float8 = Float8Unit(u.layout, {n: in_float8[n] for n in names
                                                 if n in in_float8}, pm.float8, self.group)
            self.units.append(u)
            self.by_attr[attr] = u
        self._backward_queued = False
        self._by_storage: dict[int, tuple] = {}    # a gathered buffer's storage -> (unit, index)
        self.gathered_bytes = 0     # what this rank's unit gathers received (forward, backward)

    # ---- building and reading the shards ---------------------------------------------------
    def shard_of(self, unit: Unit, tensors: list[torch.Tensor]) -> torch.Tensor:
        """This rank's padded piece of the unit's local tensors, in host or device memory."""
        piece = unit.layout.padded(unit.layout.owned([t.detach() for t in tensors]))
        out = piece.to(self.host, copy=True)
        if self.offload and out.device.type == "cpu" and torch.cuda.is_available():
            out = out.pin_memory()
        return out

    def flat(self, unit: Unit) -> torch.nn.Parameter:
        return getattr(self.pm, unit.attr)

    def gather_now(self, unit: Unit, source: torch.Tensor | None = None) -> torch.Tensor:
        """The full flat tensor of a unit (a collective), on the device; `source` instead of
        the parameter (e.g. its gradient)."""
        return self.gather_state(unit.layout, self.flat(unit) if source is None else source)

    def gather_state(self, layout: FlatLayout, piece: torch.Tensor) -> torch.Tensor:
        """The full flat vector of a piece cut by `layout` (a collective)."""
        return gather_piece(layout, piece, self.size, self.group, self.device)

    def local_tensors(self, grads: bool = False) -> dict[str, torch.Tensor | None]:
        """{local name: full local tensor} (every rank of the ZeRO group calls this)."""
        out: dict[str, torch.Tensor | None] = {}
        for unit in self.units:
            flat = self.flat(unit)
            if grads and (not unit.trainable):
                out.update({n: None for n in unit.layout.names})
                continue
            src = (flat.grad if flat.grad is not None else torch.zeros_like(flat)) if grads \
                else flat
            full = self.gather_now(unit, src)
            for name, t in zip(unit.layout.names, unit.layout.unflatten(full)):
                out[name] = t.clone()
        return out

    def local_tensor(self, name: str) -> torch.Tensor:
        """The full local tensor `name` alone: each rank of the ZeRO group whose piece holds
        some of it broadcasts that part into place (a collective; the unit is never gathered
        whole, and nothing but the tensor is allocated)."""
        unit = next(u for u in self.units if name in u.layout.names)
        lay = unit.layout
        i = lay.names.index(name)
        out = torch.empty(lay.numels[i], dtype=self.flat(unit).dtype, device=self.device)
        for r in range(self.size):
            at, s, e = lay.run_of(i, r)
            if s >= e:
                continue
            if r == self.rank:
                out[s:e].copy_(self.flat(unit).detach()[at:at + e - s])
            if self.group is not None:
                dist.broadcast(out[s:e], src=self.ranks[r], group=self.group)
        return out.view(lay.shapes[i])

    @torch.no_grad()
    def load_local_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Write full local tensors (every unit's, or only those given) into the shards."""
        for unit in self.units:
            if not any(n in tensors for n in unit.layout.names):
                continue
            if any(n not in tensors for n in unit.layout.names):   # keep the others as they are
                full = self.gather_now(unit)
                tensors = {**dict(zip(unit.layout.names, unit.layout.unflatten(full))),
                           **tensors}
            flat = self.flat(unit)
            flat.copy_(self.shard_of(unit, [tensors[n].to(self.device)
                                            for n in unit.layout.names]))

    # ---- forward: gather, prefetch ------------------------------------------------------------
    def start(self, unit: Unit) -> None:
        """Issue the unit's gather without waiting (prefetch)."""
        if unit.pending is None:
            unit.pending = self._issue(unit, async_op=True)

    def _issue(self, unit: Unit, async_op: bool) -> tuple:
        """(gathered, work, float8 scales): the unit's pieces all-gathered; a float8 unit's
        as bytes, its weights cast first (runtime/store/zero_float8.py)."""
        with offload_copy("to_device", self.offload, unit.path):
            local = self.flat(unit).detach().to(self.device, non_blocking=True)
        scales = None
        if unit.float8 is not None:
            local, scales = unit.float8.pack(local)
        self.gathered_bytes += local.numel() * local.element_size() * self.size
        return (*all_gather_flat(local, self.size, self.group, async_op=async_op), scales)

    def _unpack(self, unit: Unit, pending: tuple) -> tuple[list, tuple]:
        """(the unit's tensors, the buffers they view) from a gather `pending`."""
        full, work, scales = pending
        if work is not None:
            wait_for(work, self.group)          # (where the hang watch sees it)
        if unit.float8 is not None:
            return unit.float8.unpack(full, scales, self.flat(unit).dtype)
        full = unit.layout.to_full(full)         # copy-out into the tensors' own order
        return unit.layout.unflatten(full), (full,)

    def tensors(self, unit: Unit) -> list[torch.Tensor]:
        """The unit's gathered tensors: a prefetched gather waited for, or gathered now."""
        if unit.pending is None:
            self.start(unit)
        pending, unit.pending = unit.pending, None
        tensors, buffers = self._unpack(unit, pending)
        for index, buf in enumerate(buffers):
            ptr = buf.untyped_storage().data_ptr()
            unit.live[ptr] = weakref.ref(buf.untyped_storage())   # dies with the memory
            self._by_storage[ptr] = (unit, index)
        return tensors

    def reset(self) -> None:
        """Forget prefetches and backward gathers left by a step that raised."""
        for unit in self.units:
            if unit.pending is not None and unit.pending[1] is not None:
                unit.pending[1].wait()
            unit.pending, unit.again = None, None
            unit.live.clear()
        self._by_storage.clear()

    # ---- saved tensors: a gathered weight is saved as a reference ---------------------------
    def pack(self, t: torch.Tensor):
        data = float8_data(t)               # a float8 weight: its bytes are in the unit
        probe = t if data is None else data
        if probe.device != self.device or probe.layout != torch.strided:
            return t
        ptr = probe.untyped_storage().data_ptr()
        entry = self._by_storage.get(ptr)
        if entry is None:
            return t
        unit, index = entry
        ref = unit.live.get(ptr)
        storage = ref() if ref is not None else None
        if storage is None or storage.data_ptr() != ptr:   # freed; memory reused
            unit.live.pop(ptr, None)
            del self._by_storage[ptr]
            return t
        return _Saved(unit, index, t) if data is None else SavedFloat8(unit, index, t, data)

    def unpack(self, saved):
        if not isinstance(saved, (_Saved, SavedFloat8)):
            return saved
        unit = saved.unit
        if unit.again is None:
            unit.again = self._unpack(unit, self._issue(unit, async_op=False))[1]
            if not self._backward_queued:
                self._backward_queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        buf = unit.again[saved.index]
        if isinstance(saved, SavedFloat8):
            return saved.rebuild(buf)
        return buf.as_strided(saved.size, saved.stride, saved.offset)

    def _end_backward(self) -> None:
        for unit in self.units:
            unit.again = None
        self._backward_queued = False

    # ---- backward: the gradient's piece ----------------------------------------------------------
    def reduce_grad(self, unit: Unit, grads: tuple) -> torch.Tensor | None:
        """This rank's piece of the unit's gradient, reduced (`grads`: per tensor, or None)."""
        if all(g is None for g in grads) or not unit.trainable:
            return None
        layout = unit.layout
        g = layout.ranked(grads)        # copy-in: the pieces one after the other
        mine = slice(self.rank * layout.chunk, (self.rank + 1) * layout.chunk)
        if unit.reduce_dims is not None:
            dims = unit.reduce_dims
            group = group_along(dims, self.pm.PLAN_NGPUS, self.pm.RUNTIME_NGPUS,
                                self.pm.PIPE_RANKS, self.pm.mesh_axes)
            if set(dims) == set(replica_dims(self.mesh)) and self.same_group and \
                    self.group is not None:
                piece = torch.empty(layout.chunk, dtype=g.dtype, device=g.device)
                _REDUCE_SCATTER(piece, g, group=self.group)
            else:
                if group is not None:
                    g = g.clone()
                    dist.all_reduce(g, group=group)
                piece = g[mine]
            if unit.scale != 1.0:
                piece = piece * unit.scale
        else:
            piece = g[mine]
        with offload_copy("to_host", self.offload, unit.path):
            return copy_to_host(piece) if self.offload else piece.clone()

    # ---- tied weights (pipeline stages sharing one) ------------------------------------------
    def tied_grad(self, name: str) -> torch.Tensor:
        """The gradient piece of the unit holding tied parameter `name` (zeros when none
        flowed), to be summed with the other stages' identical unit."""
        unit = next(u for u in self.units if name in u.layout.names)
        if unit.layout.names != [name]:
            raise ConfigError(
                f"ZeRO-3 shards {name!r} in one flat unit with {unit.layout.names}, but only "
                f"{name!r} is shared with another pipeline stage; its gradient cannot be "
                "summed across stages piecewise. Use use_zero 1 or 2 with this pipeline, or "
                "keep the tied weight in a module of its own")
        flat = self.flat(unit)
        if flat.grad is None:
            flat.grad = torch.zeros_like(flat)
        return flat.grad

    # ---- gradient pieces for clipping ------------------------------------------------------
    def grad_pieces(self):
        """(gradient piece, sharded over the plan unit) for every trainable unit."""
        rows = {row.name: row for row in param_rows(self.pm)}
        for unit in self.units:
            g = self.flat(unit).grad
            if unit.trainable and g is not None:
                yield g, rows[unit.layout.names[0]].sharded


def gather(flat: torch.nn.Parameter, *, group: ZeroRuntime) -> tuple[torch.Tensor, ...]:
    """comm.zero_gather: the unit's local parameters, gathered (views of one full tensor)."""
    unit = group.by_attr[flat._zero_attr]
    return tuple(_Gather.apply(flat, group, unit))


def prefetch(flat: torch.nn.Parameter, *, group: ZeroRuntime) -> None:
    """comm.zero_prefetch: start the unit's gather now; zero_gather waits for it."""
    group.start(group.by_attr[flat._zero_attr])


def memory_settings(pm) -> MemoryChoice:
    """The ZeRO stage and offload this module runs with: ComputeConfig's values, with "auto"
    taken from the choice the code was generated with (MEMORY)."""
    cfg, saved = pm.compute_config, pm.MEMORY
    zero, offload = cfg.zero_stage, cfg.offload_optimizer
    if saved is None:
        if zero == 3 or "auto" in (zero, offload):
            raise ConfigError(
                f"use_zero={cfg.use_zero!r}, offload_optimizer={offload!r} shape the generated "
                f"code, but {type(pm).__module__} was generated without them; call "
                f"nncompile.parallelize with this ComputeConfig to regenerate it")
        return MemoryChoice(zero=zero, offload_optimizer=offload)
    zero = saved["zero"] if zero == "auto" else zero
    if (zero == 3) != (saved["zero"] == 3):
        raise ConfigError(f"use_zero={cfg.use_zero!r} but the generated code was made for ZeRO "
                          f"stage {saved['zero']}; parallelize again with this ComputeConfig")
    return MemoryChoice(zero=zero,
                        offload_optimizer=saved["offload_optimizer"] if offload == "auto"
                        else offload,
                        offload_params=saved["offload_params"])
