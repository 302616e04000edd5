"""autodist: the default policy. Plans by solving an ILP over a cost model, without a GPU.

    profile (profiles.py) -> cost model (cost_model.py) -> decision problem (problem.py)
        -> per memory option (memory_model.py, memory_search.py) -> ILP (ilp.py)
        -> placements on the graph -> explanation data (report.py)

Memory options: with ComputeConfig(use_zero="auto") (a ZeRO stage 0-3),
offload_optimizer="auto" and/or parallel.recompute_modules="auto", autodist also picks those,
the fastest combination whose plan fits mem_limit_gb (memory_search.py, formulas in
memory_model.py); explicit values are kept and counted. The result is graph.plan_state.memory
and plan.json's autodist["memory"] (choice, bytes per rank by kind, host bytes, candidates).

Pipelines: the pipeline_stages pass (passes/pipeline_stages.py) cuts the layers using this
plan's costs at the stage's tensor-parallel size; autodist then limits memory per pipeline
rank (one memory_limit per rank, activations times the micro-batches in flight: pipeline.py)
and records each stage's time and memory under the final plan in plan_state.pipeline.

ParallelSpec fields it reads (ComputeConfig(parallel=...), nncompile/parallel_spec.py):
    device               built-in profile name ('cpu', 'a100-80g', 'h100-80g', 'h200') or a
                         profile .json (`python -m nncompile profile -o FILE`); default: this
                         machine's accelerator, else 'cpu'
    mem_limit_gb         memory per rank the plan must fit (default: the profile's capacity)
    optimizer            'adam' (default), 'adamw', 'sgd', 'sgd_momentum', 'none'
    optimizer_state_bytes  bytes of optimizer state per parameter element (overrides optimizer)
    solver_time_limit    seconds (default 60)
    constraints          pinned partitions, see constraints.py
    recompute_modules    module classes or path globs to checkpoint (counted in memory), or
                         "auto": none or every block of the repeated ModuleLists, chosen
                         with the plan
    save_plan_path / load_plan_path   write the chosen plan / reuse a saved one (skips the ILP)
"""
from __future__ import annotations

import dataclasses
import time

from nncompile.errors import ConfigError
from nncompile.experts import MOE_EXPERTS
from nncompile.ir import Graph
from nncompile.log import log as _log

from ..contract import experts_split, tensor_ranks
from .constraints import parse_constraints
from .cost_model import OPTIMIZER_STATE_BYTES, CostModel, StepEstimate, estimate_step
from .ilp import PlanInfeasibleError, leanest_memory, memory_by_rank, objective_of, \
    replicated_memory
from .memory_model import MemoryModel
from .memory_search import AUTO, auto_fields, label, memory_report, search
from .pipeline import rank_groups, stage_costs
from .plan_file import load_plan, loaded_memory, save_plan
from .problem import Problem, build_problem
from .profiles import BUILTIN, DeviceProfile, cpu_fallback_note, get_profile, measure_profile, \
    save_profile
from .report import explain, explanation_data, report_table



def cost_model(config, ranks: int | None = None, dp_units: int | None = None) -> CostModel:
    """The cost model of a plan for `config` over `ranks` tensor-parallel ranks (default: the
    config's plan_ngpus; a planned graph's are graph.plan_ngpus) and `dp_units` data-parallel
    units (default: the config's)."""
    pc = config.parallel
    opt = pc.optimizer
    if opt not in OPTIMIZER_STATE_BYTES:
        raise ConfigError(f"parallel.optimizer={opt!r}; choose one of "
                          f"{sorted(OPTIMIZER_STATE_BYTES)} or set optimizer_state_bytes")
    state = float(OPTIMIZER_STATE_BYTES[opt] if pc.optimizer_state_bytes is None
                  else pc.optimizer_state_bytes)
    return CostModel(get_profile(pc.device), config.plan_ngpus if ranks is None else ranks,
                     config.dp_size if dp_units is None else dp_units,
                     training=not config.inference_only, optimizer_state_bytes=state,
                     bucket_bytes=float(config.reducer_bucket_cap_mb) * 2 ** 20)


