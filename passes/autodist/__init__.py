"""autodist: the default policy. Plans by solving an ILP over a cost model, without a GPU.

    profile (profiles.py) -> cost model (cost_model.py) -> decision problem (problem.py)
        -> per memory option (memory_model.py, memory_search.py) -> ILP (ilp.py)
        -> placements on the graph -> explanation data (report.py)

Memory options: with ComputeConfig(use_zero="auto") (a ZeRO stage 0-3),
offload_optimizer="auto" and/or pas_config recompute_modules="auto", autodist also picks those,
the fastest combination whose plan fits mem_limit_gb (memory_search.py, formulas in
memory_model.py); explicit values are kept and counted. The result is graph.plan_state.memory
and plan.json's autodist["memory"] (choice, bytes per rank by kind, host bytes, candidates).

pas_config keys:
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

import time

from nncompile.config import PAS_CONFIG_KEYS
from nncompile.errors import ConfigError
from nncompile.ir import Graph
from nncompile.log import log as _log

from .constraints import parse_constraints
from .cost_model import OPTIMIZER_STATE_BYTES, CostModel
from .ilp import PlanInfeasibleError, leanest_memory, objective_of, replicated_memory
from .memory_model import MemoryModel
from .memory_search import AUTO, auto_fields, label, memory_report, search
from .plan_file import load_plan, loaded_memory, save_plan
from .problem import Problem, build_problem
from .profiles import BUILTIN, DeviceProfile, cpu_fallback_note, get_profile, measure_profile, \
    save_profile
from .report import explain, explanation_data, report_table

KEYS = PAS_CONFIG_KEYS      # the one list of pas_config keys, checked by ComputeConfig


def cost_model(config) -> CostModel:
    pc = config.pas_config
    opt = pc.get("optimizer", "adam")
    if opt not in OPTIMIZER_STATE_BYTES:
        raise ConfigError(f"pas_config optimizer={opt!r}; choose one of "
                          f"{sorted(OPTIMIZER_STATE_BYTES)} or set optimizer_state_bytes")
    state = float(pc.get("optimizer_state_bytes", OPTIMIZER_STATE_BYTES[opt]))
    return CostModel(get_profile(pc.get("device")), config.plan_ngpus, config.dp_size,
                     training=not config.inference_only, optimizer_state_bytes=state)


def plan_problem(graph: Graph, config, recompute: list[str] | None = None
                 ) -> tuple[Graph, Problem]:
    """The graph to place (a copy) and its decision problem; `recompute`: the modules to
    recompute (default: pas_config's, none for "auto")."""
    pc = config.pas_config
    unknown = set(pc) - KEYS
    if unknown:
        raise ConfigError(f"unknown pas_config keys for autodist: {sorted(unknown)}; "
                          f"known: {sorted(KEYS)}")
    g = graph.clone()
    g.plan_ngpus = config.plan_ngpus
    if recompute is None:
        rc = pc.get("recompute_modules")
        recompute = [] if rc == AUTO else list(rc or [])
    prob = build_problem(g, cost_model(config), parse_constraints(pc.get("constraints")),
                         recompute)
    return g, prob


def apply(g: Graph, prob: Problem, picks: list[int]) -> None:
    for op in g.ops:
        op.strategy = prob.strategy(op, picks)
    for v in g.params + g.buffers + g.consts:
        v.placement = prob.placement(v, picks)


def autodist(graph: Graph, config) -> Graph:
    """Place every op and weight to minimize the modelled step time within the memory limit."""
    pc = config.pas_config
    if pc.get("load_plan_path"):
        g = load_plan(graph, pc["load_plan_path"], config.plan_ngpus)
        g.plan_state.memory = loaded_memory(g.plan_state.memory, config, pc["load_plan_path"])
        _log(f"autodist: loaded the plan in {pc['load_plan_path']}")
        return g
    start = time.perf_counter()
    mem = pc.get("mem_limit_gb", get_profile(pc.get("device")).mem_capacity_gb)
    note = cpu_fallback_note(pc.get("device"))
    if note:
        _log(f"autodist: {note}")
    try:
        found = search(graph, config, lambda rc: plan_problem(graph, config, rc), mem,
                       float(pc.get("solver_time_limit", 60.0)))
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
    shared = ", ".join(f"{p} x{k}" for p, k in prob.layers.items()) or "none"
    _log(f"autodist: {len(g.ops)} ops -> {len(prob.choices)} decisions (identical layers: "
         f"{shared}); {sol.solver} solved {sol.variables} vars in {sol.seconds:.2f}s; model "
         f"{sol.objective * 1e3:.3f} ms/step, {sol.memory / 1e9:.3f} GB/rank on "
         f"{prob.model.profile.name} ({time.perf_counter() - start:.2f}s)")
    if len(found.candidates) > 1:
        _log(f"autodist: memory options {label(best.choice)}, the fastest of "
             f"{len(found.candidates)} combinations that fits ({found.solves} ILPs solved)")
    if pc.get("save_plan_path"):
        save_plan(g, pc["save_plan_path"])
    return g


__all__ = ["autodist", "explain", "report_table", "cost_model", "plan_problem", "apply",
           "objective_of", "leanest_memory", "replicated_memory", "PlanInfeasibleError",
           "DeviceProfile", "BUILTIN", "get_profile", "measure_profile", "save_profile",
           "save_plan", "load_plan", "MemoryModel", "auto_fields", "AUTO"]
