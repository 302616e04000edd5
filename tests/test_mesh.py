"""Mesh.coords is the one place a rank's (dp, pp, plan) coordinates are computed.

The reference formulas below are the rank arithmetic codegen, the pipeline codegen, the
inspection tools and the Lightning sampler used to do themselves; the mesh (and the code that
now asks it) must give the same numbers for every rank. A source scan keeps new `rank // n`
arithmetic from appearing outside nncompile/mesh.py.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from nncompile import codegen
from nncompile.codegen import pipeline as pc
from nncompile.errors import ConfigError
from nncompile.ir import Graph
from nncompile.ir.graph import PipelinePlan, PlanState
from nncompile.mesh import Mesh

ROOT = Path(__file__).resolve().parents[1]

# (tensor-parallel ranks per stage, runtime_ngpus, pipeline ranks)
CONFIGS = [(1, 1, 1), (2, 2, 1), (2, 8, 1), (3, 6, 1), (1, 4, 2), (2, 8, 2), (2, 12, 3),
           (4, 16, 2), (1, 6, 3)]


# ---- the old formulas, as the code wrote them ---------------------------------------------
def old_position(rank: int, tp: int, pipe: int) -> tuple[int, int, int]:
    """(unit, pipeline rank, shard): codegen.pipeline.rank_position and codegen's header."""
    plan = pipe * tp
    return rank // plan, (rank % plan) // tp, rank % tp