def plan_problem(graph: Graph, config, recompute: list[str] | None = None, narrow=None
                 ) -> tuple[Graph, Problem]:
    """The graph to place (a copy) and its decision problem; `recompute`: the modules to
    recompute (default: parallel.recompute_modules, none for "auto"). Under a pipeline (op.stage set,
    plan_state.pipeline) memory is limited per pipeline rank (pipeline.py)."""
    g = graph.clone()
    g.plan_ngpus = tensor_ranks(graph, config)
    prob = problem_of(g, config, recompute, narrow)
    pp = g.plan_state.pipeline
    if pp is not None:
        from ..pipeline_stages import stage_inflight
        prob.groups = rank_groups(g, prob, pp, lambda s: stage_inflight(pp, s))
    return g, prob


def problem_of(g: Graph, config, recompute: list[str] | None = None, narrow=None) -> Problem:
    """The decision problem of placing `g` (not modified) for `config`; `narrow`: what
    context_narrow(g, config) gives (computed here when not given)."""
    pc = config.parallel
    if recompute is None:
        rc = pc.recompute_modules
        recompute = [] if rc == AUTO else list(rc or [])
    model = cost_model(config, tensor_ranks(g, config))    # (passes/planner.py)
    model.context = g.axes.get("cp", 1)     # the sequence split (passes/context_parallel.py)
    model.experts_split = g.axes.get("ep", 1)   # the batch and experts split along ep
    model.experts = frozenset(v.name for op in g.ops if op.target is MOE_EXPERTS
                              for v in op.args[3:5]) if model.experts_split > 1 else frozenset()
    if narrow is None:
        narrow = context_narrow(g, config)
    narrow = experts_narrow(g, config, narrow)
    return build_problem(g, model, parse_constraints(pc.constraints), recompute, narrow)


def context_narrow(g: Graph, config):
    """Under context parallelism (g.axes["cp"] = C > 1) the filter of each op's tensor-plan
    candidates that keeps the plan off the dims its sequence split along cp splits (else the
    cost model's 1/C would price ops the cp walk then cannot split); None without."""
    c = g.axes.get("cp", 1)
    if c == 1:
        return None
    from ..context_parallel import plan_filter, sequence_splits
    along = sequence_splits(g, c, config.parallel)
    return lambda op, cands: plan_filter(op, cands, along.get(op.name))


def experts_narrow(g: Graph, config, narrow=None):
    """`narrow` with each mixture-of-experts layer kept to the split parallel.ep
    ["expert_parallel"] = E gives it (passes/plan.py): dispatch when E is the plan's ranks,
    its tokens split (the experts whole) beside an ep axis (passes/expert_parallel.py); the
    split being planned is plan_state.experts (passes/planner.py)."""
    from nncompile.rules.experts import DISPATCH
    e = experts_split(g, config)
    if "ep" in g.axes:
        keep = lambda s: s.note == "split tokens"                    # noqa: E731
    elif e not in (1, AUTO) and e == tensor_ranks(g, config):
        keep = lambda s: s.local_target == DISPATCH                   # noqa: E731
    else:
        return narrow

    def pick(op, cands):
        cands = narrow(op, cands) if narrow is not None else cands
        if op.target is not MOE_EXPERTS:
            return cands
        return [s for s in cands if keep(s)] or cands
    return pick


def apply(g: Graph, prob: Problem, picks: list[int]) -> None:
    for op in g.ops:
        op.strategy = prob.strategy(op, picks)
    for v in g.params + g.buffers + g.consts:
        v.placement = prob.placement(v, picks)


