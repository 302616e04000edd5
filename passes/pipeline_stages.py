"""pipeline_stages: cut the forward into S x V pipeline stages at layer boundaries.

Before (parallel.pp=2, a 4-block GPT):         After:
    wte = aten.embedding(...)          # transformer.wte        stage 0
    ... transformer.h.0 ... h.1 ...                              stage 0
    ... transformer.h.2 ... h.3 ...                              stage 1
    logits = aten.linear(...); loss = ...  # lm_head             stage 1

A layer is a block of a ModuleList (the module path up to its first numeric component, e.g.
`transformer.h.3`). Ops before the first layer join stage 0, ops after the last one the last
stage, ops between layers the stage of the layer before them.

Costs per layer, for T = plan_ngpus // S tensor-parallel ranks per stage:
  - autodist: its fastest plan at T (the ILP, identical layers sharing variables, its
    tensor-parallel collectives included), costed per layer (autodist/pipeline.py);
  - other policies: the ideal split, every op's replicated time / T.
The cut splits the layers into S * V contiguous runs minimizing the slowest stage's forward +
backward time per micro-batch (linear partition, dynamic programming), every stage within
mem_limit_gb / V: its parameters, gradients and optimizer state plus the activations of the
micro-batches the schedule keeps in flight there (`stage_inflight`: GPipe all M, 1F1B S - p on
pipeline rank p, interleaved 1F1B its warm-up, ZBV like 1F1B). autodist also places the
balanced cut (memory ignored) again under the limit per pipeline rank and keeps the faster of
the two; when neither fits, the leanest placements' memory bounds the cut, and then the
leanest memory options the config leaves to autodist (ZeRO, offload, recompute "auto").

pipeline_stages="auto" (autodist only) tries every S dividing plan_ngpus, best lower bound
first, and keeps the fastest predicted step that fits:

    step(S) = T(actions) + g,  T = the schedule's action list (passes/pipeline_schedule.py)
              run on its stages' times per micro-batch (each stage's ops + a send and a
              receive of the boundary activation; forward a third, backward two thirds,
              I = W = half the backward) by passes/schedule_time.py, which gives each
              schedule its paper's bubble ((S-1) t for GPipe/1F1B, (S-1) t / V interleaved,
              ...) and also prices uneven stages and DualPipeV; g = per-step gradient
              reduction of the fullest rank.

A candidate whose lower bound (ideal split, no communication) is not below the best step found
is not planned. Precondition: none (runs before plan). Records graph.plan_state.pipeline
(PipelinePlan), op.stage for every op, and the candidates in graph.plan_state.pipeline_search;
autodist then limits memory per pipeline rank and re-costs the stages with its final plan.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

from nncompile.errors import ConfigError
from nncompile.ir import Graph, MemoryChoice, PipelinePlan, Replicate, Stage
from nncompile.pipeline_config import AUTO, PipelineConfig, auto_schedules

from .schedule_time import stage_inflight

from .contract import config_of

_INF = float("inf")


def layer_of(module_path: str) -> str | None:
    """`transformer.h.3.attn.c_attn` -> `transformer.h.3`; None outside numbered blocks."""
    parts = module_path.split(".") if module_path else []
    for i, p in enumerate(parts):
        if p.isdigit():
            return ".".join(parts[:i + 1])
    return None


@dataclass
class Layer:
    name: str
    ops: list                      # op indices


def layers_of(g: Graph) -> tuple[list[Layer], list[int], list[int]]:
    """(the layers in order, op indices before the first layer, op indices after the last
    layer); an op between layers joins the layer before it."""
    layers: list[Layer] = []
    index: dict[str, Layer] = {}
    head: list[int] = []
    last_own = -1
    for i, op in enumerate(g.ops):
        name = layer_of(op.module_path)
        if name is not None and name not in index:
            index[name] = Layer(name, [])
            layers.append(index[name])
        if name is not None:
            index[name].ops.append(i)
            if index[name] is layers[-1]:
                last_own = i
        elif layers:
            layers[-1].ops.append(i)
        else:
            head.append(i)
    tail: list[int] = []
    if layers:         # ops after the last layer's last own op are the tail, not the layer
        last = layers[-1]
        tail = [i for i in last.ops if i > last_own]
        last.ops = [i for i in last.ops if i <= last_own]
    return layers, head, tail


def partition(costs: list[float], k: int, fits=lambda lo, hi, s: True) -> list[int]:
    """Cut points b_0=0 < b_1 < ... < b_k=len(costs) minimizing the largest sum of a part;
    `fits(lo, hi, s)` says whether costs[lo:hi] may form part s."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    best = [[_INF] * (n + 1) for _ in range(k + 1)]
    cut = [[0] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0.0
    for s in range(1, k + 1):
        prev, row, where = best[s - 1], best[s], cut[s]
        for hi in range(s, n - (k - s) + 1):
            for lo in range(hi - 1, s - 2, -1):       # shortest part first
                b = prev[lo]
                part = prefix[hi] - prefix[lo]
                if part >= row[hi]:                   # longer parts only cost more
                    break
                if b == _INF or not fits(lo, hi, s - 1):
                    continue
                v = b if b > part else part
                if v < row[hi]:
                    row[hi], where[hi] = v, lo
    if best[k][n] == _INF:
        return []
    bounds, hi = [n], n
    for s in range(k, 0, -1):
        hi = cut[s][hi]
        bounds.append(hi)
    return bounds[::-1]


@dataclass
class Costs:
    """Per group of ops (the L layers, then the head, then the tail)."""
    time: list[float]              # seconds per micro-batch, forward + backward
    state: list[float]             # bytes: parameters, gradients, optimizer state
    activations: list[float]       # bytes saved for backward, one micro-batch
    step: list[float] = field(default_factory=list)   # seconds per step (gradient reduction)
    how: str = "ideal split"


@dataclass
class Cut:
    """One candidate: S pipeline ranks of T tensor-parallel ranks, its cut and prediction."""
    ranks: int
    tp: int
    bound: float                   # lower bound on the step (ideal split, no communication)
    step: float = _INF             # predicted seconds per step
    bounds: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)     # seconds per stage, one micro-batch
    memory: list[float] = field(default_factory=list)    # bytes per stage
    how: str = ""
    note: str = ""                 # how memory shaped the cut
    status: str = ""               # chosen | fits | too large | slower (bound) | cannot run
    schedule: str = "1f1b"         # the pipeline schedule it is priced under

    def row(self) -> dict:
        return {"stages": self.ranks, "tp": self.tp, "schedule": self.schedule,
                "step_ms": _ms(self.step),
                "bound_ms": _ms(self.bound), "max_stage_ms": _ms(max(self.times, default=_INF)),
                "memory_bytes": int(max(self.memory)) if self.memory else None,
                "costs": self.how,
                "status": self.status}


