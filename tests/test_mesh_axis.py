"""A mesh axis beyond dp / pp / plan: one collective entry on a fake axis, and insert_comm,
the cost model, the printed IR and `nncompile show` account for it."""
import json

import pytest

import models
import nncompile
from nncompile import ComputeConfig
from nncompile.collectives import Collective, registered
from nncompile.comm_stats import format_rows
from nncompile.ir import (Replicate, Shard, assert_graph_equal, parse_graph, print_graph,
                          verify)
from nncompile.passes import insert_comm
from nncompile.passes.autodist.cost_model import CostModel, nbytes, step_cost
from nncompile.passes.autodist.profiles import get_profile
from nncompile.passes.policies import POLICIES
from nncompile.runtime.program.loader import load_rank_module
from nncompile.tools.inspection import show

# gathers a split along the fake axis; its backward (chunk) moves nothing
FAKE_GATHER = Collective("fake_gather", "all_gather", "chunk", ((Shard, Replicate),),
                         lambda s, d: {"dim": s.dim}, payload=lambda full, local, n: full,
                         ring_rounds=1, ring_bytes=lambda b, g: (g - 1) / g * b,
                         greedy_weight=1.0, group="fake")

PLANNED = """# nncompile IR: plan_ngpus=2 stages=planned
def forward(
    x,  # f32[4, 8] R @fake=S(0)
    *,
    w,  # param 'w' f32[6, 8] S(0)
):
    y = aten.linear.default(x, w)  # f32[4, 6] S(1)  [split n]
    return (y,)
"""


def planned():
    g = parse_graph(PLANNED)
    g.axes = {"fake": 4}
    g.ops[0].strategy.axis_inputs = {"fake": (Replicate(), None)}   # x whole along fake
    return g


def test_insert_comm_converts_along_the_fake_axis_with_its_group():
    with registered(FAKE_GATHER):
        g = verify(insert_comm(planned()))
    gather = next(op for op in g.ops if op.target_name == "comm.fake_gather")
    assert gather.args[0].name == "x" and gather.kwargs["dim"] == 0
    assert str(gather.kwargs["group"]) == "FAKE_GROUP"
    out = gather.outputs[0]
    assert out.axes == {} and out.placement_on("fake") == Replicate()
    assert g.mesh.names == ("dp", "fake", "plan") and out.placements(g.mesh) == (
        Replicate(), Replicate(), Replicate())
    text = print_graph(g)
    assert "x,  # f32[4, 8] R @fake=S(0)" in text and "group=FAKE_GROUP" in text
    assert text.startswith("# nncompile IR: plan_ngpus=2 axes=fake:4 stages=")
    assert_graph_equal(parse_graph(text), g)     # the axes and placements on them read back


def test_without_the_entry_insert_comm_names_the_axis():
    try:
        insert_comm(planned())
    except Exception as e:                       # noqa: BLE001 - checked below
        assert "along mesh axis 'fake'" in str(e) and "TABLE" in str(e)
    else:
        raise AssertionError("no collective on the fake axis, yet insert_comm converted")


def test_the_cost_model_prices_the_collective_by_its_axis():
    g = planned()
    x = g.inputs[0]
    with registered(FAKE_GATHER):
        for size in (2, 4, 8):
            model = CostModel(get_profile("h100-80g"), 2, axes={"fake": size})
            with_axis = step_cost(g, model).comm
            g.ops[0].strategy.axis_inputs = {}
            without = step_cost(g, model).comm
            g.ops[0].strategy.axis_inputs = {"fake": (Replicate(), None)}
            price = model.collective("fake_gather", nbytes(x))
            assert price > 0 and abs((with_axis - without) - price) < 1e-12
            assert model.axis_span("fake") == 2 * size          # outside the plan axis
            assert price == model.collective("fake_gather", nbytes(x), group=size,
                                             span=2 * size)
        # 8 x 2 ranks span two nodes of 8: the network's link, slower per byte
        assert model.collective("fake_gather", nbytes(x)) > \
            model.collective("fake_gather", nbytes(x), group=8, span=8)
        assert model.collective("fake_gather", nbytes(x)) != \
            CostModel(get_profile("h100-80g"), 2, axes={"fake": 2}).collective("fake_gather",
                                                                          nbytes(x))


def fake_axis_tp(graph, config):
    """The tp plan, with the batch of the model's input split along a fake mesh axis."""
    g = POLICIES["tp"](graph, config)
    g.axes = {"fake": 2}
    x = g.inputs[0]
    x.axes = {"fake": Shard(0)}
    first = next(op for op in g.ops if x in op.tensor_inputs())
    first.strategy.axis_inputs = {"fake": tuple(Replicate() if v is x else None
                                                for v in first.tensor_inputs())}
    return g


def test_nncompile_show_lists_the_collective_on_its_axis(tmp_path):
    with registered(FAKE_GATHER):
        nncompile.parallelize(models.build("mlp"), models.batch("mlp", 0), ComputeConfig(2, 4),
                              pas_policy=fake_axis_tp, gen_savedir=tmp_path, load_module=False)
    out = next(p for p in tmp_path.rglob("plan.json")).parent
    rows = [r for r in json.loads((out / "plan.json").read_text())["collective_ops"]
            if r["kind"] == "fake_gather"]
    assert len(rows) == 1 and rows[0]["axis"] == "fake" and rows[0]["from"] == "S(0)"
    assert rows[0]["forward_bytes"] == 4 * 16 * 4            # the full input, f32[4, 16]
    text = show(out)
    assert "fake_gather" in text and "S(0) -> R @fake" in text
    code = (out / "gencode0.py").read_text()
    assert "group=FAKE_GROUP" in code and "MESH_AXES = {'fake': 2}" in code
    with pytest.raises(nncompile.errors.ConfigError, match=r"axes \[.fake.\] beyond dp, pp, plan"):
        load_rank_module(out, 0, None)            # no runtime groups for it: said at load
    assert "S(0) -> R @fake" in format_rows(rows)          # the table show prints
