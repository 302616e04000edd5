"""Printed IR reads back: parse_graph(print_graph(g)) equals g for every stage of the pipeline."""
import functools
import textwrap

import pytest
import torch

import models
from nncompile import ComputeConfig
from nncompile.frontend import trace
from nncompile.ir import (DEVICE, PLAN_GROUP, IRParseError, Partial, Replicate, Shard, Stage,
                          assert_graph_equal, graph_diff, parse_graph, print_graph, verify)
from nncompile.passes.policies import split_everything
from nncompile.passes import build_pipeline, get_policy, run_pipeline


@functools.lru_cache(maxsize=None)
def history(name, policy=split_everything, n=2, **pas):
    """Every pass's graph; by default under a plan that splits every op (every collective)."""
    model, example = models.build(name), models.batch(name, 0)
    cfg = ComputeConfig(plan_ngpus=n, runtime_ngpus=n, parallel=dict(pas))
    return run_pipeline(trace(model, example), build_pipeline(cfg, get_policy(policy)),
                        check=True).history


def roundtrip(g):
    local = g.plan_ngpus if Stage.LOCALIZED in g.stages else None
    text = print_graph(g, local_n=local)
    back = parse_graph(text)
    assert_graph_equal(g, back)
    assert print_graph(back, local_n=local) == text
    verify(back)
    return back


@pytest.mark.parametrize("name", ["mlp", "gpt", "hf_llama", "custom"])
def test_every_stage_parses_back_equal(name):
    stages = history(name)
    assert [s for s, _, _ in stages] == ["trace", "constant_fold", "dce", "fuse_attention",
                                         "plan", "sink_gathers", "insert_comm", "localize",
                                         "overlap_grad_sync"]
    for stage, graph, _ in stages:
        roundtrip(graph)


def test_data_policy_and_recompute_stages_parse_back_equal():
    for _, graph, _ in history("gpt", "data"):
        roundtrip(graph)
    recomputed = history("gpt", "tp", recompute_modules=("Block",))
    assert Stage.RECOMPUTE_MARKED in recomputed[-1][1].stages
    for _, graph, _ in recomputed:
        roundtrip(graph)


def test_local_print_reads_full_shapes():
    g = dict((s, gr) for s, gr, _ in history("mlp"))["localize"]
    assert " of [" in print_graph(g, local_n=2)
    assert_graph_equal(g, parse_graph(print_graph(g)))     # with or without local shapes


def test_plan_stage_keeps_strategy_inputs_and_local_target():
    plan = dict((s, gr) for s, gr, _ in history("mlp"))["plan"]
    back = roundtrip(plan)
    ops = {op.name: op for op in back.ops}
    assert ops["fc2_linear"].strategy.inputs == (Shard(1), Shard(1), Partial())
    assert ops["cross_entropy_loss"].strategy.local_target == "comm.cross_entropy_rows"
    assert ops["relu"].strategy.inputs == (Shard(1),)           # not printed: its input's


def test_requires_grad_marks_where_the_default_does_not_hold():
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)

        def forward(self, x):
            h = self.fc(x)
            return (h * h.detach()).sum()

    g = trace(M(), (torch.ones(2, 4),))
    text = print_graph(g)
    assert "R no_grad" in text and text.count("no_grad") == 1
    back = roundtrip(g)
    detached = next(op for op in back.ops if op.target_name == "aten.detach.default")
    assert not detached.outputs[0].requires_grad


