"""autodist chooses the pipeline: balanced whole-layer cuts of a Llama shape built on the meta
device (compile only), the stage count under pipeline_stages="auto" on known answers, the
memory bound moving a cut, and the cut in plan.json, plan_report.txt, explain and `show`."""
import json
import os
import re
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import nncompile
from nncompile import ComputeConfig, ConfigError
from nncompile.frontend import trace
from nncompile.passes import PartitionStages

sys.path.insert(0, os.path.dirname(__file__))
from models import HFCausalLM  # noqa: E402

LAYERS, STAGES, TP, M = 16, 4, 2, 4


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A 16-layer Llama-3-shaped model (GQA, SwiGLU) on the meta device, autodist with 4
    pipeline stages x 2 tensor-parallel ranks for an H100 profile, compiled only."""
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=4096, hidden_size=1024, intermediate_size=3584,
                      num_hidden_layers=LAYERS, num_attention_heads=16, num_key_value_heads=4,
                      max_position_embeddings=1024, bos_token_id=0, eos_token_id=0,
                      pad_token_id=0)
    with torch.device("meta"):
        model = HFCausalLM(LlamaForCausalLM(cfg))
    ids = torch.zeros(M, 512, dtype=torch.long, device="meta")
    out = nncompile.parallelize(
        model, {"input_ids": ids, "labels": ids},
        ComputeConfig(STAGES * TP, parallel={"device": "h100-80g", "pp": STAGES,
                                               "microbatches": M}),
        gen_savedir=tmp_path_factory.mktemp("llama"), load_module=False, instance_name="llama")
    return out, json.loads((out / "plan.json").read_text())


def test_llama_stages_are_whole_layers_and_balanced(llama):
    out, plan = llama
    pipe = plan["pipeline"]
    assert (pipe["ranks"], pipe["tp"], pipe["nstages"]) == (STAGES, TP, STAGES)
    assert pipe["chosen_by"].startswith("autodist plan at tp=2")
    assert sorted(p.name for p in out.glob("gencode*.py")) == \
        sorted(f"gencode{r}.py" for r in range(STAGES * TP))
    # the stages' layers are the model's layers in order, each once
    layers = [name for st in pipe["stages"] for name in st["layers"]]
    assert layers == [f"model.model.layers.{i}" for i in range(LAYERS)]
    # whole layers: every op of a layer runs in that layer's stage
    stage_of = {name: st["stage"] for st in pipe["stages"] for name in st["layers"]}
    for op in plan["ops"]:
        parts = op["module"].split(".")
        if "layers" in parts and not op["op"].startswith("comm."):
            layer = ".".join(parts[:parts.index("layers") + 2])
            assert op["stage"] == stage_of[layer], op
    times = [st["predicted_ms"] for st in pipe["stages"]]
    assert max(times) <= 1.10 * sum(times) / len(times), times
    assert pipe["balance"] == pytest.approx(max(times) / (sum(times) / len(times)))
    # the memory of each stage fits the profile's 80 GB; 1F1B keeps S - p micro-batches
    assert [st["inflight_microbatches"] for st in pipe["stages"]] == [4, 3, 2, 1]
    assert all(0 < st["memory_bytes"] <= 80e9 for st in pipe["stages"])
    assert len(pipe["rank_memory_bytes"]) == STAGES
    assert [st["ranks"] for st in pipe["stages"]] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    # tensor parallel inside each stage: Megatron-style all-reduces, two per layer (a layer's
    # last one runs in the next stage when the next layer is the first to read it)
    comm = [st["collectives"] for st in pipe["stages"]]
    assert sum(c.get("all_reduce", 0) for c in comm) >= 2 * LAYERS, comm
    assert all(c.get("all_reduce", 0) >= 2 * len(st["layers"]) - 1
               for c, st in zip(comm, pipe["stages"])), comm


def test_llama_cut_in_report_explain_and_show(llama, capsys):
    out, plan = llama
    report = (out / "plan_report.txt").read_text()
    assert "pipeline: 4 stages on 4 pipeline ranks x tp 2 (1f1b, 4 micro-batches" in report
    assert "why: the cut minimizes the slowest stage's forward+backward time" in report
    text = nncompile.explain(out, "pipeline")
    assert "model.model.layers.0 ... model.model.layers.3 (4)" in text
    assert "memory (limit 80 GB per rank" in text.replace("80.000 GB", "80 GB")
    from nncompile.__main__ import main
    assert main(["show", str(out)]) == 0
    shown = capsys.readouterr().out
    assert "mesh dp 1 x pp 4 x plan 2" in shown
    assert "pipeline: 4 stages on 4 pipeline ranks x tp 2, 1f1b, 4 micro-batches" in shown
    for s in range(STAGES):
        lo, hi = 4 * s, 4 * s + 3
        assert f"model.model.layers.{lo} ... model.model.layers.{hi} (4)" in shown
        assert f"stage {s} (pipeline rank {s}, ranks {2 * s}-{2 * s + 1}):" in shown
    assert "stages  params" in shown                   # the ranks table names their stages
    full = sum(1 for _ in plan["params"])
    assert f"full model: {full} parameters" in shown   # all stages, not rank 0's alone
    assert re.search(r"plan unit 0 \(ranks 0-7\): parameters .* = 1\.0\d x the full", shown)


class Stack(nn.Module):
    """Identical tanh layers, traced on one micro-batch of 1 x 63 x 25: no dimension divides by
    a tensor-parallel degree, so nothing splits."""

    def __init__(self, n=8, d=25):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.layers = nn.ModuleList([nn.Linear(d, d) for _ in range(n)])
        self.out = nn.Linear(d, d)

    def forward(self, x, y):
        h = self.inp(x)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return F.mse_loss(self.out(h), y)


@pytest.fixture(scope="module")
def stack_graph():
    torch.manual_seed(0)
    return trace(Stack(), {"x": torch.randn(1, 63, 25), "y": torch.randn(1, 63, 25)})


def _cut(graph, pas, plan=4, autodist=True):
    cfg = ComputeConfig(plan, plan, parallel={"device": "cpu", **pas})
    graph = graph.clone()
    graph.config = cfg                  # what the passes read: the compile's request
    return PartitionStages(autodist=autodist)(graph)


def test_auto_picks_the_stage_count_memory_forces(stack_graph):
    """Nothing splits, so tensor parallelism saves no memory and no time: with room to spare
    one stage on 4 ranks is fastest (no bubble, no sends); a limit below half the model leaves
    only 4 stages."""
    g = _cut(stack_graph, {"pp": "auto"})
    assert g.plan_state.pipeline is None
    search = g.plan_state.pipeline_search
    assert [(c["stages"], c["status"]) for c in search["candidates"]] == \
        [(1, "chosen"), (2, "fits"), (4, "slower (bound)")]
    whole = search["candidates"][0]["memory_bytes"]
    g = _cut(stack_graph, {"pp": "auto", "mem_limit_gb": whole * 0.4 / 1e9})
    pp = g.plan_state.pipeline
    assert (pp.ranks, pp.tp) == (4, 1)
    assert pp.chosen_by.startswith("autodist: 4 of the stage counts [1, 2, 4]")
    assert [c["status"] for c in g.plan_state.pipeline_search["candidates"]] == \
        ["too large", "too large", "chosen"]
    with pytest.raises(ConfigError, match=r"no cut of 8 layers into pipeline stages fits .* "
                                          r"4 stage\(s\) x tp 1: the balanced cut's fullest"):
        _cut(stack_graph, {"pp": "auto", "mem_limit_gb": whole * 0.01 / 1e9})


def test_memory_moves_the_cut_off_the_first_stage(stack_graph):
    """1F1B keeps 2 micro-batches in flight on the first of 2 stages and one on the second:
    a limit the balanced cut exceeds moves layers to the second stage."""
    pas = {"pp": 2, "microbatches": 4}
    free = _cut(stack_graph, pas, plan=2).plan_state.pipeline
    first = len(free.layers[0])
    assert free.memory_bytes[0] > free.memory_bytes[1]
    limit = (free.memory_bytes[0] + free.memory_bytes[1]) / 2
    for autodist in (True, False):
        g = _cut(stack_graph, {**pas, "mem_limit_gb": limit / 1e9}, plan=2, autodist=autodist)
        pp = g.plan_state.pipeline
        assert len(pp.layers[0]) < first and sum(map(len, pp.layers)) == 8
        assert max(pp.memory_bytes) <= limit and max(pp.predicted_ms) > max(free.predicted_ms)
        assert "the memory limit moved the cut" in g.plan_state.pipeline_search["memory_note"]


def test_auto_needs_autodist(stack_graph):
    with pytest.raises(ConfigError, match="'auto' is chosen by autodist; use "
                                          "pas_policy='autodist'"):
        _cut(stack_graph, {"pp": "auto"}, autodist=False)


def test_auto_schedule_prices_each_schedule_from_its_actions(stack_graph):
    """schedule='auto': autodist prices every schedule for the given V from its action list
    (passes/schedule_time.py) and keeps the fastest that fits. At pp 2, M = 8 with equal stages
    the zero-bubble orders idle least (ZB-H1 at V = 1; ZB-V at V = 2, ahead of DualPipeV and
    interleaved 1F1B); DualPipeV cannot run on M < 2S and is passed over."""
    g = _cut(stack_graph, {"pp": 2, "microbatches": 8, "schedule": "auto"}, plan=2)
    pp, search = g.plan_state.pipeline, g.plan_state.pipeline_search
    assert pp.schedule == "zero_bubble" and search["auto_schedule"]
    steps = {c["schedule"]: c["step_ms"] for c in search["candidates"]}
    assert set(steps) == {"gpipe", "1f1b", "zero_bubble"}
    assert steps["zero_bubble"] < min(steps["1f1b"], steps["gpipe"])
    assert steps["1f1b"] == pytest.approx(steps["gpipe"], rel=0.01)    # one bubble, M = 8
    assert "schedule 'zero_bubble' of ['gpipe', '1f1b', 'zero_bubble']" in pp.chosen_by
    g = _cut(stack_graph, {"pp": 2, "microbatches": 8, "schedule": "auto",
                           "stages_per_rank": 2}, plan=2)
    rows = {c["schedule"]: c for c in g.plan_state.pipeline_search["candidates"]}
    assert g.plan_state.pipeline.schedule == "zero_bubble"
    assert rows["zero_bubble"]["step_ms"] < rows["dualpipev"]["step_ms"] \
        < rows["interleaved_1f1b"]["step_ms"]
    g = _cut(stack_graph, {"pp": 2, "microbatches": 2, "schedule": "auto",
                           "stages_per_rank": 2}, plan=2)
    rows = {c["schedule"]: c["status"] for c in g.plan_state.pipeline_search["candidates"]}
    assert rows["dualpipev"] == "cannot run" and "chosen" in rows.values()
    with pytest.raises(ConfigError, match="parallel.schedule='auto' is chosen by autodist"):
        _cut(stack_graph, {"pp": 2, "microbatches": 8, "schedule": "auto"}, plan=2,
             autodist=False)
