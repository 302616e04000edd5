"""The plan fingerprint (nncompile/fingerprint.py) covers what decides the generated code and
not where it was compiled from; checkpoints load by comparing shards, not fingerprints."""
import importlib.util
import json
import shutil
import sys

import pytest
import torch

from conftest import ROOT, torchrun

import models
import nncompile
from nncompile.fingerprint import compute_fingerprint
from nncompile.frontend import trace
from nncompile.ir import print_graph
from nncompile.runtime.checkpoints.state import plan_mismatch

GPT_FILE = f"{ROOT}/examples/gpt.py"


def _compile(gen, config=None, policy="tp", instance=None):
    return nncompile.parallelize(models.build("gpt"), models.batch("gpt", 0),
                                 config or nncompile.ComputeConfig(2), pas_policy=policy,
                                 load_module=False, reuse="match", gen_savedir=gen,
                                 instance_name=instance)


def _fp(graph, config=None, policy="tp") -> str:
    return compute_fingerprint(graph, config or nncompile.ComputeConfig(2), policy)[0]


def _load(path, name: str):
    """Import the file at `path` as module `name` (replacing an earlier one of that name)."""
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_reuse_from_another_working_directory(tmp_path, monkeypatch):
    gen = tmp_path / "gen"
    monkeypatch.chdir(ROOT)
    out = _compile(gen)
    manifest = json.loads((out / "manifest.json").read_text())
    assert "# examples/gpt.py:" in manifest["traced_graph"]
    stamp = (out / "manifest.json").stat().st_mtime_ns
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    now = print_graph(trace(models.build("gpt"), models.batch("gpt", 0)))
    assert f"# {GPT_FILE}:" in now and now != manifest["traced_graph"]   # comments differ
    assert _compile(gen) == out
    assert (out / "manifest.json").stat().st_mtime_ns == stamp, "regenerated instead of reusing"
    with pytest.raises(nncompile.ReuseError) as e:      # a real change, from here too
        _compile(gen, nncompile.ComputeConfig(1))
    assert "plan_ngpus: 2 -> 1" in str(e.value)
    assert "traced graph changed" not in str(e.value), "source comments reported as a change"


def test_fingerprint_ignores_line_numbers_and_covers_the_plan(tmp_path):
    text = open(GPT_FILE).read()
    at = text.index("    def forward(self, idx, targets):")
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "gpt.py").write_text(text)
    (tmp_path / "b" / "gpt.py").write_text(text[:at] + "\n" + text[at:])
    graphs = []
    for d in ("a", "b"):
        torch.manual_seed(0)
        graphs.append(trace(_load(tmp_path / d / "gpt.py", f"fp_gpt_{d}").GPT(),
                            models.batch("gpt", 0)))
    assert print_graph(graphs[0]) != print_graph(graphs[1])         # line numbers moved
    assert print_graph(graphs[0], source=False) == print_graph(graphs[1], source=False)
    base = _fp(graphs[0])
    assert _fp(graphs[1]) == base
    assert _fp(graphs[0], nncompile.ComputeConfig(2, use_async_reducer=True)) == base
    changed = {
        "shape": _fp(trace(models.build("gpt"), models.batch("gpt", 0, batch_size=2))),
        "dtype": _fp(trace(models.build("gpt").double(), models.batch("gpt", 0))),
        "policy": _fp(graphs[0], policy="dp"),
        "plan_ngpus": _fp(graphs[0], nncompile.ComputeConfig(1)),
        "autodist device": _fp(graphs[0], nncompile.ComputeConfig(
            2, parallel={"device": "h100-80g"}), "autodist"),
    }
    assert all(fp != base for fp in changed.values()), changed
    assert _fp(graphs[0], nncompile.ComputeConfig(2, parallel={"device": "cpu"}),
               "autodist") != changed["autodist device"]


def test_callable_policy_and_custom_op_annotation(tmp_path):
    graph = trace(models.build("gpt"), models.batch("gpt", 0))
    body = ("from nncompile.passes.policies import POLICIES\n\n\n"
            "def policy(graph, config):\n{}    return POLICIES['tp'](graph, config)\n")
    fps = []
    for d, extra in (("a", ""), ("b", ""), ("c", "    graph = graph.clone()\n")):
        (tmp_path / d).mkdir()
        (tmp_path / d / "userpolicy.py").write_text(body.format(extra))
        fps.append(_fp(graph, policy=_load(tmp_path / d / "userpolicy.py", "userpolicy").policy))
    assert fps[0] == fps[1] != fps[2]        # the same code elsewhere; a changed body

    import custom_model
    g = torch.Generator().manual_seed(0)
    custom = trace(models.build("custom"), custom_model.batch(g))
    before = _fp(custom, policy="dp")
    try:
        nncompile.register_op(custom_model.row_softmax, "* d -> * d")
        assert _fp(custom, policy="dp") != before
    finally:
        nncompile.register_op(custom_model.row_softmax, "* d^ -> * d^")
    assert _fp(custom, policy="dp") == before


