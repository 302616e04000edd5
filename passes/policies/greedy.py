"""The engine behind the built-in `data` and `tp` policies: one walk over the ops in order,
each op taking the cheapest legal strategy its policy ranks first.

Costs are communication volume in elements, each collective's `greedy_weight` in
nncompile/collectives.py: all_reduce 2, all_gather / reduce_scatter / all_to_all 1, chunk and
to_partial ~0. A parameter, buffer or constant takes the placement its
first user asks for (a partial request leaves it replicated).
"""
from __future__ import annotations

from typing import Callable

from nncompile.collectives import route
from nncompile.ir import FREE_KINDS, PARAM, Graph, Op, Partial, Replicate, Shard, Strategy, \
    Value
from nncompile.rules import strategies


def transition_cost(src, dst) -> float:
    """Relative volume of the collectives that turn `src` into `dst` (insert_comm's route)."""
    return sum((c.greedy_weight for c, _, _ in route(src, dst)), 0.0)


class Walk:
    """State of a greedy walk: which free inputs are placed, and each value's batch dim."""

    def __init__(self, graph: Graph):
        self.placed: set[int] = {id(v) for v in graph.inputs}
        self.batch_dim: dict[int, int] = {id(v): 0 for v in graph.inputs
                                          if v.is_tensor and len(v.meta.shape) >= 1}

    def is_free(self, v: Value) -> bool:
        return v.kind in FREE_KINDS and id(v) not in self.placed

    def cost(self, op: Op, s: Strategy) -> float:
        total = 0.0
        for v, want in zip(op.tensor_inputs(), s.inputs):
            if not self.is_free(v):
                total += transition_cost(v.placement, want) * v.meta.numel
        return total

    def is_batch_split(self, op: Op, s: Strategy) -> bool:
        """Every input that carries the batch dim is split on it (and at least one does)."""
        carriers = [(v, p) for v, p in zip(op.tensor_inputs(), s.inputs)
                    if id(v) in self.batch_dim]
        return bool(carriers) and all(p == Shard(self.batch_dim[id(v)]) for v, p in carriers)

    def shards_param(self, op: Op, s: Strategy) -> bool:
        return any(v.kind == PARAM and isinstance(p, Shard)
                   for v, p in zip(op.tensor_inputs(), s.inputs))

    def apply(self, op: Op, s: Strategy, candidates: list[Strategy]) -> None:
        op.strategy = s
        for v, want in zip(op.tensor_inputs(), s.inputs):
            if self.is_free(v):
                v.placement = want if isinstance(want, Shard) else Replicate()
                self.placed.add(id(v))
        for v, p in zip(op.outputs, s.outputs):
            v.placement = p if v.is_tensor else Replicate()
        for c in candidates:          # the outputs' batch dims, whatever strategy was taken
            if self.is_batch_split(op, c):
                for v, p in zip(op.outputs, c.outputs):
                    if v.is_tensor and isinstance(p, Shard):
                        self.batch_dim[id(v)] = p.dim
                break


Rank = Callable[[Walk, Op, Strategy], int | None]   # smaller is preferred; None: not allowed


def take_best(walk: Walk, op: Op, candidates: list[Strategy], rank) -> Strategy:
    """Apply and return the candidate `rank(s)` prefers (then the cheapest, then the first);
    the last (replicate) where it allows none."""
    scored = []
    for i, s in enumerate(candidates):
        if s.note == "keep partial" and not any(
                isinstance(v.placement, Partial) for v in op.tensor_inputs()):
            continue                      # partial sums are kept, never started, by an op
        r = rank(s)
        if r is not None:
            scored.append((r, walk.cost(op, s), i, s))
    best = min(scored)[3] if scored else candidates[-1]
    walk.apply(op, best, candidates)
    return best


def greedy(graph: Graph, n: int, rank: Rank) -> Graph:
    g = graph.clone()
    g.plan_ngpus = n
    walk = Walk(g)
    for op in g.ops:
        take_best(walk, op, strategies(op, n), lambda s: rank(walk, op, s))
    return g
