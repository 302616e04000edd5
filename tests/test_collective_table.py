"""The collective table (nncompile/collectives.py): its entries agree with each other and with
the runtime, and a new entry is all insert_comm, the cost model, comm_stats and `nncompile show`
need to emit, price and count a collective."""
import dataclasses
import itertools
from pathlib import Path

import pytest
import torch

import models
import nncompile
from nncompile import ComputeConfig, collectives
from nncompile.tools import inspection
from nncompile.collectives import TABLE, by_name, registered, route, transition
from nncompile.comm_stats import collective_rows
from nncompile.frontend import trace
from nncompile.ir import Partial, Replicate, Shard, TensorMeta, Value
from nncompile.passes import build_pipeline, run_pipeline
from nncompile.passes.autodist.cost_model import CostModel
from nncompile.passes.autodist.profiles import BUILTIN
from nncompile.passes.policies import split_everything
from nncompile.passes.policies.greedy import transition_cost
from nncompile.runtime.program import comm

R, P, S0, S1 = Replicate(), Partial(), Shard(0), Shard(1)


# ---- the table agrees with itself and with the runtime --------------------------------------
@pytest.mark.parametrize("c", list(TABLE.values()), ids=list(TABLE))
def test_entry_is_consistent(c):
    assert c.dual in TABLE, f"{c.name}'s dual {c.dual!r} has no entry"
    assert c.reduce_grad_dual is None or c.reduce_grad_dual in TABLE
    assert all(k in TABLE for k in c.gloo_fallback)
    if c.forward is not None:
        assert callable(getattr(comm, c.forward)), f"runtime/program/comm.py lacks {c.forward}"
    assert c.is_local == (c.ring_bytes is None) and (c.ring_rounds == 0) == c.is_local
    if c.is_local:
        assert c.payload(100, 50, 2) == 0
    dual = by_name(c.dual)
    if dual.dual == c.name and c.transitions:
        # a pair of mutual duals undo each other: the dual goes back the same way
        assert set(dual.transitions) == {(b, a) for a, b in c.transitions}


def test_duals_are_the_documented_pairs():
    assert {k: c.dual for k, c in TABLE.items()} == {
        "all_reduce": "identity", "chunk": "all_gather", "all_gather": "chunk",
        "reduce_scatter": "all_gather", "all_to_all": "all_to_all", "to_partial": "identity",
        "sync_grad": "all_reduce", "identity": "identity"}
    for kind in ("chunk", "all_gather", "all_to_all", "identity"):
        assert by_name(by_name(kind).dual).dual == kind
    assert by_name("all_gather").backward_kind(reduce_grad=True) == "reduce_scatter"


def test_every_placement_pair_has_a_route():
    expect = {(R, S0): ["chunk"], (R, P): ["to_partial"], (P, R): ["all_reduce"],
              (P, S1): ["reduce_scatter"], (S0, R): ["all_gather"], (S0, S1): ["all_to_all"],
              (S0, P): ["all_gather", "to_partial"]}
    for src, dst in itertools.product((R, P, S0, S1), repeat=2):
        kinds = [c.name for c, _, _ in route(src, dst)]
        if src == dst:
            assert kinds == []
        elif (src, dst) in expect:
            assert kinds == expect[(src, dst)], (src, dst)
    assert transition(Replicate, Replicate) is None          # sync_grad is not a placement change
    assert collectives.grad_sync_collective().name == "sync_grad"
    with pytest.raises(ValueError, match="unknown collective 'nope'"):
        by_name("nope")


# ---- one new entry: emitted, priced, counted -------------------------------------------------
def _ring_twice(b, g):
    return 2 * (g - 1) / g * b


FAKE = dataclasses.replace(by_name("reduce_scatter"), name="reduce_scatter_fake",
                           forward="reduce_scatter", ring_bytes=_ring_twice)


def test_a_registered_collective_is_emitted_priced_and_counted(tmp_path):
    v = Value("x", TensorMeta((8, 16), torch.float32), requires_grad=True)
    model = CostModel(BUILTIN["cpu"], 2)
    before, _ = model.transition(v, P, S1, backward=False)
    with registered(FAKE):
        # insert_comm emits it for P -> S
        g = trace(models.build("mlp"), models.batch("mlp", 0))
        result = run_pipeline(g, build_pipeline(ComputeConfig(plan_ngpus=2), split_everything),
                              check=True)
        after_comm = dict((n, g) for n, g, _ in result.history)["insert_comm"]
        targets = [op.target_name for op in after_comm.ops]
        assert "comm.reduce_scatter_fake" in targets and "comm.reduce_scatter" not in targets

        # the cost model prices it with its own ring volume
        t, kinds = model.transition(v, P, S1, backward=False)
        p = model.profile
        assert kinds == ["reduce_scatter_fake"]
        assert t == p.collective_overhead + p.intra_latency + 512 / p.intra_bandwidth
        assert t > before

        # comm_stats lists it with its payload and dual
        rows = [r for r in collective_rows(after_comm) if r["kind"] == "reduce_scatter_fake"]
        assert len(rows) == 2
        assert all(r["forward_bytes"] == 4 * 64 * 4 and r["backward"] == "all_gather"
                   for r in rows if r["shape"] == [4, 64])

        # generated code calls it, the runtime resolves it, `nncompile show` counts it
        out = nncompile.parallelize(models.build("mlp"), models.batch("mlp", 0),
                                    ComputeConfig(plan_ngpus=2), pas_policy=split_everything,
                                    gen_savedir=tmp_path, load_module=False)
        assert "comm.reduce_scatter_fake(" in (Path(out) / "gencode0.py").read_text()
        assert comm.reduce_scatter_fake is comm.reduce_scatter
        text = inspection.show(out)
        assert "reduce_scatter_fake 2" in text
        assert sum(ln.lstrip().startswith("reduce_scatter_fake ") for ln in text.splitlines()) \
            == 2
        assert transition_cost(P, S1) == 1.0
    assert "reduce_scatter_fake" not in TABLE and transition(P, S1).name == "reduce_scatter"
    assert model.transition(v, P, S1, backward=False)[0] == before
    with pytest.raises(AttributeError):
        comm.reduce_scatter_fake
