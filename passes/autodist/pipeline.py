"""autodist under a pipeline: costs per layer and per stage, memory per pipeline rank.

Identical layers share the ILP's choices (problem.py): a choice's costs are summed over all of
its instances, wherever they run. A *group* of ops (one layer, one stage, the stages of one
pipeline rank) takes the share w[c] = (instances of choice c in the group) / (all instances)
of each choice's cost; a parameter (buffer, constant) counts in every group that reads it:

    micro-batch time(group) = sum_{op choices c} w[c] (compute + comm)[c, k_c]
                              + resharding on edges and gradient syncs into those choices,
                                weighted by the consumer's share
    step time(group)        = sum_{value choices c} w[c] comm[c, k_c]   (gradient reduction,
                                                                         ZeRO, once a step)
    state(group)            = sum_{value choices c} w[c] memory[c, k_c]
    activations(group)      = sum_{op choices c} w[c] memory[c, k_c]    (one micro-batch)

Per pipeline rank p the ILP's memory_limit becomes one constraint (Problem.groups):

    memory_limit_p: sum_c g_p[c] memory[c, k_c] + fixed + peaks <= mem_limit
    g_p[c] = share of p's stages in value choice c,  or
             sum_{stages s on p} w_s[c] x inflight(s)   for an op choice (activations of the
             micro-batches the schedule keeps in flight there: pipeline_stages.inflight)
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from nncompile.ir import FREE_KINDS, Graph, Op

from .ilp import solve_within
from .problem import Problem


def shares(g: Graph, prob: Problem, group_of: Callable[[int, Op], int | None], ngroups: int,
           value_group: Callable[[int], int] | None = None, nvalue: int = 0
           ) -> list[list[float]]:
    """w[group][choice]: each group's share of every choice (see the module docstring).
    `group_of(index, op)` names an op's group (None: none); g must be the graph `prob` was
    built on. With `value_group`, values count per value_group(group) instead (nvalue rows
    after the ngroups: e.g. a pipeline rank's, once however many of its stages read them)."""
    choices = prob.choices
    heads = {id(ch.ops[0]): c for c, ch in enumerate(choices) if ch.ops}
    w = [[0.0] * len(choices) for _ in range(ngroups + nvalue)]
    to_row = (lambda grp: grp) if value_group is None else \
        (lambda grp: ngroups + value_group(grp))
    readers: dict[int, set[int]] = {}
    free = _free_reads(g)
    for i, op in enumerate(g.ops):
        grp = group_of(i, op)
        if grp is None:
            continue
        c = heads.get(id(prob.canon[id(op)]))
        if c is not None:
            w[grp][c] += 1.0 / choices[c].count
        for v in free.get(i, ()):
            readers.setdefault(id(v), set()).add(to_row(grp))
    for v in g.params + g.buffers + g.consts:
        c = prob.choice_of.get(id(prob.vcanon[id(v)]))
        if c is None or id(v) not in readers:
            continue
        for row in readers[id(v)]:
            w[row][c] += 1.0 / choices[c].count
    return w


_FREE_READS: list = [None, None]      # (graph, its reads): the last graph asked about


def _free_reads(g: Graph) -> dict[int, list]:
    """{op index: the parameters, buffers and constants it reads} (cached for the last graph:
    shares runs several times on one graph)."""
    if _FREE_READS[0] is not g or len(_FREE_READS[1][0]) != len(g.ops):
        reads = {i: [v for v in op.inputs() if v.kind in FREE_KINDS]
                 for i, op in enumerate(g.ops)}
        _FREE_READS[:] = [g, (list(g.ops), {i: r for i, r in reads.items() if r})]
    ops, reads = _FREE_READS[1]
    if any(a is not b for a, b in zip(ops, g.ops)):       # ops replaced in place: recompute
        _FREE_READS[0] = None
        return _free_reads(g)
    return reads


def group_costs(prob: Problem, picks: list[int], w: list[float]
                ) -> tuple[float, float, float, float]:
    """(micro-batch seconds, step seconds, state bytes, activation bytes) of one group."""
    micro = step = state = act = 0.0
    for c, ch in enumerate(prob.choices):
        if not w[c]:
            continue
        k = picks[c]
        if ch.value is None:
            micro += w[c] * (ch.compute[k] + ch.comm[k])
            act += w[c] * ch.memory[k]
        else:
            step += w[c] * (ch.compute[k] + ch.comm[k])
            state += w[c] * ch.memory[k]
    for (a, b), table in prob.pairs.items():
        if w[b]:
            micro += w[b] * table[picks[a]][picks[b]]
    for seconds, readers in prob.syncs:
        active = [b for b, opts in readers if picks[b] in opts]
        if active:
            micro += w[active[0]] * seconds
    return micro, step, state, act


def rank_groups(g: Graph, prob: Problem, pipeline, inflight: Callable[[int], float]
                ) -> list[list[float]]:
    """Problem.groups for a pipelined graph: per pipeline rank, the weight of each choice's
    memory (see the module docstring); op.stage must be set."""
    from nncompile.pipeline_config import PipelineConfig
    cfg = PipelineConfig(pipeline.ranks, pipeline.schedule, pipeline.microbatches,
                         pipeline.stages_per_rank)
    rank_of = {s: p for p in range(pipeline.ranks) for s in cfg.stage_ids(p, pipeline.ranks)}
    k = pipeline.nstages
    w = shares(g, prob, lambda i, op: _stage(op, k), k, rank_of.__getitem__, pipeline.ranks)
    out = []
    for p in range(pipeline.ranks):
        row = []
        for c, ch in enumerate(prob.choices):
            if ch.value is not None:
                row.append(w[k + p][c])
            else:
                row.append(sum(w[s][c] * inflight(s) for s in cfg.stage_ids(
                    p, pipeline.ranks)))
        out.append(row)
    return out


def _stage(op: Op, k: int) -> int:
    """An op's stage (ops the cut did not see, e.g. collectives, count in the last)."""
    return op.stage if op.stage is not None and op.stage < k else k - 1


def stage_costs(g: Graph, prob: Problem, picks: list[int], nstages: int,
                inflight: Callable[[int], float]
                ) -> tuple[list[float], list[float], list[float]]:
    """Per stage: predicted milliseconds (forward + backward of one micro-batch), bytes
    (state + in-flight activations) and seconds per step (gradient reduction) of the plan
    `picks`."""
    w = shares(g, prob, lambda i, op: _stage(op, nstages), nstages)
    ms, mem, step = [], [], []
    for s in range(nstages):
        micro, per_step, state, act = group_costs(prob, picks, w[s])
        ms.append(micro * 1e3)
        mem.append(state + act * inflight(s) + prob.fixed_memory)
        step.append(per_step)
    return ms, mem, step


@dataclasses.dataclass
class LayerCosts:
    """What the cut needs from a plan at T tensor-parallel ranks, per group of ops (the
    layers, then the ops before the first one, then those after the last)."""
    time: list[float]           # seconds per micro-batch
    step: list[float]           # seconds per step (gradient reduction)
    state: list[float]          # bytes: parameters, gradients, optimizer state
    activations: list[float]    # bytes: one micro-batch
    lean_state: list[float]     # the same for the plan needing the least memory
    lean_activations: list[float]
    objective: float            # the plan's modelled step time (whole graph, one micro-batch)
    solver_seconds: float


def layer_costs(g: Graph, prob: Problem, group: list[int], ngroups: int,
                time_limit: float) -> LayerCosts:
    """Solve `prob` (the fastest plan, no memory limit) and cost it per group of ops;
    `group[i]` is op i's group."""
    from .memory_model import leanest_picks
    sol = solve_within(prob, None, time_limit)
    w = shares(g, prob, lambda i, op: group[i], ngroups)
    fast = [group_costs(prob, sol.picks, row) for row in w]
    lean_picks = leanest_picks(prob)
    lean = [group_costs(prob, lean_picks, row) for row in w]
    return LayerCosts([x[0] for x in fast], [x[1] for x in fast], [x[2] for x in fast],
                      [x[3] for x in fast], [x[2] for x in lean], [x[3] for x in lean],
                      sol.objective, sol.seconds)
