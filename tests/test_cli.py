"""The inspection commands (`nncompile show | ir | diff | plot`) on the quickstart's generated
code (tp, plan 2, run on 2 gloo ranks) and on a `data` plan of the same GPT."""
from __future__ import annotations

import collections
import hashlib
import importlib.util
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import nncompile
import nncompile.__main__
from conftest import ROOT
from rank_launch import free_port
from nncompile.tools import inspection
from nncompile.comm_stats import fmt_bytes

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "NNCOMPILE_QUIET": "1"}
PY = [sys.executable, "-m", "nncompile"]


def _quickstart_module():
    spec = importlib.util.spec_from_file_location("nncompile_example_quickstart",
                                                  os.path.join(ROOT, "examples", "quickstart.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _compile(qs, policy: str, config, savedir: Path, name: str) -> Path:
    """Another plan of the quickstart's GPT, compiled in this process."""
    import torch
    torch.manual_seed(0)
    model = qs.GPT(vocab_size=qs.VOCAB, block_size=qs.BLOCK, n_layer=2, n_head=4, n_embd=64)
    idx, targets = qs.batch(0)
    return nncompile.parallelize(model, {"idx": idx, "targets": targets}, config,
                                 pas_policy=policy, load_module=False, gen_savedir=savedir,
                                 instance_name=name)


@pytest.fixture(scope="module")
def gen(tmp_path_factory):
    """Run the quickstart in a temp dir (it writes .nncompile/GPT/), compile a `data` plan and
    a plan with 2 data-parallel units meanwhile, then run every CLI command at once."""
    tmp = tmp_path_factory.mktemp("cli")
    script = shutil.which("nncompile")
    assert script, "the nncompile console script is missing: run `pip install -e .`"
    quickstart = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
         f"--master_port={free_port()}", os.path.join(ROOT, "examples", "quickstart.py")],
        cwd=tmp, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    qs = _quickstart_module()
    data = _compile(qs, "data", nncompile.ComputeConfig(2), tmp / "other", "GPT_data")
    dp2 = _compile(qs, "tp_sp", nncompile.ComputeConfig(2, 4), tmp / "other", "GPT_dp2")
    out, _ = quickstart.communicate(timeout=600)
    assert quickstart.returncode == 0, out[-4000:]
    tp = tmp / ".nncompile"
    commands = {
        "show": [script, "show", str(tp)],
        "ir": PY + ["ir", str(tp)],
        "ir_constant_fold": PY + ["ir", str(tp), "--after", "constant_fold"],
        "ir_localize": PY + ["ir", str(tp), "--after", "localize"],
        "ir_bad": PY + ["ir", str(tp), "--after", "no_such_pass"],
        "diff": PY + ["diff", str(tp), str(data)],
        "diff_same": PY + ["diff", str(tp), str(tp / "GPT")],
        "diff_code": PY + ["diff", str(tp), str(data), "--code", "--rank", "1"],
        "plot": PY + ["plot", str(tp), "-o", str(tmp / "pics" / "plan.png")],
        "missing": PY + ["show", str(tmp / "not_generated")],
    }
    procs = {k: subprocess.Popen(cmd, cwd=tmp, env=ENV, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
             for k, cmd in commands.items()}
    results = {}
    for k, p in procs.items():
        stdout, stderr = p.communicate(timeout=300)
        results[k] = subprocess.CompletedProcess(commands[k], p.returncode, stdout, stderr)
    return dict(tmp=tmp, tp=tp / "GPT", data=data, dp2=dp2, run=results)


def _ok(gen, name: str) -> str:
    r = gen["run"][name]
    assert r.returncode == 0, f"{' '.join(r.args)} exited {r.returncode}:\n{r.stderr[-3000:]}"
    return r.stdout


def _load(inst: Path, name: str) -> dict:
    return json.loads((inst / name).read_text())


def _param_bytes(entry: dict) -> int:
    return sum(math.prod(b - a for a, b in p["slices"]) * 4 for p in entry["params"])


# ---- show ------------------------------------------------------------------------------------
def test_show_ranks_parameters_and_plan(gen):
    out = _ok(gen, "show")
    manifest, plan = _load(gen["tp"], "manifest.json"), _load(gen["tp"], "plan.json")
    assert all(p["dtype"] == "float32" for e in manifest["ranks"].values() for p in e["params"])
    for text in ("policy tp", "plan_ngpus 2", "runtime_ngpus 2", "data-parallel units 1"):
        assert text in out
    full = sum(math.prod(p["full_shape"]) * 4 for p in manifest["ranks"]["0"]["params"])
    assert re.search(rf"full model: {len(plan['params'])} parameters, [\d,]+ elements, "
                     rf"{full:,} B", out)
    places = collections.Counter(plan["params"].values())
    assert f"replicated (R): {places['R']}" in out
    for place, n in places.items():
        if place.startswith("S("):
            assert f"sharded on dim {place[2:-1]} ({place}): {n}" in out
    rows = {int(r): (int(n), int(b.replace(",", ""))) for r, n, b in re.findall(
        r"^  (\d+)\s+gencode\d+\.py\S*(?: \(edited\))?\s+(\d+)\s+[\d,]+\s+([\d,]+) B", out, re.M)}
    assert sorted(rows) == [0, 1], out
    for r, (n, nbytes) in rows.items():
        assert n == len(manifest["ranks"][str(r)]["params"])
        assert nbytes == _param_bytes(manifest["ranks"][str(r)])
        assert nbytes < full                      # tp splits weights across the unit
    assert sum(b for _, b in rows.values()) >= full


def test_show_collectives_and_reduction(gen):
    out = _ok(gen, "show")
    manifest, plan = _load(gen["tp"], "manifest.json"), _load(gen["tp"], "plan.json")
    rows = plan["collective_ops"]
    assert rows, "the tp plan has collectives"
    for kind in {r["kind"] for r in rows}:
        assert re.search(rf"^  {kind}\s", out, re.M), kind
    fwd, bwd = (sum(r[k] for r in rows) for k in ("forward_bytes", "backward_bytes"))
    assert re.search(rf"^  total\s+{len(rows)} collectives\s+{re.escape(fmt_bytes(fwd))}\s+"
                     rf"{re.escape(fmt_bytes(bwd))}$", out, re.M)
    partial = [p for p in manifest["ranks"]["0"]["params"] if p["partial_sum_count"] > 1]
    grad = sum(math.prod(b - a for a, b in p["slices"]) * 4 for p in partial)
    if partial:
        assert (f"{len(partial)} partial-sum gradients all-reduced (summed) over the plan unit "
                f"(2 ranks): {fmt_bytes(grad)} per rank") in out
    else:                     # Megatron's tp: every replicated weight gets its full gradient
        assert "partial-sum gradients" not in out
    assert "not reduced (one data-parallel unit)" in out


def test_show_total_equals_the_sum_by_kind(gen):
    """One source of truth: the table's total, its rows and the `by kind` line agree, also for
    a plan whose loss is split by rows (cross_entropy_rows all-reduces a count)."""
    for inst, text in ((gen["tp"], _ok(gen, "show")), (gen["data"], inspection.show(gen["data"]))):
        plan = _load(inst, "plan.json")
        section = text[text.index("Collectives per"):text.index("Gradient reduction")]
        total = int(re.search(r"^  total\s+(\d+) collectives", section, re.M)[1])
        by_kind = dict((k, int(v)) for k, v in re.findall(r"(\w+) (\d+)", re.search(
            r"^  by kind: (.*)$", section, re.M)[1]))
        listed = re.findall(r"^  (\w+)\s+\w+\s+\S+ -> ", section, re.M)
        assert total == sum(by_kind.values()) == len(listed) == len(plan["collective_ops"])
        assert by_kind == dict(collections.Counter(listed))
        assert by_kind == {k.removeprefix("comm."): v for k, v in plan["collectives"].items()}
    assert "cross_entropy_rows" in inspection.show(gen["data"])


def test_show_data_parallel_units_and_edited_files(gen, tmp_path):
    out = inspection.show(gen["dp2"])
    assert "data-parallel units 2" in out and "gencode3.py" in out
    assert "over the world (4 ranks)" in out
    assert "over the data-parallel group (2 ranks)" in out
    # a rank file whose sha256 differs from manifest.json's `files` is marked edited
    inst = tmp_path / "GPT"
    shutil.copytree(gen["tp"], inst)
    manifest = _load(inst, "manifest.json")
    manifest["files"] = {f"gencode{r}.py": hashlib.sha256((inst / f"gencode{r}.py")
                                                          .read_bytes()).hexdigest()
                         for r in range(2)}
    (inst / "manifest.json").write_text(json.dumps(manifest))
    with open(inst / "gencode1.py", "a") as f:
        f.write("# tuned by hand\n")
    out = inspection.show(tmp_path)
    assert re.search(r"^  1\s+gencode1\.py \(edited\)", out, re.M)
    assert not re.search(r"gencode0\.py \(edited\)", out)
    del manifest["files"]                          # older manifests: nothing to compare
    (inst / "manifest.json").write_text(json.dumps(manifest))
    assert "(edited)" not in inspection.show(inst)


def test_errors_say_what_is_missing(gen, tmp_path):
    r = gen["run"]["missing"]
    assert r.returncode == 2 and r.stderr.startswith("nncompile show: ")
    assert "does not exist" in r.stderr and "parallelize" in r.stderr
    with pytest.raises(nncompile.ConfigError, match="holds 2 instances.*GPT_data"):
        inspection.find_instance(gen["tmp"] / "other")
    (tmp_path / "empty").mkdir()
    with pytest.raises(nncompile.ConfigError, match="no generated code.*manifest.json"):
        inspection.show(tmp_path / "empty")
    shutil.copytree(gen["tp"], tmp_path / "GPT")
    (tmp_path / "GPT" / "plan.json").write_text("{\"policy\": ")
    with pytest.raises(nncompile.ConfigError, match="plan.json is not readable JSON.*override"):
        inspection.show(tmp_path)
    (tmp_path / "GPT" / "plan.json").write_text("{}")
    with pytest.raises(nncompile.ConfigError, match="plan.json lacks"):
        inspection.diff(tmp_path, gen["tp"])
    assert nncompile.__main__.main(["show", str(tmp_path)]) == 2


# ---- ir --------------------------------------------------------------------------------------
def test_ir_after_pass(gen):
    passes = sorted(p.stem for p in (gen["tp"] / "graphs").glob("*.py"))
    listing = _ok(gen, "ir")
    for stem in passes:
        number, name = stem.split("_", 1)
        lines = len((gen["tp"] / "graphs" / f"{stem}.py").read_text().splitlines())
        assert re.search(rf"^  {number}\s+{name}\s+{lines} lines$", listing, re.M), stem
    folded, local = _ok(gen, "ir_constant_fold"), _ok(gen, "ir_localize")
    assert "def forward(" in folded and "def forward(" in local and folded != local
    assert folded == (gen["tp"] / "graphs" / "01_constant_fold.py").read_text()
    # the header says the compile's plan size, and that the graph is not yet split there
    assert re.match(r"# after 'constant_fold' \(\d+\.\d ms\) of a plan_ngpus=2 compile: "
                    r"not yet partitioned", folded)
    assert re.match(r"# after 'localize' \(\d+\.\d ms\) of a plan_ngpus=2 compile\n"
                    r"# nncompile IR: plan_ngpus=2 ", local)
    assert inspection.ir_after(gen["tp"], "1") == folded
    bad = gen["run"]["ir_bad"]
    assert bad.returncode == 2 and bad.stderr.startswith("nncompile ir: ")
    for name in ("trace", "constant_fold", "dce", "plan", "insert_comm", "localize"):
        assert name in bad.stderr


# ---- diff ------------------------------------------------------------------------------------
def test_diff_two_plans(gen):
    out = _ok(gen, "diff")
    assert "policy: tp -> data" in out and "identical" not in out
    pa, pb = _load(gen["tp"], "plan.json"), _load(gen["data"], "plan.json")
    moved = [f for f in pa["params"] if pa["params"][f] != pb["params"][f]]
    assert moved
    for fqn in moved:
        assert f"  {fqn}: {pa['params'][fqn]} -> {pb['params'][fqn]}" in out
    ka, kb = (collections.Counter({k.removeprefix("comm."): v
                                   for k, v in p["collectives"].items()}) for p in (pa, pb))
    changed = [k for k in set(ka) | set(kb) if ka[k] != kb[k]]
    assert changed
    for kind in changed:
        assert re.search(rf"^  {kind}\s+{ka[kind]}\s+{kb[kind]}$", out, re.M), kind
    ma, mb = _load(gen["tp"], "manifest.json"), _load(gen["data"], "manifest.json")
    for r in ("0", "1"):
        a, b = _param_bytes(ma["ranks"][r]), _param_bytes(mb["ranks"][r])
        assert re.search(rf"^  rank {r}\s+\d+\s+\d+\s+{a:,} B.*\s{b:,} B", out, re.M)


def test_diff_identical_and_code(gen):
    assert "identical plans" in _ok(gen, "diff_same")
    code = _ok(gen, "diff_code")
    assert re.search(r"^--- .*GPT/gencode1\.py$", code, re.M)
    assert re.search(r"^\+\+\+ .*GPT_data/gencode1\.py$", code, re.M)
    assert re.search(r"^@@ ", code, re.M) and re.search(r"^-.*policy: tp", code, re.M)


# ---- plot ------------------------------------------------------------------------------------
def test_plot_writes_a_coloured_png(gen):
    import matplotlib.image
    png = gen["tmp"] / "pics" / "plan.png"
    assert _ok(gen, "plot").strip() == f"wrote {png}"
    assert png.is_file() and png.stat().st_size > 20_000
    assert [p.name for p in png.parent.iterdir()] == ["plan.png"]       # no temp file left
    pixels = (matplotlib.image.imread(png)[..., :3] * 255).round().astype(int).reshape(-1, 3)
    coloured = pixels[pixels.max(axis=1) - pixels.min(axis=1) >= 50]    # not white/grey/black
    buckets, counts = np.unique(coloured // 16, axis=0, return_counts=True)
    node_colours = [tuple(b * 16) for b, n in zip(buckets, counts) if n >= 300]
    places = set(_load(gen["tp"], "plan.json")["params"].values()) | {"P"}
    assert len(node_colours) >= 4 and len(node_colours) >= len(places), node_colours


# ---- profile ---------------------------------------------------------------------------------
def test_profile_summary_units_and_unaccelerated_dtypes():
    from nncompile.__main__ import fmt_rate, profile_summary
    from nncompile.passes.autodist.profiles import DeviceProfile
    assert fmt_rate(4.5e11) == "450 GFLOP/s" and fmt_rate(3.2e9) == "3.20 GFLOP/s"
    assert fmt_rate(1.25e13) == "12.5 TFLOP/s" and fmt_rate(2e15) == "2.00 PFLOP/s"
    assert fmt_rate(5e6) == "5.00 MFLOP/s" and fmt_rate(2.5e10, "B/s") == "25.0 GB/s"
    cpu = DeviceProfile("measured", flops={"float32": 1.2e11, "bfloat16": 3e9,
                                           "float16": 2.4e11}, mem_bandwidth=2.3e10,
                        mem_capacity_gb=64)
    line = profile_summary(cpu, "CPU")
    assert "0.00" not in line and "TFLOP/s" not in line
    assert "float32 120 GFLOP/s" in line
    assert "bfloat16 3.00 GFLOP/s (not accelerated on this CPU: 40.0x slower than float32)" \
        in line
    assert "float16 240 GFLOP/s;" in line and "memory 23.0 GB/s, 64.0 GB" in line
    gpu = DeviceProfile("h100", flops={"float32": 5e13, "bfloat16": 7e14})
    assert "bfloat16 700 TFLOP/s;" in profile_summary(gpu, "NVIDIA H100")