def _ms(x: float) -> float | None:
    return None if x == _INF else x * 1e3


def check_no_buffer_updates(g: Graph) -> None:
    """Stages do not return buffer updates yet: a ConfigError where forward makes some."""
    updates = g.trace_info.buffer_updates
    if not updates:
        return
    more = f" and {len(updates) - 3} more" if len(updates) > 3 else ""
    raise ConfigError(
        f"{g.trace_info.model}.forward updates buffers in place ({', '.join(updates[:3])}"
        f"{more}: BatchNorm's running statistics in training mode), which a pipelined plan "
        "does not support yet; train without a pipeline (parallel.pp), or call model.eval() before "
        "parallelize if the statistics are to stay fixed")


@dataclass
class PartitionStages:
    """The pass (see the module docstring): cuts the stages graph.config asks for; `autodist`:
    the policy is autodist (which may choose parallel.pp="auto")."""
    autodist: bool = False
    name: ClassVar[str] = "pipeline_stages"
    requires: ClassVar[tuple] = ()
    produces: ClassVar[tuple] = (Stage.STAGED,)

    def __post_init__(self):
        if not isinstance(self.autodist, bool):
            raise TypeError("PartitionStages(autodist=True/False): the pass reads the "
                            "ComputeConfig from graph.config, not from its arguments")

    def __call__(self, graph: Graph) -> Graph:
        return StageSearch(config_of(graph, self.name), self.autodist).cut(graph)


