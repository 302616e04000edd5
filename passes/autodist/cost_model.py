"""The cost model: time per op and per collective, memory per rank, from IR shapes alone.

Compute (roofline): an op runs for max(flops / peak[dtype], bytes / mem_bandwidth) on the local
pieces its strategy gives it; with training, backward costs twice the forward (dX and dW).
A strategy that shards any tensor divides the flops by n; bytes are the local sizes.

Collectives (alpha-beta ring on a group of g ranks, tensor of B bytes in full), with each
kind's `ring_rounds` and `ring_bytes(B, g)` from nncompile/collectives.py:

    overhead + ring_rounds * (g-1) * alpha + ring_bytes(B, g) / bw     (local kinds: 0)

e.g. all_reduce 2 rounds and 2 (g-1)/g * B, all_gather (B: the gathered result) 1 and
(g-1)/g * B. alpha and bw are the intra-node link's while the group fits in one node, else the
network's. A pipeline send (p2p) costs overhead + alpha + B / bw. A transition costs its
forward collectives plus, with a gradient, their duals.

Memory per rank: parameters, their gradients and optimizer state (Adam: two fp32 moments, 8
bytes per element; `pas_config["optimizer_state_bytes"]`), at their local size; plus the
activations saved for backward (every differentiable op output that is not a view, at its
local size; Partial values are full size); ops inside `recompute_modules` save only what their
region hands on but run their forward twice. ZeRO stages and offload: memory_model.py.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from nncompile.custom_ops import annotation_flops, is_custom_op
from nncompile.ir import Op, Placement, Replicate, Shard, Value, local_shape

from nncompile.collectives import by_name, grad_sync_collective, route
from .profiles import DeviceProfile

# ops whose output aliases their input: no new activation memory
VIEWS = {"view", "_unsafe_view", "reshape", "transpose", "permute", "expand", "unsqueeze",
         "squeeze", "select", "slice", "split", "split_with_sizes", "chunk", "unsafe_split", "t",
         "alias", "detach", "unflatten", "flatten", "as_strided", "contiguous", "clone"}
OPTIMIZER_STATE_BYTES = {"adam": 8.0, "adamw": 8.0, "sgd": 0.0, "sgd_momentum": 4.0,
                         "none": 0.0}


def opname(op: Op) -> str:
    return getattr(op.target, "_opname", op.target_name)


def nbytes(v: Value, placement: Placement | None = None, n: int = 1) -> float:
    """Bytes of `v` on one rank under `placement` (full size when None or not a Shard)."""
    if not v.is_tensor:
        return 0.0
    p = placement if placement is not None else Replicate()
    shape = local_shape(v.meta.shape, p, n) if isinstance(p, Shard) else v.meta.shape
    return float(math.prod(shape)) * v.meta.dtype.itemsize


def flops(op: Op) -> float:
    """Forward FLOPs of the op on full tensors."""
    name = opname(op)
    outs = [v for v in op.outputs if v.is_tensor]
    if not outs:
        return 0.0
    out = outs[0]
    if name in ("linear", "addmm", "mm", "bmm", "matmul"):
        a = op.tensor_inputs()[1 if name == "addmm" else 0]
        k = a.meta.shape[-1]
        return 2.0 * out.meta.numel * k
    if name in ("scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
                "_scaled_dot_product_efficient_attention"):
        q, k = op.tensor_inputs()[:2]
        causal = 0.5 if op.kwargs.get("is_causal") else 1.0
        return 4.0 * q.meta.numel * k.meta.shape[-2] * causal
    if name in VIEWS or name == "embedding":
        return 0.0
    if is_custom_op(op.target):
        f = annotation_flops(name, [v.meta.shape for v in op.tensor_inputs()])
        if f is not None:
            return f
    return float(sum(v.meta.numel for v in outs))


@dataclass
class CostModel:
    profile: DeviceProfile
    n: int                          # plan unit size
    dp: int = 1                     # data-parallel units
    training: bool = True
    optimizer_state_bytes: float = 8.0

    # ---- compute ----
    def compute(self, op: Op, inputs, outputs) -> float:
        """Seconds for forward (+ backward when training) under these placements."""
        name = opname(op)
        if op.target_name.startswith("comm.") or name in VIEWS:
            return 0.0
        split = any(isinstance(p, Shard) for p in (*inputs, *outputs) if p is not None)
        f = flops(op) / (self.n if split else 1)
        tensors = op.tensor_inputs()
        if name == "embedding":     # reads the looked-up rows only
            b = nbytes(tensors[1], inputs[1], self.n) + 2 * sum(
                nbytes(v, p, self.n) for v, p in zip(op.outputs, outputs))
        else:
            b = sum(nbytes(v, p, self.n) for v, p in zip(tensors, inputs)) + sum(
                nbytes(v, p, self.n) for v, p in zip(op.outputs, outputs))
        dtype = op.outputs[0].meta.dtype if op.outputs and op.outputs[0].is_tensor else None
        t = max(f / self.profile.peak_flops(dtype), b / self.profile.mem_bandwidth)
        if self.training and any(v.requires_grad for v in op.outputs):
            t *= 3.0
        return t

    # ---- collectives ----
    def _link(self, group: int) -> tuple[float, float]:
        p = self.profile
        if group <= p.devices_per_node:
            return p.intra_latency, p.intra_bandwidth
        return p.inter_latency, p.inter_bandwidth

    def collective(self, kind: str, full_bytes: float, group: int | None = None,
                   span: int | None = None) -> float:
        """Seconds for one collective over `group` ranks whose ranks lie `span` apart at most
        (decides intra-node or network)."""
        g = self.n if group is None else group
        c = by_name(kind)
        if g <= 1 or c.is_local or full_bytes == 0:
            return 0.0
        alpha, bw = self._link(span or g)
        return self.profile.collective_overhead + c.ring_rounds * (g - 1) * alpha \
            + c.ring_bytes(full_bytes, g) / bw

    def p2p(self, full_bytes: float, span: int) -> float:
        """Seconds to send `full_bytes` to the rank `span` ranks away (pipeline stages)."""
        if full_bytes == 0:
            return 0.0
        alpha, bw = self._link(span)
        return self.profile.collective_overhead + alpha + full_bytes / bw

    def transition(self, v: Value, src: Placement, want: Placement | None,
                   backward: bool) -> tuple[float, list[str]]:
        """Seconds to turn `src` into `want` with insert_comm's collectives (forward, plus
        their backward duals when the value needs a gradient), and the forward kinds used."""
        steps = [c for c, _, _ in route(src, want)]
        full = nbytes(v)
        t = sum(self.collective(c.name, full) for c in steps)
        if backward and self.training:
            t += sum(self.collective(c.dual, full) for c in steps)
        return t, [c.name for c in steps]

    def grad_sync(self, v: Value) -> float:
        """Backward all-reduce of a replicated value's gradient whose users leave partial sums
        (sync_grad, or the runtime's sum over the plan unit for a parameter)."""
        return self.collective(grad_sync_collective().dual, nbytes(v)) if self.training else 0.0

    def grad_reduce(self, param: Value, placement: Placement) -> float:
        """The runtime's data-parallel all-reduce of one parameter's local gradient."""
        if not (self.training and param.requires_grad) or self.dp <= 1:
            return 0.0
        return self.collective("all_reduce", nbytes(param, placement, self.n), group=self.dp,
                               span=self.dp * self.n)

    # ---- memory ----
    def param_memory(self, v: Value, placement: Placement) -> float:
        local = nbytes(v, placement, self.n)
        if not (self.training and v.requires_grad):
            return local
        return local * 2 + local / v.meta.dtype.itemsize * self.optimizer_state_bytes

    def activation_memory(self, op: Op, outputs) -> float:
        if not self.training or opname(op) in VIEWS or op.target_name.startswith("comm."):
            return 0.0
        return sum(nbytes(v, p, self.n) for v, p in zip(op.outputs, outputs)
                   if v.is_tensor and v.requires_grad)
