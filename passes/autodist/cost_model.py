"""The cost model: time per op and per collective, memory per rank, from IR shapes alone.

Compute (roofline): an op runs for max(flops / (peak[dtype] * op_efficiency[op]), bytes /
mem_bandwidth) on the local pieces its strategy gives it (op_efficiency: the profile's measured
fraction of peak for an op kind, e.g. attention; 1 by default), plus the profile's
`op_overhead` (the generated code's call of the op: Python and dispatch, views included); with
training, backward costs twice the forward (dX and dW). A strategy that shards any tensor
divides the flops by n; bytes are the local sizes. When the profile says its ranks share
`cores` CPU cores, every rank's compute is stretched by max(1, ranks on the node / cores)
(4 gloo ranks on 2 cores compute at half speed).

Collectives (alpha-beta ring on a group of g ranks, tensor of B bytes in full), with each
kind's `ring_rounds` and `ring_bytes(B, g)` from nncompile/collectives.py:

    overhead + ring_rounds * (g-1) * alpha + ring_bytes(B, g) / bw     (local kinds: 0)

e.g. all_reduce 2 rounds and 2 (g-1)/g * B, all_gather (B: the gathered result) 1 and
(g-1)/g * B; with a profile whose `backend` is "gloo", a kind gloo lacks costs its fallback
(reduce_scatter: all_reduce + chunk, all_to_all: all_gather + chunk). alpha and bw are the
intra-node link's while the group fits in one node, else the network's. A pipeline send (p2p)
costs overhead + alpha + B / bw. A transition costs its forward collectives plus, with a
gradient, their duals. Gradients the runtime reduces (the data-parallel all-reduce, a
replicated parameter's sum over the plan unit) travel in buckets of `bucket_bytes`
(reducer_bucket_cap_mb): their overhead and latency are paid per bucket, so a gradient of B
bytes carries B / bucket_bytes of them, its bandwidth term in full. A split weight gathered
for split readers is the exception: the gather's backward sums its gradient, one collective
per weight (`gathered_sync`, priced on that edge).

Optimizer step (when the profile has `optimizer_element_s`): per trainable parameter,
optimizer_tensor_s + elements * optimizer_element_s on its local piece, both measured for
AdamW; other optimizers scale it by the tensors they read and write (2 + state bytes / 4)
against Adam's 4.

Memory per rank: parameters, their gradients and optimizer state (Adam: two fp32 moments, 8
bytes per element; `parallel.optimizer_state_bytes`), at their local size; plus the
activations saved for backward (every differentiable op output that is not a view, at its
local size; Partial values are full size); ops inside `recompute_modules` save only what their
region hands on but run their forward twice. ZeRO stages and offload: memory_model.py.

`estimate_step(graph, config)` costs any planned graph (any policy's) with these same terms,
the way problem.py sums them for the ILP: on autodist's own plan it equals the ILP objective.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from nncompile.custom_ops import annotation_flops, is_custom_op
from nncompile.errors import ConfigError
from nncompile.ir import FREE_KINDS, PARAM, Graph, Op, Placement, Replicate, Shard, Value, \
    local_shape
from nncompile.ir.placement import nbytes  # noqa: F401 (used here and by problem/memory_model)

from nncompile.collectives import by_name, grad_sync_collective, route
from .profiles import DeviceProfile

# ops whose output aliases their input: no new activation memory
VIEWS = {"view", "_unsafe_view", "reshape", "transpose", "permute", "expand", "unsqueeze",
         "squeeze", "select", "slice", "split", "split_with_sizes", "chunk", "unsafe_split", "t",
         "alias", "detach", "unflatten", "flatten", "as_strided", "contiguous", "clone"}
CONVOLUTIONS = {"convolution", "conv1d", "conv2d", "conv3d", "conv_transpose1d",
                "conv_transpose2d", "conv_transpose3d"}
OPTIMIZER_STATE_BYTES = {"adam": 8.0, "adamw": 8.0, "sgd": 0.0, "sgd_momentum": 4.0,
                         "none": 0.0}


def opname(op: Op) -> str:
    return getattr(op.target, "_opname", op.target_name)


def _arg(op: Op, name: str):
    """An aten op's argument by schema name, given by position or by name (None if absent)."""
    if name in op.kwargs:
        return op.kwargs[name]
    names = [a.name for a in getattr(getattr(op.target, "_schema", None), "arguments", ())]
    i = names.index(name) if name in names else len(op.args)
    return op.args[i] if i < len(op.args) else None


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
        causal = 0.5 if _arg(op, "is_causal") is True else 1.0      # half the scores
        return 4.0 * q.meta.numel * k.meta.shape[-2] * causal
    if name in CONVOLUTIONS:        # 2 * each output (transposed: input) element * w[0].numel
        x, w = op.tensor_inputs()[:2]
        transposed = name.startswith("conv_transpose") or (
            name == "convolution" and bool(_arg(op, "transposed")))
        per = math.prod(w.meta.shape[1:])
        return 2.0 * (x.meta.numel if transposed else out.meta.numel) * per
    if name in VIEWS or name == "embedding":
        return 0.0
    if name == "experts_mlp":       # each token copy through one expert's two products
        x, w_in, w_out = op.tensor_inputs()[:3]
        rows = x.meta.shape[0]
        return 2.0 * rows * (x.meta.shape[1] * w_in.meta.shape[-1]
                             + w_out.meta.shape[-2] * w_out.meta.shape[-1])
    if name == "moe_experts":       # each token's k picks through one expert's products
        x, index, _, w_in, w_out = op.tensor_inputs()[:5]
        per_pick = (w_in.meta.numel + w_out.meta.numel) / w_in.meta.shape[0]
        return 2.0 * index.meta.numel * per_pick
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
    bucket_bytes: float = 25 * 2 ** 20      # the runtime's gradient bucket (reducer_bucket_cap_mb)
    axes: dict[str, int] = field(default_factory=dict)   # the mesh's other axes (Graph.axes)
    # context-parallel ranks (Graph.axes["cp"]): each runs every token-wise op, and attention's
    # rows, on 1/C of the sequence (compute and activations / C), gathering attention's keys
    # and values along cp (and reduce-scattering their gradients)
    context: int = 1
    # expert-parallel ranks (Graph.axes["ep"]): each runs every token-wise op on 1/E of the
    # batch and holds 1/E of the experts (`experts`: their weights' names)
    experts_split: int = 1
    experts: frozenset = frozenset()

    @property
    def token_split(self) -> int:
        """The ranks beside the plan's that split the tokens (cp x ep)."""
        return self.context * self.experts_split

    def tokens_share(self, v: Value, full_bytes: float) -> float:
        """The bytes of `v` one context- or expert-parallel rank holds: an activation's 1/C
        (its tokens), a parameter, buffer or constant whole."""
        return full_bytes if v.kind in FREE_KINDS or self.token_split == 1 else \
            full_bytes / self.token_split

    def param_share(self, v: Value) -> float:
        """The part of a parameter's plan piece one rank holds: 1/E of an expert weight."""
        return 1.0 / self.experts_split if v.name in self.experts else 1.0

    def axis_size(self, axis: str) -> int:
        """The ranks along mesh axis `axis`: the group a collective on it runs over."""
        return {"plan": self.n, "dp": self.dp, **self.axes}.get(axis, 1)

    def axis_span(self, axis: str) -> int:
        """How far apart (in ranks) the ranks of a group along `axis` lie at most: the axis's
        size times the sizes of the axes inside it (mesh order dp, [pp,] axes..., plan).
        It decides whether the collective stays inside a node."""
        if axis == "plan":
            return self.n
        inner = self.n
        names = list(self.axes)
        for a in (names[names.index(axis):] if axis in self.axes else names):
            inner *= self.axes[a]
        return inner if axis in self.axes else inner * self.dp

    @property
    def stretch(self) -> float:
        """How much slower a rank computes because ranks share the profile's CPU cores."""
        cores = self.profile.cores
        if not cores:
            return 1.0
        return max(1.0, min(self.n * self.dp, self.profile.devices_per_node) / cores)

    # ---- compute ----
    def compute(self, op: Op, inputs, outputs) -> float:
        """Seconds for forward (+ backward when training) under these placements."""
        name = opname(op)
        if op.target_name.startswith("comm."):
            return 0.0
        over = self.profile.op_overhead or 0.0
        if name in VIEWS:
            if not over:
                return 0.0
            t = over * self.stretch
            return t * 3.0 if self.training and any(v.requires_grad for v in op.outputs) else t
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
        peak = self.profile.peak_flops(dtype) * (self.profile.op_efficiency or {}).get(name, 1.0)
        if op.float8:       # products at the float8 rate; each cast reads x and w, writes 1 B
            peak = self.profile.float8_flops(dtype)
            b += sum(nbytes(v, p, self.n) * (1 + 1 / v.meta.dtype.itemsize)
                     for v, p in zip(tensors[:2], inputs[:2]))
        c = self.token_split
        t = (max(f / peak / c, b / self.profile.mem_bandwidth / c) + over) * self.stretch
        backward = self.training and any(v.requires_grad for v in op.outputs)
        if backward:
            t *= 3.0
        if name == "moe_experts":                  # dispatch: the picks there and back
            x, index = tensors[:2]
            picks = index.meta.numel * x.meta.shape[-1] * x.meta.dtype.itemsize
            if self.experts_split > 1:              # along ep, of this tensor rank's share
                share = picks / (self.n if isinstance(inputs[0], Shard) else 1)
                t += 2 * self.collective("all_to_all", share, group=self.experts_split,
                                         span=self.experts_split * self.n) * (
                    2 if backward else 1)
            elif isinstance(inputs[0], Shard) and isinstance(inputs[3], Shard):
                t += 2 * self.collective("all_to_all", picks) * (2 if backward else 1)
        if self.context > 1 and name == "scaled_dot_product_attention":     # k, v along cp
            kv = sum(nbytes(v, p, self.n) for v, p in zip(tensors[1:3], inputs[1:3]))
            t += self.collective("all_gather", kv, group=self.context,
                                 span=self.context * self.n) * (
                2 if backward else 1)                              # + their reduce-scatter
        return t

    # ---- collectives ----
    def _link(self, group: int) -> tuple[float, float]:
        p = self.profile
        if group <= p.devices_per_node:
            return p.intra_latency, p.intra_bandwidth
        return p.inter_latency, p.inter_bandwidth

    def collective(self, kind: str, full_bytes: float, group: int | None = None,
                   span: int | None = None, bucketed: bool = False) -> float:
        """Seconds for one collective over `group` ranks whose ranks lie `span` apart at most
        (decides intra-node or network); `bucketed`: one gradient among others in the
        runtime's buckets, paying its share (bytes / bucket_bytes) of a bucket's overhead and
        latency."""
        c = by_name(kind)
        if group is None:               # priced by its axis: its size and where its ranks lie
            g, span = self.axis_size(c.group), span or self.axis_span(c.group)
        else:
            g = group
        if g <= 1 or c.is_local or full_bytes == 0:
            return 0.0
        if self.profile.backend == "gloo" and c.gloo_fallback:
            return sum(self.collective(k, full_bytes, group, span, bucketed)
                       for k in c.gloo_fallback)
        alpha, bw = self._link(span or g)
        fixed = self.profile.collective_overhead + c.ring_rounds * (g - 1) * alpha
        if bucketed:
            fixed *= min(1.0, full_bytes / self.bucket_bytes)
        return fixed + c.ring_bytes(full_bytes, g) / bw

    def p2p(self, full_bytes: float, span: int) -> float:
        """Seconds to send `full_bytes` to the rank `span` ranks away (pipeline stages)."""
        if full_bytes == 0:
            return 0.0
        alpha, bw = self._link(span)
        return self.profile.collective_overhead + alpha + full_bytes / bw

    def transition(self, v: Value, src: Placement, want: Placement | None,
                   backward: bool, axis: str = "plan") -> tuple[float, list[str]]:
        """Seconds to turn `src` into `want` along mesh axis `axis` with insert_comm's
        collectives (forward, plus their backward duals when the value needs a gradient),
        and the forward kinds used."""
        steps = [c for c, _, _ in route(src, want, axis)]
        full = self.tokens_share(v, nbytes(v))
        on = {"group": self.axis_size(axis), "span": self.axis_span(axis)}   # duals too
        t = sum(self.collective(c.name, full, **on) for c in steps)
        if backward and self.training:
            t += sum(self.collective(c.dual, full, **on) for c in steps)
        return t, [c.name for c in steps]

    def grad_sync(self, v: Value) -> float:
        """Backward all-reduce of a replicated value's gradient whose users leave partial sums
        (sync_grad, or the runtime's sum over the plan unit for a parameter)."""
        if not self.training:
            return 0.0
        return self.collective(grad_sync_collective().dual, self.tokens_share(v, nbytes(v)),
                               bucketed=v.kind == PARAM)

    def gathered_sync(self, v: Value, src: Placement, want: Placement | None,
                      split_reader: bool) -> float:
        """What grad_sync leaves out for a *split* weight gathered for a split reader: its
        gradient is summed by the gather's own backward (a reduce-scatter per weight), not in
        the runtime's buckets, so it pays a collective's fixed cost of its own."""
        if not (self.training and split_reader and v.kind == PARAM and v.requires_grad
                and isinstance(want, Replicate) and not isinstance(src, Replicate)
                and self.n > 1):
            return 0.0
        full = self.collective(grad_sync_collective().dual, nbytes(v))
        return full - self.collective(grad_sync_collective().dual, nbytes(v), bucketed=True)

    def grad_reduce(self, param: Value, placement: Placement) -> float:
        """The runtime's data-parallel all-reduce of one parameter's local gradient."""
        split = self.context * (1 if param.name in self.experts else self.experts_split)
        if not (self.training and param.requires_grad) or self.dp * split <= 1:
            return 0.0
        return self.collective("all_reduce",
                               nbytes(param, placement, self.n) * self.param_share(param),
                               group=self.dp * split, span=self.dp * self.n * split,
                               bucketed=True)

    def optimizer_step(self, param: Value, placement: Placement, shards: int = 1) -> float:
        """Seconds of the optimizer's step on this rank's piece of `param` (a 1/`shards` share
        of its local piece under ZeRO); 0 when the profile has no optimizer timing."""
        p = self.profile
        if not (self.training and param.requires_grad) or p.optimizer_element_s is None:
            return 0.0
        elements = nbytes(param, placement, self.n) / param.meta.dtype.itemsize / shards
        scale = (2.0 + self.optimizer_state_bytes / 4.0) / 4.0
        return ((p.optimizer_tensor_s or 0.0) + elements * p.optimizer_element_s * scale) \
            * self.stretch

    # ---- memory ----
    def param_memory(self, v: Value, placement: Placement) -> float:
        local = nbytes(v, placement, self.n) * self.param_share(v)
        if not (self.training and v.requires_grad):
            return local
        return local * 2 + local / v.meta.dtype.itemsize * self.optimizer_state_bytes

    def activation_memory(self, op: Op, outputs) -> float:
        if not self.training or opname(op) in VIEWS or op.target_name.startswith("comm."):
            return 0.0
        return sum(nbytes(v, p, self.n) for v, p in zip(op.outputs, outputs)
                   if v.is_tensor and v.requires_grad) / self.token_split