def old_stage_rank(rank: int, tp: int, pipe: int, to_pipe: int) -> int:
    plan = pipe * tp
    return (rank // plan) * plan + to_pipe * tp + rank % tp


def old_header(rank: int, tp: int, pipe: int) -> str:
    n = tp
    if pipe == 1:
        return f"plan unit {rank // n}, shard {rank % n} of {n}"
    return (f"plan unit {rank // (n * pipe)}: pipeline rank {(rank % (n * pipe)) // n} of "
            f"{pipe}, tensor-parallel shard {rank % n} of {n}")


def pipelined_graph(tp: int, runtime: int, pipe: int) -> Graph:
    g = Graph([], [], [], [], [], plan_ngpus=tp, runtime_ngpus=runtime)
    if pipe > 1:
        g.plan_state = PlanState(pipeline=PipelinePlan(
            ranks=pipe, stages_per_rank=1, schedule="1f1b", microbatches=2, tp=tp,
            layers=[[f"h.{s}"] for s in range(pipe)], predicted_ms=[1.0] * pipe))
    return g


# ---- the mesh ------------------------------------------------------------------------------
@pytest.mark.parametrize("tp,runtime,pipe", CONFIGS)
def test_coords_round_trip(tp, runtime, pipe):
    mesh = Mesh.of(tp, runtime, pipe)
    assert mesh.world == runtime
    assert mesh.names == (("dp", "pp", "plan") if pipe > 1 else ("dp", "plan"))
    seen = set()
    for r in range(runtime):
        c = mesh.coords(r)
        assert list(c) == list(mesh.names)
        assert all(0 <= c[name] < size for name, size in mesh.dims)
        assert mesh.rank_of(c) == r
        seen.add(tuple(c.values()))
    assert len(seen) == runtime        # every rank its own coordinates


@pytest.mark.parametrize("tp,runtime,pipe", CONFIGS)
def test_coords_match_the_old_formulas(tp, runtime, pipe):
    mesh = Mesh.of(tp, runtime, pipe)
    assert mesh.size("dp") == runtime // (tp * pipe)
    for r in range(runtime):
        unit, pipe_rank, shard = old_position(r, tp, pipe)
        assert (mesh.unit_of(r), mesh.pipe_of(r), mesh.shard_of(r)) == (unit, pipe_rank, shard)
        if pipe > 1:
            for p in range(pipe):
                assert mesh.moved(r, pp=p) == old_stage_rank(r, tp, pipe, p)


@pytest.mark.parametrize("plan,world", [(1, 1), (1, 4), (2, 4), (4, 8), (3, 9)])
def test_unit_of_a_whole_plan_unit(plan, world):
    """The Lightning sampler and `nncompile show` see a unit as plan_ngpus ranks (a pipelined
    unit included): `rank // plan_ngpus` units of `world // plan_ngpus`."""
    mesh = Mesh.of(plan, world)
    assert mesh.size("dp") == world // plan
    assert [mesh.unit_of(r) for r in range(world)] == [r // plan for r in range(world)]


def test_off_the_mesh_is_a_clear_error():
    mesh = Mesh.of(2, 4)
    with pytest.raises(ConfigError, match="rank 4 is not on the mesh"):
        mesh.coords(4)
    with pytest.raises(ConfigError, match="plan=2 is off the mesh"):
        mesh.rank_of({"dp": 0, "plan": 2})
    with pytest.raises(ConfigError, match="no dimension"):
        mesh.moved(0, pp=1)


# ---- the code that now asks the mesh -------------------------------------------------------
@pytest.mark.parametrize("tp,runtime,pipe", CONFIGS)
def test_codegen_positions_match_the_old_formulas(tp, runtime, pipe):
    g = pipelined_graph(tp, runtime, pipe)
    for r in range(runtime):
        assert codegen.rank_position_text(codegen.rank_mesh(g, runtime), r) == \
            old_header(r, tp, pipe)
        if pipe > 1:
            unit, pipe_rank, _ = old_position(r, tp, pipe)
            got_unit, got_pipe, ids = pc.rank_position(g, r)
            assert (got_unit, got_pipe, ids) == (unit, pipe_rank, [pipe_rank])
            for s in range(pipe):          # one stage per pipeline rank: stage s on rank s
                assert pc.stage_rank(g, r, s) == old_stage_rank(r, tp, pipe, s)


def test_graph_mesh():
    g = Graph([], [], [], [], [], plan_ngpus=2)
    assert g.mesh == Mesh.of(2, 2)                 # one plan unit until runtime_ngpus is set
    g.runtime_ngpus = 8
    assert g.mesh == Mesh.of(2, 8) and g.clone().mesh == Mesh.of(2, 8)
    p = pipelined_graph(2, 8, 2)
    assert p.mesh == Mesh.of(2, 8, 2) and p.mesh.names == ("dp", "pp", "plan")
    assert p.clone().mesh == p.mesh
    assert codegen.rank_mesh(p, 16) == Mesh.of(2, 16, 2)     # codegen's runtime_ngpus wins


def test_compiled_graph_carries_its_mesh():
    """The compile sets runtime_ngpus on the traced graph; every pass keeps it."""
    import torch

    from nncompile.config import ComputeConfig
    from nncompile.frontend import trace
    from nncompile.passes import build_pipeline, get_policy, run_pipeline

    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    g = trace(model, (torch.randn(4, 8),))
    g.runtime_ngpus = 4
    config = ComputeConfig(2, 4)
    result = run_pipeline(g, build_pipeline(config, get_policy("tp")))
    for name, graph, _ in result.history:
        assert graph.runtime_ngpus == 4, name
    assert result.graph.mesh == Mesh.of(2, 4)


# ---- no rank arithmetic outside mesh.py ----------------------------------------------------
SCANNED = ("nncompile", "passes", "runtime", "integration")
# file -> source of a `//` or `%` the scan flags that is not a rank's mesh coordinate
ALLOWED = {
    # ZeRO splits one shard group (a list of ranks) into zero_ngroups slices: positions in
    # that list, not coordinates of the job's mesh
    ("runtime/protocol/groups.py", "ranks.index(rank) // size"),
    ("runtime/protocol/groups.py", "len(ranks) // ngroups"),
    # link profiling pairs neighbouring ranks (0-1, 2-3, ...), whatever the plan
    ("passes/autodist/profiles.py", "dist.get_rank() // 2"),
}


def rank_arithmetic(source: str) -> list[str]:
    """The `a // b` and `a % b` whose left side names a rank (`rank`, `r`, `*_rank`, ...)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.FloorDiv, ast.Mod)):
            names = [n.id for n in ast.walk(node.left) if isinstance(n, ast.Name)] + \
                [n.attr for n in ast.walk(node.left) if isinstance(n, ast.Attribute)]
            if "r" in names or any("rank" in n.lower() for n in names):
                out.append(ast.unparse(node))
    return out


def test_the_scan_finds_the_old_arithmetic():
    old = '''
def gencode(g, rank, n, pp, plan):
    unit = rank // (n * pp.ranks)
    shard = rank % n
    pipe_rank = (rank % plan) // pp.tp
    peer = (rank // plan) * plan + pipe * pp.tp + rank % pp.tp
    units = {r // plan for r in range(8)}
    sampler = {"rank": self.global_rank // self.plan_ngpus}
    chunk = shape[0] // n          # a tensor's split: not rank arithmetic
'''
    found = rank_arithmetic(old)
    assert "rank // (n * pp.ranks)" in found and "rank % n" in found
    assert "rank % plan // pp.tp" in found and "r // plan" in found
    assert "self.global_rank // self.plan_ngpus" in found
    assert not any("shape" in f for f in found)


def test_no_rank_arithmetic_outside_mesh():
    found = []
    for root in SCANNED:
        for path in sorted((ROOT / root).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel == "nncompile/mesh.py":
                continue
            found += [(rel, expr) for expr in rank_arithmetic(path.read_text())
                      if (rel, expr) not in ALLOWED]
    assert not found, ("rank arithmetic outside nncompile/mesh.py (ask the job's Mesh: "
                       f"coords, unit_of, pipe_of, shard_of, moved): {found}")