def test_reuse_error_names_a_changed_policy_body(tmp_path):
    gen = tmp_path / "gen"
    for d, extra in (("a", ""), ("b", "    graph = graph.clone()\n")):
        (tmp_path / d).mkdir()
        (tmp_path / d / "userpolicy.py").write_text(
            "from nncompile.passes.policies import POLICIES\n\n\n"
            f"def policy(graph, config):\n{extra}    return POLICIES['dp'](graph, config)\n")
    _compile(gen, nncompile.ComputeConfig(1),
             _load(tmp_path / "a" / "userpolicy.py", "userpolicy").policy, "P")
    with pytest.raises(nncompile.ReuseError) as e:
        _compile(gen, nncompile.ComputeConfig(1),
                 _load(tmp_path / "b" / "userpolicy.py", "userpolicy").policy, "P")
    assert "the policy's code changed" in str(e.value), str(e.value)


def test_plan_mismatch_names_the_first_differing_parameter():
    info = {"plan_ngpus": 2, "runtime_ngpus": 2, "rank": 0, "buffers": [],
            "params": [("wte_weight", "wte.weight", (64, 32), "S(0)", ((0, 32), (0, 32)), False),
                       ("fc_weight", "fc.weight", (8, 32), "R", ((0, 8), (0, 32)), False)]}
    saved = json.loads(json.dumps(info))                 # as a checkpoint stores it
    assert plan_mismatch(saved, info) is None
    other = {**info, "params": [info["params"][0],
                                ("fc_weight", "fc.weight", (8, 32), "S(0)", ((0, 4), (0, 32)),
                                 False)]}
    why = plan_mismatch(saved, other)
    assert why == "parameter 'fc.weight': placement R in the checkpoint, S(0) here", why
    assert "plan_ngpus is 2 in the checkpoint but 1 here" == \
        plan_mismatch(saved, {**info, "plan_ngpus": 1})
    assert "'fc.weight' is not in the checkpoint" in plan_mismatch(
        {**saved, "params": saved["params"][:1]}, info)


def test_sharded_checkpoint_loads_in_a_job_started_elsewhere(tmp_path):
    dirs = {}
    for d in ("a", "b"):                       # each job imports its own copy of the model
        dirs[d] = tmp_path / d
        (dirs[d] / f"src_{d}").mkdir(parents=True)
        shutil.copy(GPT_FILE, dirs[d] / f"src_{d}" / "gpt.py")
    ckpt = tmp_path / "shared"
    ckpt.mkdir()
    worker = "tests/workers/cwd_checkpoint.py"
    torchrun(worker, 2, "--phase", "save", "--dir", str(ckpt), "--model-dir", "src_a",
             cwd=dirs["a"])
    out = torchrun(worker, 2, "--phase", "load", "--dir", str(ckpt), "--model-dir", "src_b",
                   cwd=dirs["b"])
    manifests = [json.loads((dirs[d] / "gen" / "gpt_tp" / "manifest.json").read_text())
                 for d in ("a", "b")]
    assert "# src_a/gpt.py:" in manifests[0]["traced_graph"]
    assert "# src_b/gpt.py:" in manifests[1]["traced_graph"]      # other source comments
    assert manifests[0]["fingerprint"] == manifests[1]["fingerprint"]
    for name in ("gpt_tp", "gpt_tp_again"):
        assert f"ok loaded from another directory: {name}" in out, out[-3000:]
    refused = next(ln for ln in out.splitlines() if ln.startswith("refused: "))
    assert "shards differ" in refused and "parameter '" in refused, refused
    assert "policy 'tp'" in refused and "policy 'data'" in refused, refused


def test_reuse_match_after_adding_a_comment_line(tmp_path):
    """Editing the model file by a comment line (inside forward, so every later line number
    moves) leaves the program the same: reuse="match" reuses the generated code."""
    from nncompile.api import compile_module
    text = open(GPT_FILE).read()
    at = text.index("        pos = torch.arange(0, t")
    src = tmp_path / "src"
    src.mkdir()
    statuses = []
    for i, body in enumerate((text, text[:at] + "        # a comment the user added\n" + text[at:])):
        (src / "gpt.py").write_text(body)
        torch.manual_seed(0)
        model = _load(src / "gpt.py", f"comment_gpt_{i}").GPT()
        compiled = compile_module(model, models.batch("gpt", 0), nncompile.ComputeConfig(2, 2),
                                  pas_policy="tp", outdir=tmp_path / "gen", reuse="match")
        statuses.append(compiled.status)
    assert "# a comment the user added" in (src / "gpt.py").read_text()
    assert statuses == ["generated", "reused"]