# ---- a fixed plan's cost ----------------------------------------------------------------------
@dataclass
class StepEstimate:
    """Modelled seconds of one training step on one rank, by term, and bytes per rank."""
    compute: float = 0.0          # every op's compute (recomputed forwards included)
    comm: float = 0.0             # transitions (forward collectives and their duals), outputs
    grad_sync: float = 0.0        # backward sums over the plan unit of replicated values
    grad_reduce: float = 0.0      # the runtime's data-parallel reduction (ZeRO's collectives)
    optimizer: float = 0.0        # the optimizer step on local pieces
    memory: float = 0.0           # bytes per rank, as autodist's memory_limit counts them

    @property
    def total(self) -> float:
        return self.compute + self.comm + self.grad_sync + self.grad_reduce + self.optimizer

    def ms(self) -> dict[str, float]:
        out = {k: getattr(self, k) * 1e3 for k in
               ("compute", "comm", "grad_sync", "grad_reduce", "optimizer")}
        out["total"] = self.total * 1e3
        out["memory_gb"] = self.memory / 1e9
        return out


def _placed(g: Graph, v: Value) -> Placement:
    if v.producer is None and v.kind not in FREE_KINDS:
        return Replicate()                          # a user input arrives whole
    return v.placement if v.placement is not None else Replicate()


