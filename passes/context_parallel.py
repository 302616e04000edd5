"""context_parallel: place the program along the `cp` mesh axis, the sequence split.

With `parallel=ParallelSpec(cp=C)` each plan unit is C context ranks x plan_ngpus // C
tensor ranks (the plan pass planned the tensor axis). Every rank of a context group gets the
unit's whole batch; the program splits the inputs along the sequence (dim 1 of each input
shaped [batch, seq, ...]) and every token-wise op runs on its rank's T/C positions.
Attention keeps its query rows and reads every key and value (nncompile/rules/sequence.py:
k and v all-gathered along cp, their gradients reduce-scattered; a causal mask shifted by the
rows before the rank's), or, with `"context_parallel_attention": "ulysses"` where the heads
(and k/v heads) divide by C, runs on C-th of the heads over the whole sequence (q, k, v
all-to-all from sequence to heads, the output back: DeepSpeed-Ulysses); the mean loss divides
each rank's sum by the global count of targets. Parameters stay whole along cp; their
gradients are partial sums over it, summed by the runtime (plan_state.axis_partial_grad).

Before (planned on the plan axis):           After (along cp, C = 2):
    emb = aten.embedding.default(w, ids)         emb = ...   # f32[2, 64, 32] R @cp=S(1)
    ...                                          (ids wants S(1) along cp: insert_comm chunks it)
    y = aten.scaled_dot_product_attention...     y = ...     # [rows: split q's rows, ...]

How: a greedy walk over the ops (passes/policies/greedy.py's engine) on a scratch copy of
the graph, seeded with the inputs' sequence dims, keeps every op on the sequence split where a
rule allows it; random ops and parameters stay whole along cp. A choice that would split a dim
the tensor plan splits, or that needs a local implementation where the tensor plan already
uses one, is not taken. A random op (dropout) splits along cp only where the tensor plan
does not split it: it then draws the whole tensor's mask on every rank and keeps its piece
(runtime/program/rng.py), as along the plan axis. In the zigzag order every split divides into 2C
pieces, and a value moved from one split to another is gathered and chunked again (an
all-to-all would hand out contiguous pieces). A mixture-of-experts layer's split experts
(comm.local_experts) need every token of the unit: along cp they stay whole.
Precondition: plan. Idempotent: yes.
"""
from __future__ import annotations

import dataclasses
import math

from nncompile.errors import ConfigError
from nncompile.ir import PARAM, Graph, Partial, Replicate, Shard, Stage, StridedShard
from nncompile.mesh import CP
from nncompile.rules import RANDOM_LOCAL, draws_random, strategies, strided_splits
from nncompile.rules.sequence import sequence_strategies

from .dropped import drop
from .policies.greedy import Walk, take_best


ALLGATHER, ULYSSES = "allgather", "ulysses"       # parallel.cp_attention
ZIGZAG, CONTIGUOUS = "zigzag", "contiguous"       # parallel.cp_order


def order_of(attention: str, order: str | None) -> str:
    """The sequence order along cp: the one asked for, else zigzag under allgather attention
    (balanced causal work) and contiguous under Ulysses."""
    return order or (ZIGZAG if attention == ALLGATHER else CONTIGUOUS)


def sequence_dims(g: Graph) -> dict[int, int]:
    """{id(input): 1} for the inputs shaped [batch, seq, ...] (dim 1 the length of the first
    input's dim 1)."""
    shaped = [v for v in g.inputs if v.is_tensor and len(v.meta.shape) >= 2]
    if not shaped:
        return {}
    seq = shaped[0].meta.shape[1]
    return {id(v): 1 for v in shaped if v.meta.shape[1] == seq}


def _rank(walk: Walk, op, s, attention: str) -> int | None:
    """Smaller is preferred; None: not allowed along cp."""
    if any(v.kind == PARAM and not isinstance(p, Replicate)
           for v, p in zip(op.tensor_inputs(), s.inputs)):
        return None                              # parameters stay whole along cp
    if s.local_target == "comm.local_experts":
        return None                              # experts need every token of the unit
    if _is_attention(op) and attention == ULYSSES and s.note.startswith("split heads"):
        return 0                                 # all-to-all: heads <-> sequence
    if walk.is_batch_split(op, s) or s.note.startswith("rows"):
        return 0 if attention == ALLGATHER or not _is_attention(op) else 1
    if s.is_split and all(isinstance(p, Partial) for p in s.outputs):
        return 0                                 # keep a partial sum (the loss)
    return 1 if not s.is_split else None