IR = '''
# nncompile IR: plan_ngpus=2 stages=planned,comm_inserted
# partial_grad_params: b
def forward(
    x,  # f32[4, 8] R requires_grad
    n,  #
    *,
    w,  # frozen param 'enc.w' f32[8, 8] S(0)
    b,  # param 'enc.b' f32[8] R
    buf,  # buffer 'enc.buf' i64[2] R
):
    # model.py:3  y = f(x)
    a = aten.full.default([2], float('-inf'), dtype=torch.float32, device=DEVICE, pin_memory=False)  # f32[2] R
    s0, s1 = aten.split.Tensor(x, 4, -1)  # f32[4, 4] R; f32[4, 4] R  [replicate]
    t, = aten.unbind.int(a)  # f32[2] R  [replicate]
    c = comm.all_reduce(s0, group=PLAN_GROUP)  # f32[4, 4] R  [all_reduce]
    # other.py:10  z = g(y)
    d = aten.index.Tensor(s1, [None, buf])  # f32[4, 2] R no_grad
    return (d, None, 1.5, (t, 'k'))
'''


def test_parse_reads_every_printed_form():
    g = parse_graph(IR)
    assert (g.plan_ngpus, g.stages) == (2, {Stage.PLANNED, Stage.COMM_INSERTED})
    assert g.plan_state.partial_grad_params == ["b"]
    x, n = g.inputs
    assert x.requires_grad and n.meta is None and x.meta.dtype is torch.float32
    w, b = g.params
    assert (w.fqn, w.requires_grad, w.placement, b.requires_grad) == ("enc.w", False, Shard(0),
                                                                       True)
    assert g.buffers[0].kind == "buffer" and g.buffers[0].meta.shape == (2,)
    full, split, unbind, comm, index = g.ops
    assert full.args == ([2], float("-inf")) and full.kwargs["device"] is DEVICE
    assert full.kwargs["dtype"] is torch.float32 and full.strategy is None
    assert split.multi_output and [v.name for v in split.outputs] == ["s0", "s1"]
    assert unbind.multi_output and len(unbind.outputs) == 1
    assert comm.target == "comm.all_reduce" and comm.kwargs["group"] is PLAN_GROUP
    assert comm.source is None and split.source.line == 3 and index.source.file == "other.py"
    assert index.args[1] == [None, g.buffers[0]] and not index.outputs[0].requires_grad
    assert split.strategy.inputs == (Replicate(),) and comm.strategy.note == "all_reduce"
    assert g.outputs[1:] == [None, 1.5, (unbind.outputs[0], "k")]
    printed = [ln.rstrip() for ln in print_graph(g).splitlines()]
    assert printed == textwrap.dedent(IR).strip().splitlines()


@pytest.mark.parametrize("line, message", [
    ("y = aten.relu.default(q)  # f32[2] R", "'q' is used before it is defined"),
    ("y = aten.no_such_op.default(x)  # f32[2] R", "unknown op target 'aten.no_such_op.default'"),
    ("y = os.system('ls')  # f32[2] R", "unknown op target 'os.system'"),
    ("y = aten.relu.default(__import__('os'))  # f32[2] R", "not an IR literal"),
    ("y = aten.relu.default(x)  # f32[2] Q", "cannot read tensor meta 'f32[2] Q'"),
    ("y = aten.relu.default(x)  # f32[2] R  [split dim 0]  wants (S(0), R)",
     "wants 2 placements for 1 inputs"),
    ("x = aten.relu.default(x)  # f32[2] R", "name 'x' defined twice"),
])
def test_parse_errors_name_the_line(line, message):
    text = f"def forward(\n    x,  # f32[2] R\n):\n    {line}\n    return (x,)\n"
    with pytest.raises(IRParseError) as e:
        parse_graph(text)
    assert message in str(e.value) and "line 4" in str(e.value)


def test_graph_diff_names_what_differs():
    g = dict((s, gr) for s, gr, _ in history("mlp"))["insert_comm"]
    other = g.clone()
    other.ops[1].outputs[0].placement = Replicate()
    other.ops[3].kwargs = {"dim": 0, "group": PLAN_GROUP}
    diffs = graph_diff(g, other)
    assert len(diffs) == 2 and "ops[1] (relu) outputs" in diffs[0] and "kwargs" in diffs[1]
    with pytest.raises(AssertionError, match=r"(?s)graphs differ in 2.*\+    relu = "):
        assert_graph_equal(g, other)
