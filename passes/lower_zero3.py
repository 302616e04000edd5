"""lower_zero3: ZeRO-3's parameter gathers, prefetches and frees as ops of the IR.

Under use_zero=3 each rank holds 1/dp of every parameter, one flat shard per unit. The
program gathers a unit's parameters right before their first use, starts the next unit's
gather while it computes, and frees the gathered parameters after their last use. The
gather's backward reduce-scatters their gradients (runtime/store/zero.py); backward gathers a freed
unit again.

Before (use_zero=1: parameters are there all along):
    layer_norm = aten.layer_norm.default(x, [32], h_0_ln_w, h_0_ln_b)
    ...
After:
    zero.prefetch('zero_h_0', 'h.0')
    ...
    zero.gather('zero_h_0', 'h.0', [h_0_ln_w, h_0_ln_b, h_0_fc_w])
    zero.prefetch('zero_h_1', 'h.1')                  # the next unit's gather starts now
    layer_norm = aten.layer_norm.default(x, [32], h_0_ln_w, h_0_ln_b)
    ...
    zero.free('zero_h_0', 'h.0', [h_0_ln_w, h_0_ln_b, h_0_fc_w])   # after the unit's last use

A unit is a block of a ModuleList (the path up to its first numeric component, like
`transformer.h.3`), else the module owning the parameter; its parameters are split further by
dtype, trainability and placement so that one flat tensor has one reduction. A unit used only
inside one recomputed region (op.recompute) is gathered inside it (the gather op gets the
region's mark), so backward's recompute gathers it again; prefetches run outside regions
only, and a unit whose parameter is returned is never freed. Under a pipeline each stage
gathers what it uses (units are per pipeline rank: `plan_state.zero_units`). The eval program
reuses the training program's units (seeded in plan_state.zero_units). Under float8 it also
records the weights the units gather in float8 (plan_state.zero_float8: read only by float8
linears; passes/float8.py zero3_float8_gathers). Precondition:
localize (and split_stages under a pipeline); before lower_recompute. Idempotent: yes.
"""
from __future__ import annotations

from typing import Any

from nncompile.ir import Graph, Op, Stage, Value
from .contract import config_of
from .float8 import zero3_float8_gathers
from .split_stages import SEND, STAGE


def unit_path(fqn: str) -> str:
    """`transformer.h.3.attn.c_attn.weight` -> `transformer.h.3`; `lm_head.weight` ->
    `lm_head`; a root parameter `scale` -> `root`."""
    parts = fqn.split(".")
    for i, p in enumerate(parts[:-1]):
        if p.isdigit():
            return ".".join(parts[:i + 1])
    return ".".join(parts[:-1]) or "root"


def zero_units(ops: list[Op], params: list[Value], partial_grad: list[str],
               axis_partial: dict[str, list[str]] | None = None
               ) -> list[tuple[str, str, tuple[str, ...]]]:
    """(flat attribute, unit path, parameter names) of `params` in order of first use by
    `ops`; parameters no op uses come last. One unit's parameters share dtype, trainability,
    placement and the axes their gradients are summed over (`partial_grad`, `axis_partial`)."""
    first: dict[int, int] = {}
    for i, op in enumerate(ops):
        for v in op.inputs():
            first.setdefault(id(v), i)
    partial = set(partial_grad)
    groups: dict[tuple, list[Value]] = {}
    for v in sorted(params, key=lambda v: first.get(id(v), len(ops))):
        key = (unit_path(v.fqn), str(v.meta.dtype), v.requires_grad,
               type(v.placement).__name__, v.name in partial,
               tuple(a for a, names in (axis_partial or {}).items() if v.name in names))
        groups.setdefault(key, []).append(v)
    out, taken = [], set()
    for key, values in groups.items():
        base = "zero_" + "".join(c if c.isalnum() else "_" for c in key[0])
        attr, k = base, 1
        while attr in taken:
            attr, k = f"{base}_{k}", k + 1
        taken.add(attr)
        out.append((attr, key[0], tuple(v.name for v in values)))
    return out


def runs_of(ops: list[Op]) -> list[tuple[Any, list[Op]]]:
    """`ops` in maximal runs of one recompute mark (None: not recomputed)."""
    runs: list[tuple[Any, list[Op]]] = []
    for op in ops:
        if runs and runs[-1][0] == op.recompute:
            runs[-1][1].append(op)
        else:
            runs.append((op.recompute, [op]))
    return runs


