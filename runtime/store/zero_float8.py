"""ZeRO-3 gathers in float8 (Float8Spec.all_gather, the tensorwise recipe): a ZeRO-3 unit's
float8 weights are cast to float8 on each rank before the all-gather, as torchao's float8
all-gather does under FSDP2, so the gather moves one byte per element instead of four (two
in bf16):

    before: rows (f32) --all-gather--> weight (f32) --FLOAT8.linear casts--> float8
    after:  amax of its rows --all-reduce MAX--> the whole weight's scale
            rows --cast--> float8 bytes --all-gather--> weight in float8 (torchao's
            Float8TrainingTensor), which FLOAT8.linear takes as it is

The scale is the whole tensor's (each rank's amax max-reduced over the ZeRO group and over
the mesh axes the plan splits the weight along), and casting is element-wise, so the bytes
are the ones one device's cast of the whole weight gives: the numerics do not change. Under
the tensorwise recipe the forward's and the input gradient's products cast the weight alike,
so both use the gathered bytes (torchao does the same); the weight's gradient stays in high
precision and is reduce-scattered as before. The unit's other tensors (biases, norms, weights
used elsewhere) travel in the same collective, in high precision:

    a rank's piece:   [ its rows of the high-precision tensors (f32 bytes) | pad ]
                      [ its rows of the float8 weights (1 byte each)      | pad ]

Backward gathers the unit again (runtime/store/zero.py) the same way: a saved float8 weight is
kept as a reference into the unit, not as a copy.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .layouts import RowShardLayout

_ALIGN = 16          # bytes: each part of a piece starts aligned for any dtype


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class Float8Unit:
    """How one ZeRO-3 unit gathers: which of its tensors go in float8 and the byte layout of
    a rank's piece (see the module docstring). `gathered`: {local name: mesh axes the plan
    splits it along}; `f8`: the module's runtime Float8."""

    def __init__(self, layout: RowShardLayout, gathered: dict[str, list[str]], f8, group):
        self.layout, self.f8, self.group = layout, f8, group
        names = layout.names
        self.f8_index = [i for i, n in enumerate(names) if n in gathered]
        self.hp_index = [i for i, n in enumerate(names) if n not in gathered]
        self.hp = self._sub(self.hp_index)
        self.f8_layout = self._sub(self.f8_index)
        self.cast = f8.config.cast_config_weight
        # the tensors whose amax reduces over more than the ZeRO group: by mesh axes
        self.axes: dict[tuple, list[int]] = {}
        for k, i in enumerate(self.f8_index):
            axes = tuple(sorted(gathered[names[i]]))
            if axes:
                self.axes.setdefault(axes, []).append(k)

    def _sub(self, index: list[int]) -> RowShardLayout | None:
        lay = self.layout
        if not index:
            return None
        return RowShardLayout([lay.names[i] for i in index], [lay.shapes[i] for i in index],
                              lay.rank, lay.size)

    def _slot(self, piece: torch.Tensor, i: int) -> torch.Tensor:
        at, slot = self.layout.offsets[i], self.layout.slots[i]
        return piece[at:at + slot]

    def nbytes(self, dtype: torch.dtype) -> tuple[int, int]:
        """(bytes of a piece's high-precision part, of its float8 part), each aligned."""
        hp = self.hp.chunk * dtype.itemsize if self.hp is not None else 0
        return _aligned(hp), _aligned(self.f8_layout.chunk)

    @torch.no_grad()
    def pack(self, piece: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """This rank's piece (the unit's dtype, on the device) as the bytes it gathers, and
        each float8 weight's scale (small collectives: the amaxes max-reduced)."""
        from torchao.float8.float8_training_tensor import GemmInputRole, \
            hp_tensor_and_scale_to_float8
        from torchao.float8.float8_utils import amax_to_scale
        slots = [self._slot(piece, i) for i in self.f8_index]
        amax = torch.stack([torch.max(torch.abs(s)) for s in slots])
        if self.group is not None:
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=self.group)
        for axes, ks in self.axes.items():
            group = self.f8.group(axes)
            if group is not None:
                part = amax[ks].contiguous()
                dist.all_reduce(part, op=dist.ReduceOp.MAX, group=group)
                amax[ks] = part
        c = self.cast
        scales = [amax_to_scale(a, c.target_dtype, self.f8.config.round_scales_to_power_of_2)
                  for a in amax]
        hp_bytes, f8_bytes = self.nbytes(piece.dtype)
        out = torch.zeros(hp_bytes + f8_bytes, dtype=torch.uint8, device=piece.device)
        if self.hp is not None:
            hp = torch.cat([self._slot(piece, i) for i in self.hp_index])
            out[:hp.numel() * hp.element_size()] = hp.contiguous().view(torch.uint8)
        at = hp_bytes
        for s, scale in zip(slots, scales):
            data = hp_tensor_and_scale_to_float8(s, scale, c.target_dtype, self.f8.mm_config,
                                                 GemmInputRole.WEIGHT)._data
            out[at:at + data.numel()] = data.view(torch.uint8)
            at += data.numel()
        return out, scales

    def unpack(self, gathered: torch.Tensor, scales: list[torch.Tensor], dtype: torch.dtype
               ) -> tuple[list[torch.Tensor], tuple[torch.Tensor, ...]]:
        """The unit's tensors from the gathered bytes of every rank's piece (high-precision
        views and float8 weights, in the unit's order) and the buffers they view (the
        high-precision full vector, the float8 bytes; runtime/store/zero.py saves references into
        them)."""
        hp_bytes, f8_bytes = self.nbytes(dtype)
        rows = gathered.view(self.layout.size, hp_bytes + f8_bytes)
        out: list = [None] * len(self.layout.names)
        buffers = []
        if self.hp is not None:
            hp = rows[:, :self.hp.chunk * dtype.itemsize].view(dtype)
            full = self.hp.to_full(hp)
            buffers.append(full)
            for i, t in zip(self.hp_index, self.hp.unflatten(full)):
                out[i] = t
        raw = self.f8_layout.to_full(rows[:, hp_bytes:hp_bytes + self.f8_layout.chunk])
        buffers.append(raw)
        for i, t, scale in zip(self.f8_index, self.f8_layout.unflatten(raw), scales):
            out[i] = self.wrap(t, scale, dtype)
        return out, tuple(buffers)

    def wrap(self, raw: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
             gemm_role=None, axiswise_dim=None):
        """Float8 bytes (uint8, any view) as torchao's Float8TrainingTensor of a weight."""
        from torchao.float8.float8_training_tensor import Float8TrainingTensor, GemmInputRole
        return Float8TrainingTensor(raw.view(self.cast.target_dtype), scale, dtype,
                                    self.f8.mm_config, gemm_role or GemmInputRole.WEIGHT,
                                    axiswise_dim)


