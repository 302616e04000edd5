"""recompute: mark ops of `recompute_modules` for activation checkpointing.

Before (recompute_modules=["Block"]):          After (codegen wraps each marked run):
    h = aten.layer_norm.default(x, ...)            def _recompute_transformer_h_0(x):
    y = aten.linear.default(h, w)                      h = aten.layer_norm.default(x, ...)
                                                       return aten.linear.default(h, w)
                                                   y = checkpoint(_recompute_transformer_h_0, x)

A pattern names a module class (`Block`) or a module path glob (`transformer.h.*`); an op
belongs to the outermost module instance that matches; `recompute_modules="auto"` takes the
patterns autodist chose, `graph.plan_state.memory.recompute` (possibly none). Consecutive
ops of one instance form a region; codegen runs it under
`torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`, so its activations are
recomputed in backward instead of kept. Precondition: insert_comm (the
collectives inside a region are recomputed with it). Idempotent: yes.
"""
from __future__ import annotations

import fnmatch

from nncompile.errors import ConfigError
from nncompile.ir import Graph, Op, RecomputeMark, Stage

AUTO = "auto"


def recompute_region(op: Op, patterns) -> str | None:
    """The module path of the outermost recomputed module instance `op` runs in, if any."""
    if not patterns:
        return None
    for path, cls in op.module_stack:
        for pat in patterns:
            if cls == pat or fnmatch.fnmatchcase(path, pat):
                return path
    return None


class Recompute:
    name = "recompute"
    requires = (Stage.COMM_INSERTED,)
    produces = (Stage.RECOMPUTE_MARKED,)

    def __init__(self, patterns):
        self.patterns = AUTO if patterns == AUTO else list(patterns or [])

    def patterns_for(self, graph: Graph) -> list[str]:
        """The patterns to mark: the given ones, or for "auto" the plan's choice."""
        if self.patterns != AUTO:
            return self.patterns
        memory = graph.plan_state.memory
        if memory is None:
            raise ConfigError("recompute_modules='auto' is chosen by autodist with the plan, "
                              f"but the plan (policy {graph.plan_state.policy!r}) made no "
                              "choice; pass pas_policy='autodist' or a list of modules")
        return list(memory.recompute)

    def __call__(self, graph: Graph) -> Graph:
        g = graph.clone()
        ops = g.ops
        patterns = self.patterns_for(g)
        is_comm = [op.target_name.startswith("comm.") for op in ops]
        marks = [None if c else recompute_region(op, patterns)
                 for op, c in zip(ops, is_comm)]
        # a collective sits inside a region when the ops on both sides of it do
        prev = None
        for i, op in enumerate(ops):
            if not is_comm[i]:
                prev = marks[i]
                continue
            nxt = next((marks[j] for j in range(i + 1, len(ops)) if not is_comm[j]), None)
            marks[i] = prev if prev is not None and prev == nxt else None
        regions, last = 0, None
        for op, mark in zip(ops, marks):
            if mark is not None and mark != last:
                regions += 1
            op.recompute = None if mark is None else RecomputeMark(mark, regions)
            last = mark
        g.plan_state.recompute_regions = regions
        g.stages = g.stages | {Stage.RECOMPUTE_MARKED}
        return g
