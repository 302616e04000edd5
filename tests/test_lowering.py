"""The lowering passes (split_stages, lower_zero3, lower_recompute): Before/Expected IR text,
and the last graph dump of a compile is the program each rank's file runs."""
import json
import re

import pytest

import models
import nncompile
from nncompile import ComputeConfig
from nncompile.api import compile_module, memory_choice
from nncompile.codegen import render
from nncompile.codegen.notes import comm_note
from nncompile.ir import (PipelinePlan, RecomputeMark, Stage, assert_graph_equal, parse_graph,
                          print_graph, verify)
from nncompile.ir.printer import op_notes, value_names
from nncompile.passes import LowerZero3, lower_recompute, split_stages
from nncompile.passes.split_stages import stage_views
from nncompile.codegen.body import render_body


def _ir(stages: str, body: str) -> str:
    return (f"# nncompile IR: plan_ngpus=1 stages={stages}\n"
            "def forward(\n"
            "    x,  # f32[4, 8] R\n"
            "    *,\n"
            "    w1,  # param 'h.0.fc.weight' f32[8, 8] R\n"
            "    w2,  # param 'h.1.fc.weight' f32[8, 8] R\n"
            "    head,  # param 'head.weight' f32[2, 8] R\n"
            "):\n" + "".join(f"    {ln.strip()}\n" for ln in body.strip().splitlines()))


BASE = "planned,comm_inserted,localized"
PROGRAM = """
    a = aten.linear.default(x, w1)  # f32[4, 8] R
    b = aten.relu.default(a)  # f32[4, 8] R
    c = aten.linear.default(b, w2)  # f32[4, 8] R
    e = aten.add.Tensor(c, x)  # f32[4, 8] R
    d = aten.linear.default(e, head)  # f32[4, 2] R
    loss = aten.sum.default(d)  # f32[] R
    return (loss,)"""


def asked(g, **fields):
    """`g` carrying the request the passes read (graph.config): one plan rank, two ranks."""
    g.config = ComputeConfig(1, 2, **fields)
    return g


def check(p, before, expected: str):
    """p(before) equals the graph `expected` prints, verifies, and a second run changes
    nothing."""
    got = verify(p(before))
    assert_graph_equal(got, parse_graph(expected))
    assert_graph_equal(p(got), got)
    return got


def mark(g, path: str, names: list[str]):
    """Mark the ops computing `names` as recompute region `path` (what the recompute pass
    does from module stacks, which printed IR does not carry)."""
    for op in g.ops:
        if op.outputs and op.outputs[0].name in names:
            op.recompute = RecomputeMark(path, 0)
    g.stages = g.stages | {Stage.RECOMPUTE_MARKED}
    return g


# after h.0: the later units' gathers, prefetches and frees (the same with or without a region)
ZERO_TAIL = """
        zero.gather('zero_h_1', 'h.1', [w2])
        zero.prefetch('zero_head', 'head')
        c = aten.linear.default(b, w2)  # f32[4, 8] R
        zero.free('zero_h_1', 'h.1', [w2])
        e = aten.add.Tensor(c, x)  # f32[4, 8] R
        zero.gather('zero_head', 'head', [head])
        d = aten.linear.default(e, head)  # f32[4, 2] R
        zero.free('zero_head', 'head', [head])
        loss = aten.sum.default(d)  # f32[] R
        return (loss,)"""


def test_lower_zero3_gathers_before_first_use_prefetches_next_frees_after_last():
    got = check(LowerZero3(), asked(parse_graph(_ir(BASE, PROGRAM)), use_zero=3), _ir(BASE + ",zero3_lowered", """
        zero.prefetch('zero_h_0', 'h.0')
        zero.gather('zero_h_0', 'h.0', [w1])
        zero.prefetch('zero_h_1', 'h.1')
        a = aten.linear.default(x, w1)  # f32[4, 8] R
        zero.free('zero_h_0', 'h.0', [w1])
        b = aten.relu.default(a)  # f32[4, 8] R
""" + ZERO_TAIL))
    assert got.plan_state.zero_units == {0: [("zero_h_0", "h.0", ("w1",)),
                                             ("zero_h_1", "h.1", ("w2",)),
                                             ("zero_head", "head", ("head",))]}


def test_lower_zero3_leaves_a_zero1_plan_alone():
    g = parse_graph(_ir(BASE, PROGRAM))
    assert LowerZero3()(asked(g, use_zero=1)) is g


def test_a_unit_used_only_in_a_region_is_gathered_inside_it():
    before = mark(parse_graph(_ir(BASE, PROGRAM)), "h.0", ["a", "b"])
    zeroed = LowerZero3()(asked(before, use_zero=3))
    check(lower_recompute, zeroed, _ir(BASE + ",recompute_marked,zero3_lowered,recompute_lowered",
                                       """
        zero.prefetch('zero_h_0', 'h.0')
        zero.prefetch('zero_h_1', 'h.1')
        checkpoint.begin('h.0', [x])
        zero.gather('zero_h_0', 'h.0', [w1])
        a = aten.linear.default(x, w1)  # f32[4, 8] R
        b = aten.relu.default(a)  # f32[4, 8] R
        checkpoint.end('h.0', [b])
""" + ZERO_TAIL))