def autodist(graph: Graph, config) -> Graph:
    """Place every op and weight to minimize the modelled step time within the memory limit."""
    pc = config.parallel
    if pc.load_plan_path:
        g = load_plan(graph, pc.load_plan_path, tensor_ranks(graph, config))
        g.plan_state.memory = loaded_memory(g.plan_state.memory, config, pc.load_plan_path)
        _log(f"autodist: loaded the plan in {pc.load_plan_path}")
        return g
    start = time.perf_counter()
    mem = pc.mem_limit_gb if pc.mem_limit_gb is not None else \
        get_profile(pc.device).mem_capacity_gb
    note = cpu_fallback_note(pc.device)
    if note:
        _log(f"autodist: {note}")
    try:
        narrow = context_narrow(graph, config)
        found = search(graph, config, lambda rc: plan_problem(graph, config, rc, narrow), mem,
                       float(pc.solver_time_limit))
    except PlanInfeasibleError as e:
        if not note:
            raise
        raise PlanInfeasibleError(f"{e} Note: {note}") from None
    best = found.chosen
    g, prob, sol = best.graph, best.prob, best.sol
    apply(g, prob, sol.picks)
    g.plan_state.memory = best.choice
    g.plan_state.autodist = explanation_data(prob, sol, g, prob.model.profile.name)
    g.plan_state.autodist["memory"] = memory_report(found, mem)
    if graph.trace_info.sizes:
        g.plan_state.autodist["sizes"] = _cost_at_range_ends(g, config)
    if g.plan_state.pipeline is not None:
        _cost_stages(g, prob, sol.picks)
    shared = ", ".join(f"{p} x{k}" for p, k in prob.layers.items()) or "none"
    _log(f"autodist: {len(g.ops)} ops -> {len(prob.choices)} decisions (identical layers: "
         f"{shared}); {sol.solver} solved {sol.variables} vars in {sol.seconds:.2f}s; model "
         f"{sol.objective * 1e3:.3f} ms/step, {sol.memory / 1e9:.3f} GB/rank on "
         f"{prob.model.profile.name} ({time.perf_counter() - start:.2f}s)")
    if len(found.candidates) > 1:
        _log(f"autodist: memory options {label(best.choice)}, the fastest of "
             f"{len(found.candidates)} combinations that fits ({found.solves} ILPs solved)")
    if pc.save_plan_path:
        save_plan(g, pc.save_plan_path)
    return g


def _cost_at_range_ends(g: Graph, config) -> list[dict]:
    """The plan (made at the dummy args' sizes) priced at the dynamic sizes' range ends."""
    from nncompile import symbolic
    rows = []
    dummy = {var[2:]: int(size) for v in g.inputs for size in v.meta.shape
             if isinstance(size, symbolic.Sym)
             for var in [size.code()] if var in g.trace_info.sizes}
    for label_, values in [("dummy args", {})] + symbolic.range_ends(g.trace_info.sizes):
        est = estimate_step(symbolic.graph_at(g, {**dummy, **values}) if values else g, config)
        shown = {k: values.get(k, d) for k, d in dummy.items()}
        rows.append({"at": label_, "sizes": shown, "ms": est.total * 1e3,
                     "memory_gb": est.memory / 1e9})
    return rows


def _cost_stages(g: Graph, prob: Problem, picks: list[int]) -> None:
    """The pipeline's per-stage time and memory as the final plan costs them, and the
    bytes of every pipeline rank (graph.plan_state.pipeline_search)."""
    from ..pipeline_stages import stage_inflight
    pp = g.plan_state.pipeline
    ms, mem, _ = stage_costs(g, prob, picks, pp.nstages,
                             lambda s: stage_inflight(pp, s))
    g.plan_state.pipeline = dataclasses.replace(pp, predicted_ms=ms, memory_bytes=mem)
    search = dict(g.plan_state.pipeline_search or {})
    search["cut_ms"] = list(pp.predicted_ms)        # what the cut was made with
    search["rank_memory_bytes"] = [int(b) for b in memory_by_rank(prob, picks)]
    g.plan_state.pipeline_search = search


__all__ = ["autodist", "explain", "report_table", "cost_model", "plan_problem", "apply",
           "estimate_step", "StepEstimate",
           "objective_of", "leanest_memory", "replicated_memory", "PlanInfeasibleError",
           "DeviceProfile", "BUILTIN", "get_profile", "measure_profile", "save_profile",
           "save_plan", "load_plan", "MemoryModel", "auto_fields", "AUTO"]