def _conflicts(op, plan, s, zigzag: bool = False) -> bool:
    """`s` (along cp) splits an input dim the tensor plan splits, needs a local
    implementation where the plan uses one, or splits a random op that the plan splits too
    or that has no full-draw local implementation (rng.py)."""
    if s.local_target is not None and plan.local_target is not None:
        return True
    if s.is_split and draws_random(op) and (
            zigzag or plan.is_split or getattr(op.target, "_opname", "") not in RANDOM_LOCAL or
            any(isinstance(p, StridedShard) or not isinstance(p, Shard) for p in s.outputs)):
        return True
    return any(isinstance(a, Shard) and isinstance(b, Shard) and a.dim == b.dim
               for a, b in zip(plan.inputs, s.inputs))


def _is_attention(op) -> bool:
    return getattr(op.target, "_opname", "") == "scaled_dot_product_attention"


class SequenceWalk(Walk):
    """The greedy walk with the sequence dim as the dim it keeps split."""

    def __init__(self, graph: Graph):
        super().__init__(graph)
        self.batch_dim = sequence_dims(graph)
        self.placed |= {id(v) for v in graph.params + graph.buffers + graph.consts}

    def apply(self, op, s, candidates) -> None:
        super().apply(op, s, candidates)
        if _is_attention(op) and s.is_split:    # its output goes on along the sequence:
            out = op.outputs[0]                  # rows stay split, heads go back (all-to-all)
            self.batch_dim[id(out)] = len(out.meta.shape) - 2


def sequence_walk(scratch: Graph, c: int, attention: str, zigzag: bool, plan_of=None) -> dict:
    """{op name: its strategy along cp}: the walk the module docstring describes, on
    `scratch` (placements reset to Replicate, modified). `plan_of(name)`: the tensor plan's
    strategy of an op, whose splits the walk does not cross (None: not planned yet)."""
    walk = SequenceWalk(scratch)
    out = {}
    for op in scratch.ops:
        with strided_splits():
            candidates = strategies(op, c) + sequence_strategies(op, c)
        plan = plan_of(op.name) if plan_of is not None else None

        def rank(s, op=op, plan=plan):
            if plan is not None and _conflicts(op, plan, s, zigzag) or \
                    zigzag and not _splits_evenly(op, s, 2 * c):
                return None
            return _rank(walk, op, s, attention)
        out[op.name] = take_best(walk, op, candidates, rank)
    return out


def _splits_evenly(op, s, pieces: int) -> bool:
    """Every dim `s` splits divides into `pieces` (the zigzag order's 2C chunks)."""
    for v, p in zip(op.tensor_inputs() + [o for o in op.outputs if o.is_tensor],
                    tuple(s.inputs) + tuple(s.outputs)):
        if isinstance(p, Shard) and type(v.meta.shape[p.dim]) is int and \
                v.meta.shape[p.dim] % (pieces * getattr(p, "outer", 1)):
            return False
    return True


def sequence_splits(graph: Graph, c: int, spec) -> dict:
    """{op name: its strategy along cp} before the tensor plan: what autodist keeps clear of
    (plan_filter) so that every op it prices at 1/C of the sequence does split along cp."""
    attention = spec.cp_attention
    zigzag = order_of(attention, spec.cp_order) == ZIGZAG
    scratch = graph.clone()
    for v in scratch.values():
        v.placement, v.axes = Replicate(), {}
    return sequence_walk(scratch, c, attention, zigzag) if sequence_dims(scratch) else {}


def plan_filter(op, candidates: list, along) -> list:
    """The tensor plan's candidates for `op` that split no dim its split along cp (`along`)
    splits and need no local implementation where that one does (all of them where none is
    left)."""
    if along is None or not along.is_split:
        return candidates
    kept = [s for s in candidates if not _conflicts(op, s, along)]
    return kept or candidates