def test_lower_recompute_region_takes_what_it_reads_and_returns_what_is_read_later():
    before = mark(parse_graph(_ir(BASE, PROGRAM)), "h.1", ["c", "e"])
    check(lower_recompute, before, _ir(BASE + ",recompute_marked,recompute_lowered", """
        a = aten.linear.default(x, w1)  # f32[4, 8] R
        b = aten.relu.default(a)  # f32[4, 8] R
        checkpoint.begin('h.1', [b, x])
        c = aten.linear.default(b, w2)  # f32[4, 8] R
        e = aten.add.Tensor(c, x)  # f32[4, 8] R
        checkpoint.end('h.1', [e])
        d = aten.linear.default(e, head)  # f32[4, 2] R
        loss = aten.sum.default(d)  # f32[] R
        return (loss,)"""))


def test_split_stages_cuts_the_program_and_relays_what_skips_a_stage():
    g = parse_graph(_ir(BASE + ",staged", PROGRAM))
    g.plan_state.pipeline = PipelinePlan(2, 1, "1f1b", 2, 1, [["h.0"], ["h.1", "head"]],
                                         [1.0, 1.0])
    for op in g.ops:
        op.stage = 0 if op.outputs[0].name in ("a", "b") else 1
    got = check(split_stages, g, _ir(BASE + ",staged,split", """
        pipeline.stage(0, [x])
        a = aten.linear.default(x, w1)  # f32[4, 8] R
        b = aten.relu.default(a)  # f32[4, 8] R
        pipeline.send(0, [x, b], relay=[x])
        pipeline.stage(1, [x, b])
        c = aten.linear.default(b, w2)  # f32[4, 8] R
        e = aten.add.Tensor(c, x)  # f32[4, 8] R
        d = aten.linear.default(e, head)  # f32[4, 2] R
        loss = aten.sum.default(d)  # f32[] R
        pipeline.send(1, [loss])
        return (loss,)"""))
    first, second = stage_views(got)
    assert [v.name for v in first.params] == ["w1"] and first.relayed[0].name == "x"
    assert [v.name for v in second.params] == ["w2", "head"]


def test_split_stages_refuses_layers_out_of_order():
    g = parse_graph(_ir(BASE + ",staged", PROGRAM))
    g.plan_state.pipeline = PipelinePlan(2, 1, "1f1b", 2, 1, [["h.1"], ["h.0"]], [1.0, 1.0])
    for op in g.ops:
        op.stage = 1 if op.outputs[0].name in ("a", "b") else 0
    with pytest.raises(nncompile.errors.GraphError, match="computed later, in stage 1"):
        split_stages(g)


# ---- the last dump is the program: ZeRO-3 + pipeline + recompute ----

def test_last_dump_holds_the_lowering_and_renders_every_rank_file_byte_for_byte(tmp_path):
    cfg = ComputeConfig(2, 4, use_zero=3, parallel={
        "pp": 2, "microbatches": 2, "recompute_modules": ["Block"]})
    compiled = compile_module(models.build("gpt"), models.batch("gpt", 0), cfg,
                              pas_policy="tp", outdir=tmp_path)
    final = compiled.final
    dumps = sorted((tmp_path / "graphs").glob("*.py"))
    assert [re.sub(r"^\d+_", "", p.stem) for p in dumps[-4:]] == [
        "split_stages", "pipeline_schedule", "lower_zero3", "lower_recompute"]
    text = dumps[-1].read_text()
    head, graph_text = text.split("\n", 1)
    schedule = [ln for ln in graph_text.splitlines(keepends=True)
                if ln.startswith(("# the '1f1b' schedule", "#   rank "))]   # the header's
    assert len(schedule) == 3 and graph_text.startswith("".join(schedule))  # ACTIONS table
    assert graph_text[len("".join(schedule)):] == print_graph(final)  # the dump is this graph
    for marker in ("pipeline.stage(", "pipeline.send(", "zero.prefetch(", "zero.gather(",
                   "zero.free(", "checkpoint.begin(", "checkpoint.end("):
        assert marker in text, marker
    fingerprint = json.loads((tmp_path / "manifest.json").read_text())["fingerprint"]
    memory = memory_choice(final, cfg)
    files = [(tmp_path / f"gencode{r}.py").read_text() for r in range(4)]
    for r in range(4):
        assert render(final, r, fingerprint, memory) == files[r]
    # the dump text alone (parsed back) gives each stage's body as its rank's file has it,
    # but for the `# attention: ...` notes (op.attrs, which printed IR does not carry)
    files = ["".join(ln for ln in f.splitlines(keepends=True) if "# attention: " not in ln)
             for f in files]
    parsed = parse_graph(text)
    for s, sg in enumerate(stage_views(parsed)):
        with value_names({v: f"self.{v.name}" for v in sg.buffers + parsed.consts}), \
                op_notes(comm_note):
            body = "\n".join(render_body(sg, "        ", 1))
        assert sum(body in f for f in files) == 2, f"stage {s}"   # its two ranks (dp 2)