@dataclass
class StageSearch:
    """One graph's stage search for `config` (graph.config): the candidates, their costs and
    the cut."""
    config: Any
    autodist: bool = False

    def cut(self, graph: Graph) -> Graph:
        pc = self.config.pipeline
        if pc.stages == AUTO and not self.autodist:
            raise ConfigError("parallel.pp='auto' is chosen by autodist; use "
                              "pas_policy='autodist' or give the number of stages")
        if pc.schedule == AUTO and not self.autodist:
            raise ConfigError("parallel.schedule='auto' is chosen by autodist; use "
                              "pas_policy='autodist' or name a schedule (docs/pipeline.md)")
        check_no_buffer_updates(graph)
        g = graph.clone()
        layers, head, tail = layers_of(g)
        if not layers:
            raise ConfigError(
                "pipeline stages are cut at layer boundaries (blocks of an nn.ModuleList, "
                f"module paths like 'layers.3'), but {g.trace_info.model} has none; drop "
                "parallel.pp or keep the repeated blocks in a ModuleList")
        v = pc.stages_per_rank
        if pc.stages != AUTO and pc.stages * v > len(layers):
            raise ConfigError(
                f"parallel.pp={pc.stages} x stages_per_rank={v} = {pc.stages * v} stages, "
                f"but {g.trace_info.model} has only {len(layers)} layers ({layers[0].name} ... "
                f"{layers[-1].name}) to cut between; use parallel.pp <= {len(layers) // v}"
                + (f" with stages_per_rank={v}" if v > 1 else ""))
        n = self.config.plan_ngpus
        group = [0] * len(g.ops)
        for li, layer in enumerate(layers):
            for i in layer.ops:
                group[i] = li
        for i in head:
            group[i] = len(layers)
        for i in tail:
            group[i] = len(layers) + 1
        ranks = [s for s in range(1, n + 1) if n % s == 0 and s * v <= len(layers)] \
            if pc.stages == AUTO else [pc.stages]
        schedules = auto_schedules(v) if pc.schedule == AUTO else [pc.schedule]
        # the ideal split: other policies' costs, and "auto"'s lower bounds
        ideal = self._ideal(g, group, len(layers) + 2) \
            if len(ranks) * len(schedules) > 1 or not self.autodist else None
        cands = [Cut(s, n // s, self._bound(ideal, s, n // s, len(layers), sch) if ideal
                     else 0.0, schedule=sch) for s in ranks for sch in schedules]
        best = None
        for c in sorted(cands, key=lambda c: (c.bound, c.ranks)):
            if c.bound == _INF and len(cands) > 1:
                c.status = "cannot run"          # e.g. dualpipev with M < 2S
                continue
            if best is not None and c.bound >= best.step:
                c.status = "slower (bound)"
                continue
            self._evaluate(g, c, group, layers, ideal)
            if c.bounds and (best is None or c.step < best.step):
                best = c
        if best is None:
            raise ConfigError(self._nothing_fits(layers, cands))
        for c in cands:
            c.status = c.status or ("chosen" if c is best else
                                    "fits" if c.bounds else "too large")
        k = best.ranks * v
        stage_of_layer = [s for s in range(k) for _ in range(best.bounds[s], best.bounds[s + 1])]
        for layer, stage in zip(layers, stage_of_layer):
            for i in layer.ops:
                g.ops[i].stage = stage
        for i in head:
            g.ops[i].stage = 0
        for i in tail:
            g.ops[i].stage = k - 1
        counts = sorted({c.ranks for c in cands})
        why = (f"autodist: {best.ranks} of the stage counts {counts}, " if pc.stages == AUTO
               else "") + (f"schedule {best.schedule!r} of {schedules}, " if pc.schedule == AUTO
                           else "")
        why += ("the fastest predicted step that fits; cut by " if why else "") + best.how
        pipeline = PipelinePlan(
            ranks=best.ranks, stages_per_rank=v, schedule=best.schedule,
            microbatches=pc.microbatches, tp=best.tp,
            layers=[[x.name for x in layers[best.bounds[s]:best.bounds[s + 1]]]
                    for s in range(k)],
            predicted_ms=[x * 1e3 for x in best.times], memory_bytes=best.memory,
            chosen_by=why)
        g.plan_state.pipeline = pipeline if pipeline.nstages > 1 else None   # "auto" chose 1
        g.plan_state.pipeline_search = {
            "auto": pc.stages == AUTO, "auto_schedule": pc.schedule == AUTO,
            "costs": best.how, "memory_note": best.note,
            "predicted_step_ms": _ms(best.step),
            "mem_limit_bytes": None if self._limit() == _INF else int(self._limit()),
            "candidates": [c.row() for c in sorted(cands, key=lambda c: (c.ranks,
                                                                         c.schedule))]}
        g.stages = g.stages | {Stage.STAGED}
        return g

    # ---- costs ----
    def _limit(self) -> float:
        limit = self.config.parallel.mem_limit_gb
        if limit is None and self.autodist:
            from nncompile.passes.autodist import get_profile
            limit = get_profile(self.config.parallel.device).mem_capacity_gb
        return _INF if limit is None else float(limit) * 1e9

    def _ideal(self, g: Graph, group: list[int], ngroups: int) -> Costs:
        """Every op replicated on one rank (divided by T later)."""
        from nncompile.passes.autodist import cost_model
        cfg = self.config          # one rank, every rank of the job a data-parallel unit
        cm = cost_model(cfg, 1, dp_units=cfg.runtime_ngpus or cfg.plan_ngpus)
        out = Costs([0.0] * ngroups, [0.0] * ngroups, [0.0] * ngroups, [0.0] * ngroups)
        seen: set[tuple[int, int]] = set()
        for i, op in enumerate(g.ops):
            gi = group[i]
            outs = [Replicate()] * len(op.outputs)
            out.time[gi] += cm.compute(op, [None] * len(op.tensor_inputs()), outs)
            out.activations[gi] += cm.activation_memory(op, outs)
            for v in op.inputs():
                if v.kind == "param" and (id(v), gi) not in seen:
                    seen.add((id(v), gi))
                    out.state[gi] += cm.param_memory(v, Replicate())
        return out

    def _bound(self, ideal: Costs, ranks: int, tp: int, nlayers: int, schedule: str) -> float:
        """A lower bound on the step: no communication, every op split ideally, the slowest
        stage at least the mean and at least the largest layer."""
        k = ranks * self.config.pipeline.stages_per_rank
        times = ideal.time[:nlayers]
        times = [t / tp for t in times]
        times[0] += ideal.time[nlayers] / tp
        times[-1] += ideal.time[nlayers + 1] / tp
        stage = max(sum(times) / k, max(times))
        return self._step([stage] * k, [0.0] * ranks, ranks, schedule)

    def _step(self, times: list[float], step_costs: list[float], ranks: int,
              schedule: str) -> float:
        """Predicted seconds per step from per-stage micro-batch times (module docstring)."""
        from .pipeline_schedule import compute_order
        from .schedule_time import step_time
        pc = self.config.pipeline
        try:
            order = compute_order(schedule, ranks, pc.stages_per_rank, pc.microbatches)
        except ConfigError:          # the schedule cannot run on `ranks` (the pass says why)
            return math.inf
        run = step_time(order, [t / 3 for t in times], [2 * t / 3 for t in times])
        return run.time + max(step_costs, default=0.0)

    def _evaluate(self, g: Graph, c: Cut, group: list[int], layers: list[Layer],
                  ideal: Costs) -> None:
        """Fill `c` with its best cut whose memory fits (c.bounds stays empty when none does).
        Other policies: the ideal split's costs under the memory bound. autodist, per memory
        option (the fastest looking, then the leanest), the faster of: the balanced cut of its
        fastest plan, planned again under the memory limit per pipeline rank; and its fastest
        plan's memory-bounded cut. Failing both, the cut bounded by the leanest placements'
        memory, planned again."""
        if not self.autodist:
            scaled = Costs([t / c.tp for t in ideal.time], [x / c.tp for x in ideal.state],
                           [a / c.tp for a in ideal.activations], [0.0] * len(ideal.time),
                           "layer cost (ideal split)" if c.tp > 1 else "layer cost")
            _fill(c, self._cut(g, c, scaled, layers, self._limit()))
            free = self._cut(g, c, scaled, layers, _INF)
            c.note = "" if not c.bounds else _note(c, free)
            return
        from nncompile.passes.autodist import MemoryModel, problem_of
        from nncompile.passes.autodist.memory_search import memory_options
        from nncompile.passes.autodist.pipeline import layer_costs
        cfg = self.config
        g = g.clone()              # planned on the candidate's tensor ranks
        g.plan_ngpus = g.plan_state.tensor_ranks = c.tp
        opts = memory_options(g, cfg)
        built: dict[tuple, Any] = {}
        for choice in ([opts[0], opts[-1]] if len(opts) > 1 else opts):
            if choice.recompute not in built:
                built[choice.recompute] = problem_of(g, cfg, list(choice.recompute))
            base = built[choice.recompute]
            prob = MemoryModel.of(base.model, cfg, g).derive(g, base, choice)
            lc = layer_costs(g, prob, group, len(layers) + 2, self._solver_limit())
            how = f"autodist plan at tp={c.tp}" + _memory_words(choice)
            fast = Costs(lc.time, lc.state, lc.activations, lc.step, how)
            balanced = self._cut(g, c, fast, layers, _INF)
            options = [self._cut(g, c, fast, layers, self._limit())]
            options[0].note = _note(options[0], balanced)
            if options[0].bounds != balanced.bounds:    # memory moved the cut: plan anew
                options.append(self._planned(g, c, prob, group, layers, balanced.bounds,
                                             how + ", balanced cut planned within the limit"))
                if options[-1] is not None:
                    options[-1].note = (
                        f"its fastest plan's balanced cut needs {_size(max(balanced.memory))} "
                        "on its fullest stage; autodist placed it again within the limit "
                        "per pipeline rank" + (f", faster than the memory-bounded cut "
                                               f"({options[0].step * 1e3:.4g} ms/step)"
                                               if options[0].bounds else ""))
            if not any(o is not None and o.bounds for o in options):
                lean = Costs(lc.time, lc.lean_state, lc.lean_activations, lc.step, how)
                cut = self._cut(g, c, lean, layers, self._limit())
                _fill(c, cut)           # its memory, for the error message, if none fits
                if cut.bounds:
                    options.append(self._planned(g, c, prob, group, layers, cut.bounds,
                                                 how + ", cut by its leanest placements' "
                                                 "memory"))
                    if options[-1] is not None:
                        options[-1].note = ("only its leanest placements fit: cut by their "
                                            "memory, then placed again within the limit")
            options = [o for o in options if o is not None and o.bounds]
            if options:
                _fill(c, min(options, key=lambda o: o.step))
                return
        c.bounds = []

    def _solver_limit(self) -> float:
        return float(self.config.parallel.solver_time_limit)

    def _planned(self, g: Graph, c: Cut, prob, group: list[int], layers: list[Layer],
                 bounds: list[int], how: str) -> Cut | None:
        """The cut `bounds` with autodist's fastest plan within the memory limit per pipeline
        rank, costed per stage (None when no plan fits)."""
        from nncompile.passes.autodist.ilp import solve_within
        from nncompile.passes.autodist.pipeline import rank_groups, stage_costs
        pc = self.config.pipeline
        k = c.ranks * pc.stages_per_rank
        stage_of = [s for s in range(k) for _ in range(bounds[s], bounds[s + 1])] + [0, k - 1]
        for i, op in enumerate(g.ops):
            op.stage = stage_of[group[i]]
        pp = PipelinePlan(c.ranks, pc.stages_per_rank, c.schedule, pc.microbatches, c.tp,
                          [], [])
        inflight = [stage_inflight(pp, s) for s in range(k)]
        prob = dataclasses.replace(prob, groups=rank_groups(g, prob, pp, inflight.__getitem__))
        limit = self._limit()
        sol = solve_within(prob, None if limit == _INF else limit / 1e9, self._solver_limit())
        if sol is None:
            return None
        ms, mem, step = stage_costs(g, prob, sol.picks, k, inflight.__getitem__)
        out = Cut(c.ranks, c.tp, c.bound, bounds=list(bounds), times=[x / 1e3 for x in ms],
                  memory=mem, how=how, schedule=c.schedule)
        out.step = self._step([t + self._p2p(g, c, layers) for t in out.times],
                              self._rank_sums(c.ranks, step, c.schedule), c.ranks, c.schedule)
        return out

    def _rank_sums(self, ranks: int, per_stage: list[float], schedule: str) -> list[float]:
        pc = self.config.pipeline
        cfg = PipelineConfig(ranks, schedule, pc.microbatches, pc.stages_per_rank)
        return [sum(per_stage[s] for s in cfg.stage_ids(p, ranks)) for p in range(ranks)]

    def _cut(self, g: Graph, c: Cut, costs: Costs, layers: list[Layer], limit: float) -> Cut:
        """The cut of `costs` under `limit` bytes per stage (/ V), with its prediction; a Cut
        without bounds (with the memory of the balanced cut's stages) when none fits."""
        pc = self.config.pipeline
        v = pc.stages_per_rank
        k = c.ranks * v
        nl = len(layers)
        times = costs.time[:nl]
        times[0] += costs.time[nl]
        times[-1] += costs.time[nl + 1]
        state, act, step = [0.0], [0.0], [0.0]
        for li in range(nl):
            state.append(state[-1] + costs.state[li])
            act.append(act[-1] + costs.activations[li])
            step.append(step[-1] + (costs.step[li] if costs.step else 0.0))
        pp = PipelinePlan(c.ranks, v, c.schedule, pc.microbatches, c.tp, [], [])
        inflight = [stage_inflight(pp, s) for s in range(k)]
        per_stage = limit / v

        def memory(lo: int, hi: int, s: int) -> float:
            st = state[hi] - state[lo] + (costs.state[nl] if lo == 0 else 0.0) + \
                (costs.state[nl + 1] if hi == nl else 0.0)
            a = act[hi] - act[lo] + (costs.activations[nl] if lo == 0 else 0.0) + \
                (costs.activations[nl + 1] if hi == nl else 0.0)
            return st + a * inflight[s]

        bounds = partition(times, k, (lambda lo, hi, s: memory(lo, hi, s) <= per_stage)
                           if limit < _INF else (lambda lo, hi, s: True))
        if not bounds:              # the balanced cut's memory, for the error message
            free = partition(times, k)
            return Cut(c.ranks, c.tp, c.bound, how=costs.how, schedule=c.schedule,
                       memory=[memory(free[s], free[s + 1], s) for s in range(k)])
        out = Cut(c.ranks, c.tp, c.bound, bounds=bounds, how=costs.how, schedule=c.schedule,
                  times=[sum(times[bounds[s]:bounds[s + 1]]) for s in range(k)],
                  memory=[memory(bounds[s], bounds[s + 1], s) for s in range(k)])
        stage_step = [step[bounds[s + 1]] - step[bounds[s]] for s in range(k)]
        out.step = self._step([t + self._p2p(g, c, layers) for t in out.times],
                              self._rank_sums(c.ranks, stage_step, c.schedule), c.ranks,
                              c.schedule)
        return out

    def _p2p(self, g: Graph, c: Cut, layers: list[Layer]) -> float:
        """Seconds to send one stage's output forward and receive its gradient back."""
        from nncompile.passes.autodist import cost_model
        if c.ranks == 1:
            return 0.0
        op = g.ops[layers[0].ops[-1]]
        size = float(sum(math.prod(v.meta.shape) * v.meta.dtype.itemsize
                         for v in op.outputs if v.is_tensor))
        cm = cost_model(self.config, c.tp)
        return 2 * cm.p2p(size, span=2 * c.tp)

    def _nothing_fits(self, layers: list[Layer], cands: list[Cut]) -> str:
        tried = "; ".join(f"{c.ranks} stage(s) x tp {c.tp}: the balanced cut's fullest "
                          f"stage needs {_size(max(c.memory))} ({c.how})"
                          for c in sorted(cands, key=lambda c: c.ranks) if c.memory)
        limit = self._limit()
        return (f"no cut of {len(layers)} layers into pipeline stages fits "
                f"{_size(limit)} per rank (mem_limit_gb; parameters, gradients and "
                f"optimizer state plus the activations of the micro-batches in flight): "
                f"{tried}. Raise mem_limit_gb, use more stages or more micro-batches of a "
                "smaller batch, or add recompute_modules (or 'auto' with autodist)")