def float8_data(t: torch.Tensor) -> torch.Tensor | None:
    """The float8 bytes under a Float8TrainingTensor (None for any other tensor)."""
    if type(t) is torch.Tensor or type(t) is torch.nn.Parameter:
        return None
    data = getattr(t, "_data", None)
    return data if isinstance(data, torch.Tensor) and data.element_size() == 1 else None


class SavedFloat8:
    """A saved gathered float8 weight (or its transpose): where its bytes sit in the unit's
    float8 buffer, and its scale and torchao metadata to rebuild it after gathering again."""
    __slots__ = ("unit", "index", "offset", "size", "stride", "scale", "dtype", "role",
                 "axiswise_dim")

    def __init__(self, unit, index: int, t: torch.Tensor, data: torch.Tensor):
        self.unit, self.index = unit, index
        self.offset, self.size, self.stride = data.storage_offset(), data.size(), data.stride()
        self.scale, self.dtype = t._scale, t._orig_dtype
        self.role, self.axiswise_dim = t._gemm_input_role, t._axiswise_dim

    def rebuild(self, buffer: torch.Tensor) -> torch.Tensor:
        raw = buffer.as_strided(self.size, self.stride, self.offset)
        return self.unit.float8.wrap(raw, self.scale, self.dtype, self.role, self.axiswise_dim)
