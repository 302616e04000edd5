"""autodist: the default policy. Plans by solving an ILP over a cost model, without a GPU.

    profile (profiles.py) -> cost model (cost_model.py) -> decision problem (problem.py)
        -> ILP (ilp.py) -> placements on the graph -> explanation data (report.py)

pas_config keys:
    device               built-in profile name ('cpu', 'a100-80g', 'h100-80g', 'h200') or a
                         profile .json (`python -m nncompile profile -o FILE`); default: this
                         machine's accelerator, else 'cpu'
    mem_limit_gb         memory per rank the plan must fit (default: the profile's capacity)
    optimizer            'adam' (default), 'adamw', 'sgd', 'sgd_momentum', 'none'
    optimizer_state_bytes  bytes of optimizer state per parameter element (overrides optimizer)
    solver_time_limit    seconds (default 60)
    constraints          pinned partitions, see constraints.py
    recompute_modules    module classes or path globs to checkpoint (counted in memory)
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
from .ilp import PlanInfeasibleError, Solution, leanest_memory, objective_of, replicated_memory, \
    solve
from .plan_file import load_plan, save_plan
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


def plan_problem(graph: Graph, config) -> tuple[Graph, Problem]:
    """The graph to place (a copy) and its decision problem."""
    pc = config.pas_config
    unknown = set(pc) - KEYS
    if unknown:
        raise ConfigError(f"unknown pas_config keys for autodist: {sorted(unknown)}; "
                          f"known: {sorted(KEYS)}")
    g = graph.clone()
    g.plan_ngpus = config.plan_ngpus
    prob = build_problem(g, cost_model(config), parse_constraints(pc.get("constraints")),
                         list(pc.get("recompute_modules") or []))
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
        _log(f"autodist: loaded the plan in {pc['load_plan_path']}")
        return g
    start = time.perf_counter()
    g, prob = plan_problem(graph, config)
    mem = pc.get("mem_limit_gb", prob.model.profile.mem_capacity_gb)
    note = cpu_fallback_note(pc.get("device"))
    if note:
        _log(f"autodist: {note}")
    try:
        sol: Solution = solve(prob, mem, float(pc.get("solver_time_limit", 60.0)))
    except PlanInfeasibleError as e:
        if not note:
            raise
        raise PlanInfeasibleError(f"{e} Note: {note}") from None
    apply(g, prob, sol.picks)
    g.plan_state.autodist = explanation_data(prob, sol, g, prob.model.profile.name)
    shared = ", ".join(f"{p} x{k}" for p, k in prob.layers.items()) or "none"
    _log(f"autodist: {len(g.ops)} ops -> {len(prob.choices)} decisions (identical layers: "
         f"{shared}); {sol.solver} solved {sol.variables} vars in {sol.seconds:.2f}s; model "
         f"{sol.objective * 1e3:.3f} ms/step, {sol.memory / 1e9:.3f} GB/rank on "
         f"{prob.model.profile.name} ({time.perf_counter() - start:.2f}s)")
    if pc.get("save_plan_path"):
        save_plan(g, pc["save_plan_path"])
    return g


__all__ = ["autodist", "explain", "report_table", "cost_model", "plan_problem", "apply",
           "objective_of", "leanest_memory", "replicated_memory", "PlanInfeasibleError", "DeviceProfile", "BUILTIN", "get_profile",
           "measure_profile", "save_profile", "save_plan", "load_plan"]