def _fill(c: Cut, found: Cut) -> None:
    c.bounds, c.times, c.memory, c.step, c.how, c.note = (
        found.bounds, found.times, found.memory, found.step, found.how, found.note)


def _note(cut: Cut, balanced: Cut) -> str:
    """How the memory bound shaped `cut`, next to the cut ignoring memory."""
    if not cut.bounds:
        return ""
    if cut.bounds == balanced.bounds:
        return (f"the balanced cut fits (fullest stage {_size(max(cut.memory))}): memory does "
                "not move it")
    return (f"the memory limit moved the cut: the balanced one needs "
            f"{_size(max(balanced.memory))} on its fullest stage; slowest stage "
            f"{max(cut.times) * 1e3:.4g} ms instead of {max(balanced.times) * 1e3:.4g} ms")


def _size(b: float) -> str:
    return f"{b / 1e9:.4g} GB" if b >= 1e8 else f"{b / 1e6:.3g} MB"


def _memory_words(choice: MemoryChoice) -> str:
    parts = [f"ZeRO-{choice.zero}"] if choice.zero else []
    if choice.offload_optimizer:
        parts.append("optimizer offload")
    if choice.recompute:
        parts.append("recompute " + ", ".join(choice.recompute))
    return f" ({', '.join(parts)})" if parts else ""


