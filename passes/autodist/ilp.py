"""The ILP autodist solves (PuLP; HiGHS when `highspy` is installed, else CBC).

Variables
    x[c,k] in {0,1}   choice c (an op group or a free value) takes option k
    y[a,b,i,j] >= 0   edge from choice a to choice b carries option pair (i, j) (= x[a,i]x[b,j])
    z[v] >= 0         value v's gradient is summed over the plan unit (some split op reads it
                      replicated)

Objective (seconds per training step, in microseconds for the solver)
    min  sum_{c,k} (compute[c,k] + comm[c,k]) x[c,k]          compute, fixed-input transitions,
                                                              data-parallel gradient all-reduce
       + sum_{a,b,i,j} T[a,b,i,j] y[a,b,i,j]                  resharding on edges
       + sum_v  AR(v) z[v]                                    gradient syncs

Constraints
    one_option_<c>:        sum_k x[c,k] = 1
    edge_<a>_<b>_src_<i>:  sum_j y[a,b,i,j] = x[a,i]           (linearizes the product
    edge_<a>_<b>_dst_<j>:  sum_i y[a,b,i,j] = x[b,j]            x[a,i] x[b,j] exactly)
    sync_<v>_<r>:          z[v] >= sum_{k in S_r} x[b_r,k]      for each reader r of v
    peak_<p>_unit_<u>:     u[p] >= sum_{c,k in unit u} bytes[c,k] x[c,k]   (u[p] >= 0: the
                                                              largest unit, e.g. ZeRO-3 gathers)
    memory_limit:          sum_{c,k} memory[c,k] x[c,k] + sum_p weight[p] u[p] + fixed
                               <= mem_limit                  (bytes per rank)
    memory_limit_<r>:      under a pipeline, one per pipeline rank r instead: memory[c,k]
                           weighted by g_r[c] (Problem.groups, pipeline.py)

Identical layers share x (see problem.py), so the model's size does not grow with depth.
When memory_limit makes the problem infeasible, the same model is solved for minimum memory
and the error states what the leanest plan needs.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import pulp

from nncompile.errors import PolicyError

from .problem import Problem

US = 1e6            # objective in microseconds: solver tolerances stay meaningful
GB = 1e9


class PlanInfeasibleError(PolicyError):
    """No plan fits the memory limit."""


@dataclass
class Solution:
    picks: list[int]              # option per choice
    objective: float              # seconds per step, as the model counts them
    solver_objective: float       # the same, as the solver reports it
    memory: float                 # bytes per rank
    solver: str
    seconds: float
    variables: int
    constraints: int


def _solver(time_limit: float):
    if "HiGHS" in pulp.listSolvers(onlyAvailable=True):
        return pulp.HiGHS(msg=False, timeLimit=time_limit), "HiGHS"
    return pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit), "CBC"


def _model(prob: Problem, minimize_memory: bool = False):
    m = pulp.LpProblem("autodist", pulp.LpMinimize)
    x = [[pulp.LpVariable(f"x_{c}_{k}", cat="Binary") for k in range(len(ch.options))]
         for c, ch in enumerate(prob.choices)]
    for c, xs in enumerate(x):
        m += pulp.lpSum(xs) == 1, f"one_option_{c}"
    cost = []
    for c, ch in enumerate(prob.choices):
        cost += [(ch.compute[k] + ch.comm[k]) * US * x[c][k] for k in range(len(ch.options))]
    for (a, b), table in prob.pairs.items():
        if not any(t for row in table for t in row):
            continue
        y = [[pulp.LpVariable(f"y_{a}_{b}_{i}_{j}", lowBound=0) for j in range(len(row))]
             for i, row in enumerate(table)]
        for i, row in enumerate(y):
            m += pulp.lpSum(row) == x[a][i], f"edge_{a}_{b}_src_{i}"
        for j in range(len(table[0])):
            m += pulp.lpSum(y[i][j] for i in range(len(table))) == x[b][j], \
                f"edge_{a}_{b}_dst_{j}"
        cost += [t * US * y[i][j] for i, row in enumerate(table) for j, t in enumerate(row)
                 if t]
    for s, (seconds, readers) in enumerate(prob.syncs):
        z = pulp.LpVariable(f"z_{s}", lowBound=0)
        for r, (b, opts) in enumerate(readers):
            m += z >= pulp.lpSum(x[b][k] for k in opts), f"sync_{s}_{r}"
        cost.append(seconds * US * z)
    extra = []
    for p, (weight, units) in enumerate(prob.peaks):
        u = pulp.LpVariable(f"peak_{p}", lowBound=0)
        for i, unit in enumerate(units):
            m += u >= pulp.lpSum(b / GB * x[c][k] for c, row in unit.items()
                                 for k, b in enumerate(row) if b), f"peak_{p}_unit_{i}"
        extra.append(weight * u)
    if prob.fixed_memory:
        extra.append(prob.fixed_memory / GB)
    memories = [pulp.lpSum([ch.memory[k] * w[c] / GB * x[c][k]
                            for c, ch in enumerate(prob.choices)
                            for k in range(len(ch.options)) if ch.memory[k] and w[c]] + extra)
                for w in (prob.groups or [[1.0] * len(prob.choices)])]
    memory = memories[0]
    if len(memories) > 1:               # the fullest pipeline rank
        memory = pulp.LpVariable("memory_max", lowBound=0)
        for r, e in enumerate(memories):
            m += memory >= e, f"memory_of_rank_{r}"
    m += memory if minimize_memory else pulp.lpSum(cost)
    return m, x, memories, memory


def _run(m, time_limit: float) -> tuple[str, str, float]:
    solver, name = _solver(time_limit)
    start = time.perf_counter()
    try:
        m.solve(solver)
    except pulp.PulpSolverError as e:
        raise PolicyError(f"autodist: the ILP solver ({name}) failed: {e}. Check that PuLP's "
                          "solver runs on this machine (pip install highspy gives HiGHS)") from None
    return pulp.LpStatus[m.status], name, time.perf_counter() - start


def solve(prob: Problem, mem_limit_gb: float | None, time_limit: float = 60.0) -> Solution:
    sol = solve_within(prob, mem_limit_gb, time_limit)
    if sol is None:
        lean = leanest_memory(prob, time_limit)
        need = "an unknown amount" if lean is None else f"{lean / GB:.4g} GB"
        raise PlanInfeasibleError(
            f"autodist: no plan fits mem_limit_gb={mem_limit_gb:g} GB per rank; the leanest "
            f"plan needs {need} per rank (parameters, gradients, optimizer state and saved "
            "activations). Raise parallel.mem_limit_gb, increase plan_ngpus, shrink the "
            "batch, or add parallel.recompute_modules.")
    return sol


def solve_within(prob: Problem, mem_limit_gb: float | None,
                 time_limit: float = 60.0) -> Solution | None:
    """The fastest plan within `mem_limit_gb` (None: no limit); None when no plan fits."""
    m, x, memories, _ = _model(prob)
    if mem_limit_gb is not None:
        for r, e in enumerate(memories):
            m += e <= mem_limit_gb, "memory_limit" + (f"_{r}" if len(memories) > 1 else "")
    status, name, secs = _run(m, time_limit)
    if status == "Infeasible":
        return None
    picks = []
    for xs in x:
        vals = [v.value() or 0.0 for v in xs]
        if max(vals, default=0.0) < 0.5:
            raise PolicyError(f"autodist: the ILP solver ({name}) stopped with status "
                              f"{status!r} after {secs:.1f} s without a plan; raise "
                              f"parallel.solver_time_limit (now {time_limit:g} s) or "
                              "simplify the problem with parallel.constraints")
        picks.append(max(range(len(vals)), key=vals.__getitem__))
    return Solution(picks, objective_of(prob, picks), pulp.value(m.objective) / US,
                    memory_of(prob, picks), name, secs, len(m.variables()), len(m.constraints))


def leanest_memory(prob: Problem, time_limit: float = 60.0) -> float | None:
    """Bytes per rank of the plan that needs the least memory (None if the solver fails)."""
    lean, _, _, memory = _model(prob, minimize_memory=True)
    status, _, _ = _run(lean, time_limit)
    return pulp.value(memory) * GB if status == "Optimal" else None


def replicated_memory(prob: Problem) -> float:
    """Bytes per rank when nothing is split (every op's last option, every value's R)."""
    return memory_of(prob, [0 if ch.value is not None else len(ch.options) - 1
                            for ch in prob.choices])


def objective_of(prob: Problem, picks: list[int]) -> float:
    """Seconds per step of a full assignment, as the ILP's objective counts them."""
    total = sum(ch.compute[k] + ch.comm[k] for ch, k in zip(prob.choices, picks))
    total += sum(table[picks[a]][picks[b]] for (a, b), table in prob.pairs.items())
    total += sum(sec for sec, readers in prob.syncs
                 if any(picks[b] in opts for b, opts in readers))
    return total


def memory_of(prob: Problem, picks: list[int]) -> float:
    """Bytes per rank of a full assignment, as the ILP's memory_limit counts them (under a
    pipeline: the fullest pipeline rank's)."""
    return max(memory_by_rank(prob, picks))


def memory_by_rank(prob: Problem, picks: list[int]) -> list[float]:
    """Bytes of each pipeline rank (one entry without a pipeline)."""
    extra = prob.fixed_memory
    for weight, units in prob.peaks:
        extra += weight * max((sum(row[picks[c]] for c, row in unit.items()) for unit in units),
                              default=0.0)
    if prob.groups is None:
        return [sum(ch.memory[k] for ch, k in zip(prob.choices, picks)) + extra]
    return [sum(ch.memory[k] * w[c] for c, (ch, k) in enumerate(zip(prob.choices, picks)))
            + extra for w in prob.groups]