def step_cost(g: Graph, model: CostModel, recompute=(), memory=None,
              memory_model=None) -> StepEstimate:
    """Cost a planned graph (every op's `strategy` and every weight's `placement` set, before
    insert_comm) with the terms problem.py hands the ILP, summed per op, edge and weight
    instead of per decision. `recompute`: module patterns run under checkpointing; `memory`:
    a MemoryChoice whose ZeRO stage and offload change the weights' time and bytes (priced by
    `memory_model`, memory_model.py's MemoryModel)."""
    from ..recompute import recompute_region
    from nncompile.rules import replicated
    est = StepEstimate()
    mm = memory_model if memory is not None and (memory.zero or memory.offload_optimizer) \
        and model.training else None
    region = {id(op): recompute_region(op, recompute) for op in g.ops}
    handed = {id(v.producer) for op in g.ops for v in op.tensor_inputs()
              if region.get(id(v.producer)) not in (None, region[id(op)])}
    handed |= {id(v.producer) for v in g.outputs
               if isinstance(v, Value) and region.get(id(v.producer))}
    synced: dict[int, Value] = {}
    read: dict[int, Value] = {}
    for op in g.ops:
        if op.target_name.startswith("comm.") and op.target_name != "comm.cross_entropy_rows":
            raise ConfigError(f"estimate_step costs a plan before insert_comm; {op.name} is a "
                              f"{op.target_name} (cost the graph the plan pass returned)")
        s = op.strategy or replicated(op)
        t = model.compute(op, s.inputs, s.outputs)
        if region[id(op)]:
            t += model.compute(op, s.inputs, s.outputs) / 3.0
            if id(op) in handed:
                est.memory += model.activation_memory(op, s.outputs)
        else:
            est.memory += model.activation_memory(op, s.outputs)
        est.compute += t
        for i, v in enumerate(op.tensor_inputs()):
            if v.kind in FREE_KINDS:
                read[id(v)] = v
            est.comm += model.transition(v, _placed(g, v), s.inputs[i], v.requires_grad)[0]
            for axis, wants in s.axis_inputs.items():      # the mesh's other axes
                est.comm += model.transition(v, v.placement_on(axis), wants[i],
                                             v.requires_grad, axis)[0]
            est.grad_sync += model.gathered_sync(v, _placed(g, v), s.inputs[i], s.is_split)
            if isinstance(s.inputs[i], Replicate) and s.is_split and v.requires_grad \
                    and model.training and model.n > 1:
                synced[id(v)] = v
    est.grad_sync += sum(model.grad_sync(v) for v in synced.values())
    for v in read.values():
        p = _placed(g, v)
        if v.kind != PARAM:
            est.memory += nbytes(v, p, model.n)
        elif mm is None:
            est.memory += model.param_memory(v, p)
            est.grad_reduce += model.grad_reduce(v, p)
            est.optimizer += model.optimizer_step(v, p)
        else:
            est.memory += mm.state(v, p, memory).device
            est.grad_reduce += mm.param_time(v, p, memory)
            est.optimizer += mm.optimizer_time(v, p, memory)
    nupd = len(g.trace_info.buffer_updates)       # new buffer values: into the buffer's shard
    wants = [Replicate()] * (len(g.outputs) - nupd) + [
        _placed(g, b) for f in g.trace_info.buffer_updates for b in g.buffers if b.fqn == f]
    for v, want in zip(g.outputs, wants):
        if isinstance(v, Value) and v.is_tensor and (v.producer is not None
                                                     or v.kind in FREE_KINDS):
            est.comm += model.transition(v, _placed(g, v), want, False)[0]
    return est


def estimate_step(graph: Graph, config, profile=None) -> StepEstimate:
    """autodist's estimate of one training step of `graph` as planned by any policy: the graph
    the plan pass returned, costed for `config` (plan_ngpus, dp_size, parallel.device,
    optimizer, recompute_modules) or for `profile` (a DeviceProfile or its name/file).
    `estimate_step(g, config).total` equals the ILP objective when g is autodist's plan."""
    from . import cost_model
    from .memory_model import MemoryModel
    from .profiles import get_profile
    if graph.plan_state.pipeline is not None:
        raise ConfigError("estimate_step costs plans without pipeline stages; a pipelined "
                          "plan's stage times are in plan_state.pipeline.predicted_ms")
    model = cost_model(config, graph.plan_ngpus)   # the planned graph's tensor ranks
    if profile is not None:
        model.profile = get_profile(profile)
    memory = graph.plan_state.memory
    recompute = memory.recompute if memory is not None and memory.recompute else \
        config.parallel.recompute_modules or ()
    if recompute == "auto":
        recompute = ()
    return step_cost(graph, model, tuple(recompute), memory, MemoryModel.of(model, config, graph))