def pipeline_json(g: Graph) -> dict | None:
    """plan.json's "pipeline": the cut, why, and per stage its layers, ranks (of plan unit 0;
    unit u adds u x ranks x tp), predicted time and memory, parameters and collectives (for
    a planned, localized graph; None without pipeline_stages)."""
    pp, search = g.plan_state.pipeline, g.plan_state.pipeline_search
    if pp is None:
        return None if search is None else {"ranks": 1, "tp": g.plan_ngpus, "stages": [],
                                            "chosen_by": "autodist: no pipeline is faster",
                                            **search}
    from nncompile.collectives import of_target
    from .split_stages import stage_graphs

    cfg = PipelineConfig(pp.ranks, pp.schedule, pp.microbatches, pp.stages_per_rank)
    mesh = g.mesh
    stages = []
    for s, sg in enumerate(stage_graphs(g)):
        pipe = next(p for p in range(pp.ranks) if s in cfg.stage_ids(p, pp.ranks))
        comm: dict[str, int] = {}
        for op in sg.ops:
            c = of_target(op.target_name)
            if c is not None:
                comm[c.name] = comm.get(c.name, 0) + 1
        stages.append({
            "stage": s, "pipe_rank": pipe,
            "ranks": mesh.ranks_along(tuple(n for n in mesh.names if n not in ("dp", "pp")),
                                      mesh.rank_of({**{n: 0 for n in mesh.names}, "pp": pipe}))
            if pp.ranks > 1 else list(range(pp.tp)),
            "layers": pp.layers[s],
            "predicted_ms": pp.predicted_ms[s] if s < len(pp.predicted_ms) else None,
            "memory_bytes": int(pp.memory_bytes[s]) if s < len(pp.memory_bytes) else None,
            "params": len(sg.params),
            "param_elements": sum(math.prod(v.meta.shape) for v in sg.params),
            "param_bytes_per_rank": sum(math.prod(v.local_shape(g.plan_ngpus))
                                        * v.meta.dtype.itemsize for v in sg.params),
            "inflight_microbatches": stage_inflight(pp, s),
            "collectives": comm,
            "inputs": [v.name for v in sg.inputs], "outputs": [v.name for v in sg.outputs]})
    times = [x for x in pp.predicted_ms if x is not None]
    return {"ranks": pp.ranks, "tp": pp.tp, "stages_per_rank": pp.stages_per_rank,
            "nstages": pp.nstages, "schedule": pp.schedule, "microbatches": pp.microbatches,
            "chosen_by": pp.chosen_by,
            "actions": _compute_actions(pp),
            "balance": max(times) / (sum(times) / len(times)) if times and sum(times) else None,
            **(search or {}), "stages": stages}


def _compute_actions(pp) -> dict[str, str]:
    """Each pipeline rank's compute actions in order (passes/pipeline_schedule.py)."""
    from .pipeline_schedule import schedule_actions
    acts = pp.actions or schedule_actions(pp.schedule, pp.ranks, pp.stages_per_rank,
                                          pp.microbatches)
    return {str(p): acts.text(p, comms=False) for p in range(pp.ranks)}