def lower_body(ops: list[Op], outputs: list, units, by_name: dict[str, Value]) -> list[Op]:
    """One program's ops (the forward, or one stage) with its units' zero.* ops added."""
    unit_of = {name: u for u, (_, _, names) in enumerate(units) for name in names}
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for i, op in enumerate(ops):
        for v in op.inputs():
            u = unit_of.get(v.name) if v.kind == "param" else None
            if u is not None:
                first.setdefault(u, i)
                last[u] = i
    for v in outputs:
        if isinstance(v, Value) and v.kind == "param" and v.name in unit_of:
            last[unit_of[v.name]] = len(ops)          # returned: never freed here
    runs = runs_of(ops)
    run_of = [r for r, (_, run) in enumerate(runs) for _ in run]
    order = sorted(first, key=first.get)
    nxt = {u: order[k + 1] for k, u in enumerate(order[:-1])}
    inside = {u for u in order if runs[run_of[first[u]]][0] is not None and
              last[u] < len(ops) and run_of[first[u]] == run_of[last[u]]}

    def marker(kind: str, u: int, with_params: bool = True, mark=None) -> Op:
        attr, path, names = units[u]
        args = (attr, path, [by_name[n] for n in names]) if with_params else (attr, path)
        op = Op(f"zero.{kind}", args, {}, [])
        op.recompute = mark
        return op

    def prefetch(u: int | None) -> list[Op]:
        return [] if u is None else [marker("prefetch", u, with_params=False)]

    starts: dict[int, list[int]] = {}
    ends: dict[int, list[int]] = {}
    for u in order:
        starts.setdefault(first[u], []).append(u)
        if last[u] < len(ops):
            ends.setdefault(last[u], []).append(u)
    out = prefetch(order[0]) if order else []
    i = 0
    for mark, run in runs:
        if mark is None:
            for op in run:
                for u in starts.get(i, []):
                    out += [marker("gather", u)] + prefetch(nxt.get(u))
                out.append(op)
                out += [marker("free", u) for u in ends.get(i, [])]
                i += 1
            continue
        before, body, lo = [], [], i
        for op in run:
            for u in starts.get(i, []):
                if u in inside:              # gathered in the region: recompute gathers it again
                    before += prefetch(nxt.get(u))
                    body.append(marker("gather", u, mark=mark))
                else:
                    before += [marker("gather", u)] + prefetch(nxt.get(u))
            body.append(op)
            i += 1
        out += before + body
        out += [marker("free", u) for k in range(lo, i) for u in ends.get(k, [])
                if u not in inside]
    return out


def memory_of(g: Graph, config: Any) -> MemoryChoice:
    """The plan's ZeRO stage and offload, as the plan pass decided them (plan_state.memory;
    passes/plan.py decide_memory), for a graph it planned; else what it would decide."""
    from .plan import decide_memory
    return g.plan_state.memory or decide_memory(g, config)


class LowerZero3:
    """The pass (see the module docstring); in the pipeline only where the config's memory
    fields shape the code (use_zero=3 or "auto")."""
    name = "lower_zero3"
    requires = (Stage.LOCALIZED,)
    produces = (Stage.ZERO3_LOWERED,)
    quiet_when_unchanged = True     # not ZeRO-3 ("auto" chose less): not in the history

    def __call__(self, graph: Graph) -> Graph:
        if Stage.ZERO3_LOWERED in graph.stages:
            return graph
        seeded = graph.plan_state.zero_units
        if seeded is None and memory_of(graph, config_of(graph, self.name)).zero != 3:
            return graph
        g = graph.clone()
        by_name = {v.name: v for v in g.params}
        g.plan_state.zero_float8 = zero3_float8_gathers(g)
        if g.plan_state.pipeline is None:
            units = seeded or {0: zero_units(g.ops, g.params, g.plan_state.partial_grad_params,
                                             g.plan_state.axis_partial_grad)}
            g.ops = lower_body(g.ops, g.outputs, units[0], by_name)
        else:
            units = seeded or pipeline_units(g)
            g.ops = _lower_stages(g, units, by_name)
        g.plan_state.zero_units = units
        g.stages = g.stages | {Stage.ZERO3_LOWERED}
        return g


def _stage_ids(g: Graph) -> dict[int, int]:
    """{stage: the pipeline rank that runs it}."""
    from nncompile.pipeline_config import PipelineConfig
    pp = g.plan_state.pipeline
    cfg = PipelineConfig(pp.ranks, pp.schedule, pp.microbatches, pp.stages_per_rank)
    return {s: p for p in range(pp.ranks) for s in cfg.stage_ids(p, pp.ranks)}


def pipeline_units(g: Graph) -> dict[int, list]:
    """Each pipeline rank's units: of the parameters its stages use, by first use there."""
    from .split_stages import stage_views
    pipe_of = _stage_ids(g)
    ops: dict[int, list[Op]] = {}
    for s, sg in enumerate(stage_views(g)):
        ops.setdefault(pipe_of[s], []).extend(op for op in sg.ops if not op.is_structural)
    out = {}
    for p, pops in sorted(ops.items()):
        used = {id(v) for op in pops for v in op.inputs()}
        out[p] = zero_units(pops, [v for v in g.params if id(v) in used],
                            g.plan_state.partial_grad_params)
    return out


def _lower_stages(g: Graph, units: dict[int, list], by_name: dict[str, Value]) -> list[Op]:
    """The split graph's stages, each lowered with its pipeline rank's units."""
    pipe_of = _stage_ids(g)
    out, body = [], None
    for op in g.ops:
        t = op.target if isinstance(op.target, str) else ""
        if t == STAGE:
            out.append(op)
            body = []
        elif t == SEND:
            out += lower_body(body, list(op.args[1]), units[pipe_of[op.args[0]]], by_name)
            out.append(op)
            body = None
        else:
            body.append(op)
    return out
