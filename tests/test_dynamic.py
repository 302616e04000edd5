"""Dynamic batch and sequence length (parallelize(..., dynamic_dims=...), nncompile/symbolic.py):
multi-rank parity at three sizes per compile (tests/workers/dynamic.py), a Lightning run whose
last batch is smaller (against plain Lightning) with a checkpoint round trip, the generated
code's named sizes, guards, errors and autodist's report at the ranges' ends."""
from __future__ import annotations

import json
import subprocess
import sys
import warnings

import pytest
import sympy
import torch

import models
import nncompile
from conftest import ROOT, torchrun
from nncompile.symbolic import SizeSpec, Sym, divides, parse_dynamic_dims, to_code

GPT_DIMS = {"idx": {0: "batch", 1: {"name": "seq", "max": 16}},
            "targets": {0: "batch", 1: {"name": "seq", "max": 16}}}


def test_sizes_print_as_python_and_split_only_when_always_divisible():
    s = sympy.Symbol("s_seq", integer=True, positive=True)
    size = Sym(16, s)
    assert size == 16 and size % 2 != 0          # 16 now, but an odd s_seq is allowed
    assert (size // 2).code() == "s_seq // 2"
    k = SizeSpec("batch", 2, 64, 2)
    parse_dynamic_dims({"x": {0: {"name": "batch", "multiple_of": 2, "max": 64}}}, ["x"])
    batch = Sym(4, 2 * k.symbol)
    assert batch % 2 == 0 and batch % 4 != 0
    assert (batch // 2).code() == "s_batch // 2" and batch.code() == "s_batch"
    assert to_code(s * batch.expr) == "s_batch*s_seq"
    assert divides(6 * s + 4, 2) and not divides(s - 1, 2) and not divides(sympy.floor(s / 3), 2)


@pytest.mark.parametrize("dims, match", [
    ({"ids": {0: "batch"}}, "forward does not take"),
    ({"idx": [0]}, "must map dims"),
    ({"idx": {0: "batch size"}}, "size name"),
    ({"idx": {0: {"name": "batch", "step": 2}}}, "unknown keys"),
    ({"idx": {0: {"name": "batch", "min": 8}}}, "outside its own range"),
    ({"idx": {5: "batch"}}, "has 2 dims"),
    ({"idx": {0: {"name": "b", "max": 8}}, "targets": {0: {"name": "b", "max": 9}}},
     "two ranges"),
])
def test_bad_dynamic_dims_are_refused(tmp_path, dims, match):
    with pytest.raises(nncompile.ConfigError, match=match):
        nncompile.parallelize(models.build("gpt"), models.batch("gpt", 0),
                              nncompile.ComputeConfig(1, 1), pas_policy="dp",
                              gen_savedir=tmp_path, load_module=False, dynamic_dims=dims)


def test_generated_code_names_sizes_and_guards_calls(tmp_path):
    out = nncompile.parallelize(models.build("gpt"), models.batch("gpt", 0),
                                nncompile.ComputeConfig(2, 2), pas_policy="tp",
                                gen_savedir=tmp_path, load_module=False, dynamic_dims=GPT_DIMS)
    code = (out / "gencode1.py").read_text()
    assert "s_batch = idx.shape[0]" in code and "s_seq = idx.shape[1]" in code
    assert "[s_batch, s_seq, 2, 8]" in code                  # heads split, sizes by name
    assert "[s_batch*s_seq, 64]" in code and "sym_size" not in code
    assert "SIZES = {'s_batch': (2, 2147483647, 1), 's_seq': (2, 16, 1)}" in code
    pm = nncompile.parallelize(models.build("gpt"), models.batch("gpt", 0),
                               nncompile.ComputeConfig(1, 1), pas_policy="dp",
                               gen_savedir=tmp_path, instance_name="one", dynamic_dims=GPT_DIMS)
    eager = models.build("gpt")
    for b, t in [(4, 16), (3, 5)]:
        batch = models.batch("gpt", 1, batch_size=b, seq=t)
        torch.testing.assert_close(pm(**batch), eager(**batch))
    with pytest.raises(nncompile.InputMismatchError, match=r"dim 1 \(s_seq\) is 17, outside "
                                                           r"the allowed range \[2, 16\]"):
        pm(**models.batch("gpt", 1, batch_size=2, seq=17))
    with pytest.raises(nncompile.InputMismatchError, match="inputs sharing a size name"):
        pm(idx=torch.zeros(2, 8, dtype=torch.long), targets=torch.zeros(3, 8, dtype=torch.long))
    with pytest.raises(nncompile.InputMismatchError, match="dim 0 .*is 1, outside"):
        pm(**models.batch("gpt", 1, batch_size=1, seq=8))
    static = nncompile.parallelize(models.build("gpt"), models.batch("gpt", 0),
                                   nncompile.ComputeConfig(1, 1), pas_policy="dp",
                                   gen_savedir=tmp_path, instance_name="static")
    with pytest.raises(nncompile.InputMismatchError, match="dynamic_dims"):
        static(**models.batch("gpt", 1, batch_size=3, seq=16))


def test_unsplittable_sizes_are_reported(tmp_path):
    """data at plan 2 cannot split a batch that may be odd: the plan says why and how."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        nncompile.parallelize(models.build("gpt"), models.batch("gpt", 0),
                              nncompile.ComputeConfig(2, 2), pas_policy="data",
                              gen_savedir=tmp_path, load_module=False, dynamic_dims=GPT_DIMS)
    text = " ".join(str(w.message) for w in caught)
    assert "splits nothing" in text and "'multiple_of': 2" in text and "'idx'" in text
    dims = {k: {0: {"name": "batch", "multiple_of": 2}} for k in ("idx", "targets")}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = nncompile.parallelize(models.build("gpt"), models.batch("gpt", 0),
                                    nncompile.ComputeConfig(2, 2), pas_policy="data",
                                    gen_savedir=tmp_path, load_module=False,
                                    instance_name="even", dynamic_dims=dims)
    assert not [w for w in caught if "splits nothing" in str(w.message)]
    assert "[s_batch // 2, 16, 4, 8]" in (out / "gencode0.py").read_text()
    with pytest.raises(nncompile.ConfigError, match="micro-batches or pipeline"):
        nncompile.parallelize(models.build("gpt"), models.batch("gpt", 0),
                              nncompile.ComputeConfig(2, 2, parallel={"microbatches": 2}),
                              pas_policy="data", gen_savedir=tmp_path, load_module=False,
                              instance_name="mb", dynamic_dims=dims)


def test_autodist_reports_the_plan_at_the_ranges_ends(tmp_path):
    dims = {k: {0: {"name": "batch", "multiple_of": 2, "max": 64}, 1: {"name": "seq", "max": 32}}
            for k in ("input_ids", "labels")}
    out = nncompile.parallelize(models.build("hf_llama"), models.batch("hf_llama", 0),
                                nncompile.ComputeConfig(2, 2), pas_policy="autodist",
                                gen_savedir=tmp_path, load_module=False, dynamic_dims=dims)
    rows = {r["at"]: r for r in json.loads((out / "plan.json").read_text())["autodist"]["sizes"]}
    assert rows["dummy args"]["sizes"] == {"batch": 4, "seq": 16}
    assert rows["smallest"]["sizes"] == {"batch": 2, "seq": 2}
    assert rows["largest"]["sizes"] == {"batch": 64, "seq": 32}
    assert rows["smallest"]["ms"] < rows["dummy args"]["ms"] < rows["largest"]["ms"]
    assert rows["largest"]["memory_gb"] > rows["dummy args"]["memory_gb"]
    report = (out / "plan_report.txt").read_text()
    assert "ranges' ends" in report and "batch=64, seq=32" in report


def test_dynamic_parity_at_three_sizes(run_ranks, tmp_path):
    out = tmp_path / "report.json"
    run_ranks("tests/workers/dynamic.py", 2, "--savedir", str(tmp_path / "gen"), "--out", str(out))
    results = json.loads(out.read_text())
    assert {(r["model"], r["policy"]) for r in results} == {
        ("gpt", "tp"), ("gpt", "data"), ("hf_llama", "tp"), ("hf_llama", "autodist"),
        ("gpt", "dp")}
    for r in results:
        assert r["max_grad_err"] < 1e-5, r
        assert r["outside"] and "s_seq) is 17, outside the allowed range [2, 16]" in r["outside"]
        assert r["symbolic_args"] > 10 and "'s_seq': (2, 16, 1)" in r["sizes_line"], r


def test_lightning_last_batch_smaller_matches_plain_lightning(tmp_path):
    torchrun("tests/workers/lightning_dynamic.py", 2, "--out", str(tmp_path / "nn.json"),
             "--savedir", str(tmp_path / "gen"))
    subprocess.run([sys.executable, "tests/workers/lightning_dynamic.py", "--plain", "--out",
                    str(tmp_path / "plain.json"), "--savedir", str(tmp_path / "plain")],
                   cwd=ROOT, check=True, capture_output=True, env={
                       **__import__("os").environ, "OMP_NUM_THREADS": "1"})
    ours = json.loads((tmp_path / "nn.json").read_text())
    plain = json.loads((tmp_path / "plain.json").read_text())
    assert [r[1] for r in ours["losses"]] == [4, 4, 2, 4, 4, 2]      # the last batch is smaller
    assert len(ours["losses"]) == len(plain["losses"])
    for (s1, b1, a), (s2, b2, b) in zip(ours["losses"], plain["losses"]):
        assert (s1, b1) == (s2, b2) and abs(a - b) <= 1e-5 * abs(b), (s1, a, b)
    before, after = ours["resumed"]              # a checkpoint of a dynamic compile loads back
    assert abs(before - after) <= 1e-6 * abs(before)


def test_fused_projections_and_mla_follow_dynamic_sizes(run_ranks, tmp_path):
    """GPT-BigCode, Falcon (multi-query, new architecture) and DeepSeek-V3 (MLA) at plan 2,
    traced at (2, 16): at (3, 12), at (4, 8) (the traced token count) and back at (2, 16),
    loss and every gradient equal one device's (tests/workers/dynamic_fused.py)."""
    out = tmp_path / "report.json"
    run_ranks("tests/workers/dynamic_fused.py", 2, "--savedir", str(tmp_path / "gen"),
              "--out", str(out))
    results = json.loads(out.read_text())
    assert {(r["model"], r["policy"]) for r in results} == {
        ("gpt_bigcode", "tp"), ("falcon_multi_query", "tp"), ("falcon_new", "tp"),
        ("deepseek_v3", "tp"), ("falcon_new", "tp_sp"), ("gpt_bigcode", "autodist")}
    for r in results:
        assert set(r["sizes"]) == {"3x12", "4x8", "2x16"}, r
        for size, e in r["sizes"].items():
            assert e["max_grad_err"] < 1e-5 and e["grads"] >= 15, (r["model"], size, e)
        assert sum(n for k, n in r["collectives"].items() if k != "comm.sync_grad"), r  # splits
    sp = next(r for r in results if r["policy"] == "tp_sp")
    assert sp["collectives"].get("comm.reduce_scatter", 0) > 0, sp    # the sequence is split


def _bake_first_reshape(graph):
    """A pass that forgets the symbols: the first dynamic reshape gets its traced sizes."""
    g = graph.clone()
    op = next(o for o in g.ops if o.target_name in ("aten.view.default", "aten.reshape.default")
              and any(isinstance(s, Sym) for s in o.args[1]))
    op.args = (op.args[0], [int(s) for s in op.args[1]])
    return g


def test_guard_names_the_pass_and_op_that_bakes_a_dynamic_size():
    from nncompile.frontend import trace
    from nncompile.ir.verify_sizes import second_point, verify_sizes
    from nncompile.passes import PassError, run_pipeline
    graph = trace(models.build("gpt"), models.batch("gpt", 0), dynamic_dims=GPT_DIMS)
    assert second_point(graph)          # the sizes move: batch 4 -> 5, seq 16 -> 15 (max 16)
    assert verify_sizes(graph) is graph
    _bake_first_reshape.__name__ = "bake"
    op = next(o for o in graph.ops if o.target_name in ("aten.view.default",
                                                           "aten.reshape.default")
              and any(isinstance(s, Sym) for s in o.args[1]))
    with pytest.raises(nncompile.GraphError) as info:
        run_pipeline(graph, [_bake_first_reshape])
    text = str(info.value)
    assert not isinstance(info.value, PassError)
    assert f"pass 'bake' built op {op.name} ({op.target_name})" in text, text
    assert "s_batch=4, s_seq=16" in text and "at s_batch=5, s_seq=15 it fails" in text, text
    assert "keep_symbols" in text


@pytest.mark.parametrize("name", ["mlp", "gpt", "hf_gpt2", "hf_llama", "hf_t5", "hf_bart",
                                  "custom"])
def test_guard_passes_every_test_model_with_dynamic_dims(name, tmp_path, monkeypatch):
    """Every model of tests/models.py, batch and sequence dynamic, at plan 2 under tp: the
    guard runs on the training (and eval) program, checks its ops and finds nothing."""
    import nncompile.ir.verify_sizes as guard
    checked, runs = [], guard._run

    def counting(op, graph, point):
        checked.append(op.name)
        return runs(op, graph, point)
    monkeypatch.setattr(guard, "_run", counting)
    data = models.batch(name, 0)
    dims = {k: ({0: "batch"} if name == "mlp" or v.dim() < 2 else
                {0: "batch", 1: {"name": "seq", "min": 3, "max": 16}})
            for k, v in data.items()}
    nncompile.parallelize(models.build(name), data, nncompile.ComputeConfig(2, 2),
                          pas_policy="tp", gen_savedir=tmp_path, load_module=False,
                          dynamic_dims=dims)
    assert len(checked) >= 5, checked