class ContextParallel:
    """The pass (see the module docstring)."""
    name = "context_parallel"
    requires = (Stage.PLANNED,)
    produces = ()

    def __init__(self, ranks: int | str, attention: str = ALLGATHER, order: str | None = None):
        self.ranks = ranks              # "auto": the C autodist chose (graph.axes["cp"])
        self.attention = attention
        self.order = order_of(attention, order)

    def __call__(self, graph: Graph) -> Graph:
        if any(CP in op.strategy.axis_inputs for op in graph.ops):
            return graph                         # placed along cp already
        c = graph.axes.get(CP, 1) if self.ranks == "auto" else self.ranks
        if c == 1:
            return graph                         # autodist chose no context parallelism
        g = graph.clone()
        g.axes = {CP: c, **{a: s for a, s in g.axes.items() if a != CP}}
        scratch = graph.clone()                  # placements along cp, walked on full shapes
        for v in scratch.values():
            v.placement, v.axes = Replicate(), {}
        if not sequence_dims(scratch):
            raise ConfigError(f"parallel.cp={c} splits the sequence, but "
                              f"{g.trace_info.model}.forward has no input shaped [batch, seq, "
                              "...]; pass token ids (or embeddings) batch-first")
        seq = next(v.meta.shape[1] for v in scratch.inputs if id(v) in sequence_dims(scratch))
        pieces = 2 * c if self.order == ZIGZAG else c
        if type(seq) is int and seq % pieces:
            raise ConfigError(f"parallel.cp={c} splits the sequence into "
                              f"{pieces} pieces ({self.order} order), but it is {seq} long; use "
                              f"a sequence length that is a multiple of {pieces}")
        if self.order == ZIGZAG:
            g.plan_state.zigzag_axes = (*g.plan_state.zigzag_axes, CP)
        name = seq.code() if type(seq) is not int else None
        if name in g.trace_info.sizes:           # a dynamic length: a multiple of the pieces
            lo, hi, mult = g.trace_info.sizes[name]
            g.trace_info = dataclasses.replace(g.trace_info, sizes={
                **g.trace_info.sizes, name: (lo, hi, math.lcm(mult, pieces))})
        plan = {op.name: op.strategy for op in g.ops}
        along = sequence_walk(scratch, c, self.attention, self.order == ZIGZAG, plan.get)
        place_along(g, CP, along)
        _check_even(g, c)
        _report_whole_attention(g, c, pieces, seq, self.order)
        return g


def _report_whole_attention(g: Graph, c: int, pieces: int, seq, order: str) -> None:
    """Attention ops the walk could not split along cp run on the whole sequence on every
    context rank: say which, and why (passes/dropped.py)."""
    attention = [op for op in g.ops if _is_attention(op)]
    whole = [op for op in attention if CP not in op.outputs[0].axes]
    if not whole:
        return
    op = whole[0]
    length = op.args[0].meta.shape[-2]
    where = f"{op.name}" + (f" ({op.source})" if op.source else "")
    if type(length) is int and length % pieces:
        reason = (f"its sequence is {length} long inside the model (the inputs' is {seq}), "
                  f"which does not split into {pieces} pieces ({order} order)")
        fix = (f"make the sequence inside the model a multiple of {pieces} (for prompt "
               f"tuning: inputs shorter by the prompt length, or a prompt of a length that "
               f"keeps the total a multiple), or drop context_parallel")
    else:
        gather = _first_gather(g)
        reason = ("the sequence split does not reach it" + (
            f": {gather.name} ({gather.source}) gathers the sequence" if gather else ""))
        fix = "keep the sequence dim through to attention, or drop context_parallel"
    drop(g, f"parallel.cp={c}",
         f"{len(whole)} of {len(attention)} attention op(s) run on the whole sequence on every "
         f"context rank, the first {where}", reason, fix)


def _first_gather(g: Graph):
    """The first op that reads a value split along cp and splits none of its outputs."""
    for op in g.ops:
        if any(CP in v.axes for v in op.tensor_inputs()) and \
                not any(CP in v.axes for v in op.outputs if v.is_tensor):
            return op
    return None


def place_along(g: Graph, axis: str, along: dict) -> None:
    """Give every op of `g` its strategy along mesh `axis` (`along`: {op name: strategy}, a
    walk's): what it wants of its inputs there, its local implementation there, and its
    outputs' placements along it."""
    for op in g.ops:
        best = along[op.name]
        op.strategy.axis_inputs = {**op.strategy.axis_inputs, axis: best.inputs}
        if best.local_target is not None:
            op.strategy.axis_local = (axis, best.local_target)
        for v, p in zip(op.outputs, best.outputs):
            if v.is_tensor and not isinstance(p, Replicate):
                v.axes = {**v.axes, axis: p}


def _check_even(g: Graph, c: int) -> None:
    """Every split along cp divides evenly (the sequence by C, or 2C in the zigzag order,
    strided blocks too)."""
    if CP in g.plan_state.zigzag_axes:
        c *= 2
    for v in g.values():
        p = v.axes.get(CP)
        if isinstance(p, Shard) and type(v.meta.shape[p.dim]) is int and \
                v.meta.shape[p.dim] % (c * getattr(p, "outer", 1)):
            blocks = f" (in blocks of {p.outer})" if isinstance(p, StridedShard) else ""
            raise ConfigError(
                f"{v.name} {list(v.meta.shape)} splits dim {p.dim} along cp into {c}, which "
                f"does not divide it{blocks}; use a sequence length that is a multiple of {c}")
