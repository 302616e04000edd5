"""autodist: known answers, the objective against a closed form, memory bounds, identical
layers, plan files, constraints, recompute, explanations and solver failures (no timing)."""
import json
import re

import pulp
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import nncompile
from models import GPT
from gpt import Block
from nncompile import ComputeConfig, ConfigError, PlanInfeasibleError, PolicyError
from nncompile.frontend import trace
from nncompile.passes.autodist import BUILTIN, get_profile, ilp, measure_profile, plan_problem, \
    save_profile


class MLP(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.fc1 = nn.Linear(d, h)
        self.fc2 = nn.Linear(h, d)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


class Blocks(nn.Module):
    """Token embedding + identical GPT blocks (ModuleList `h`), returning hidden states."""

    def __init__(self, depth, d, heads, vocab=256):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.h = nn.ModuleList(Block(d, heads) for _ in range(depth))

    def forward(self, idx):
        x = self.wte(idx)
        for block in self.h:
            x = block(x)
        return x


class Classifier(MLP):
    def forward(self, x, y):
        return F.cross_entropy(super().forward(x), y)


def compile_plan(tmp_path, module, args, plan=2, name="m", **pas_config):
    pas_config.setdefault("device", "h100-80g")
    out = nncompile.parallelize(module, args, ComputeConfig(plan, plan, parallel=pas_config),
                                gen_savedir=tmp_path, reuse="override", load_module=False,
                                instance_name=name)
    return out, json.loads((out / "plan.json").read_text())


def big_mlp():
    with torch.device("meta"):
        return MLP(4096, 16384), (torch.empty(8, 4096, device="meta"),)


def test_large_mlp_is_column_then_row_with_one_all_reduce(tmp_path):
    out, plan = compile_plan(tmp_path, *big_mlp())
    assert plan["policy"] == "autodist"
    assert plan["params"]["fc1.weight"] == "S(0)" and plan["params"]["fc2.weight"] == "S(1)"
    assert plan["collectives"].get("comm.all_reduce") == 1
    assert set(plan["collectives"]) <= {"comm.all_reduce", "comm.to_partial"}


def test_objective_equals_closed_form(tmp_path):
    _, plan = compile_plan(tmp_path, *big_mlp())
    h100 = BUILTIN["h100-80g"]
    peak, bw, f4 = h100.flops["float32"], h100.mem_bandwidth, 4
    B, D, H, n = 8, 4096, 16384, 2

    def op(flops, elements):                        # forward + backward (x3), roofline
        return 3 * max(flops / peak, elements * f4 / bw)

    fc1 = op(2 * B * H * D / n, B * D + H * D / n + H / n + B * H / n)
    relu = op(B * H / n, 2 * B * H / n)
    fc2 = op(2 * B * D * H / n, B * H / n + D * H / n + D + B * D)
    all_reduce = (h100.collective_overhead + 2 * (n - 1) * h100.intra_latency
                  + 2 * (n - 1) / n * B * D * f4 / h100.intra_bandwidth)
    closed = (fc1 + relu + fc2 + all_reduce) * 1e3
    assert plan["autodist"]["objective_ms"] == pytest.approx(closed, rel=1e-9)
    assert plan["autodist"]["solver_objective_ms"] == pytest.approx(closed, rel=1e-6)


def test_gpt_blocks_under_a_memory_bound_get_megatron(tmp_path):
    with torch.device("meta"):
        model = Blocks(2, 2048, 16)
    idx = torch.zeros(1, 256, dtype=torch.long, device="meta")
    out, plan = compile_plan(tmp_path, model, (idx,), mem_limit_gb=1.0)
    p = plan["params"]
    for i in range(2):
        for w in ("attn.q_proj", "attn.k_proj", "attn.v_proj", "mlp_fc"):
            assert p[f"h.{i}.{w}.weight"] == "S(0)", w
        for w in ("attn.c_proj", "mlp_proj"):
            assert p[f"h.{i}.{w}.weight"] == "S(1)", w
    assert plan["collectives"]["comm.all_reduce"] == 4          # two per block, forward
    assert plan["autodist"]["shared_layers"] == {"h": 2}
    assert plan["autodist"]["memory_gb"] <= 1.0


def test_small_weights_large_batch_split_the_batch(tmp_path):
    with torch.device("meta"):
        model = Classifier(512, 512)
    args = (torch.empty(65536, 512, device="meta"),
            torch.zeros(65536, dtype=torch.long, device="meta"))
    out, plan = compile_plan(tmp_path, model, args)
    assert set(plan["params"].values()) == {"R"}
    linears = [o for o in plan["ops"] if o["op"] == "aten.linear.default"]
    assert [o["strategy"] for o in linears] == ["split *0", "split *0"]
    assert "comm.all_reduce" not in plan["collectives"] or \
        plan["collectives"]["comm.all_reduce"] == 1               # the scalar loss only


def test_infeasible_memory_states_the_leanest_plan(tmp_path):
    with pytest.raises(PlanInfeasibleError, match="leanest plan needs") as e:
        compile_plan(tmp_path, *big_mlp(), mem_limit_gb=0.01)
    need = float(re.search(r"needs ([0-9.]+) GB", str(e.value)).group(1))
    assert 0.01 < need < 2.2
    _, plan = compile_plan(tmp_path, *big_mlp(), mem_limit_gb=need * 1.001)
    assert plan["autodist"]["memory_gb"] <= need * 1.001


def test_identical_layers_share_decisions():
    sizes = {}
    for depth in (2, 6):
        with torch.device("meta"):
            model = Blocks(depth, 256, 4)
        g = trace(model, (torch.zeros(2, 64, dtype=torch.long, device="meta"),))
        _, prob = plan_problem(g, ComputeConfig(2, 2, parallel={"device": "h100-80g"}))
        sizes[depth] = (len(prob.choices), len(prob.pairs), len(prob.syncs))
        assert prob.layers == {"h": depth}
    assert sizes[2] == sizes[6]


def test_plan_save_and_load(tmp_path):
    saved = tmp_path / "plans" / "mlp.json"
    _, plan = compile_plan(tmp_path, *big_mlp(), save_plan_path=str(saved))
    assert json.loads(saved.read_text())["format"] == "nncompile-plan"
    # a plan loaded from file, even under a profile that would choose otherwise
    _, again = compile_plan(tmp_path, *big_mlp(), device="cpu", load_plan_path=str(saved),
                            name="loaded")
    assert again["params"] == plan["params"] and again["collectives"] == plan["collectives"]
    with pytest.raises(PolicyError, match="has no op"):
        compile_plan(tmp_path, GPT(), {"idx": torch.zeros(2, 8, dtype=torch.long),
                                       "targets": torch.zeros(2, 8, dtype=torch.long)},
                     load_plan_path=str(saved), name="other")
    with pytest.raises(PolicyError, match="plan_ngpus=2"):
        compile_plan(tmp_path, *big_mlp(), plan=4, load_plan_path=str(saved), name="p4")


def test_constraints_pin_a_module(tmp_path):
    _, plan = compile_plan(tmp_path, *big_mlp(), constraints=[
        {"module": "fc1", "dims": [0], "partial": False, "replicate": False}])
    fc1 = next(o for o in plan["ops"] if o["name"] == "fc1_linear")
    assert fc1["strategy"] == "split *0"
    why = nncompile.explain(plan, "fc1_linear")
    assert "parallel.constraints leave this op only this option" in why and "no rule splits" not in why
    with pytest.raises(ConfigError, match="leave no strategy"):
        compile_plan(tmp_path, *big_mlp(), constraints=[
            {"op": "fc1_linear", "dims": [1], "partial": False, "replicate": False},
            {"op": "fc1_linear", "dims": [0]}])
    with pytest.raises(ConfigError, match="unknown keys"):
        compile_plan(tmp_path, *big_mlp(), constraints=[{"module": "fc1", "dim": [0]}])


def test_recompute_modules_cut_memory_and_emit_checkpoint(tmp_path):
    with torch.device("meta"):
        model = GPT(vocab_size=512, block_size=256, n_layer=4, n_head=8, n_embd=512)
    args = {"idx": torch.zeros(8, 256, dtype=torch.long, device="meta"),
            "targets": torch.zeros(8, 256, dtype=torch.long, device="meta")}
    _, plain = compile_plan(tmp_path, model, args, name="plain")
    out, rc = compile_plan(tmp_path, model, args, recompute_modules=["Block"], name="rc")
    assert rc["autodist"]["memory_gb"] < 0.8 * plain["autodist"]["memory_gb"]
    code = (out / "gencode0.py").read_text()
    assert code.count("= checkpoint(recompute_h_") == 4


def test_explain_and_report(tmp_path):
    out, plan = compile_plan(tmp_path, *big_mlp())
    text = nncompile.explain(out, "fc1.weight")
    assert "chosen  S(0)" in text and "R\n" in text and "memory +" in text
    text = nncompile.explain(out, "fc2_linear")
    assert "split k" in text and "alternatives" in text and "replicate" in text
    with pytest.raises(ConfigError, match="did you mean"):
        nncompile.explain(out, "fc1")
    table = (out / "plan_report.txt").read_text()
    assert "fc1_linear" in table and "compute ms" in table


def test_progress_and_summary_are_printed(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("NNCOMPILE_QUIET", raising=False)
    compile_plan(tmp_path, *big_mlp())
    err = capsys.readouterr().err
    for step in ("tracing MLP", "running passes", "autodist: 3 ops", "writing 2 rank file"):
        assert step in err, step


FALLBACK = "no GPU is visible, so autodist plans for the built-in 'cpu' profile"


def test_cpu_fallback_is_announced(tmp_path, capsys, monkeypatch):
    """Compiling for GPUs on a machine without one (load_module=False): the automatic 'cpu'
    profile is announced in the progress output and in PlanInfeasibleError, with the fixes;
    never when the user asked for 'cpu'."""
    monkeypatch.delenv("NNCOMPILE_QUIET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    def compile_auto(name, **pas_config):     # no "device" unless given
        return nncompile.parallelize(*big_mlp(), ComputeConfig(2, 2, parallel=pas_config),
                                     gen_savedir=tmp_path, reuse="override", load_module=False,
                                     instance_name=name)

    out = compile_auto("auto")
    assert json.loads((out / "plan.json").read_text())["autodist"]["device"] == "cpu"
    err = capsys.readouterr().err
    assert f"[nncompile] autodist: {FALLBACK}" in err, err
    for fix in ('parallel={"device": "h100-80g"}', "'a100-80g', 'h100-80g', 'h200'",
                "`python -m nncompile profile -o FILE`"):
        assert fix in err, fix
    with pytest.raises(PlanInfeasibleError, match="leanest plan needs") as e:
        compile_auto("auto_infeasible", mem_limit_gb=0.01)
    assert FALLBACK in str(e.value) and 'parallel={"device": "h100-80g"}' in str(e.value)
    assert "python -m nncompile profile -o FILE" in str(e.value)
    capsys.readouterr()

    compile_auto("asked", device="cpu")
    with pytest.raises(PlanInfeasibleError, match="leanest plan needs") as e:
        compile_auto("asked_infeasible", device="cpu", mem_limit_gb=0.01)
    assert "no GPU" not in str(e.value) and "h100" not in str(e.value)
    err = capsys.readouterr().err
    assert "autodist: 3 ops" in err and "no GPU" not in err, err


def test_default_policy_is_autodist(tmp_path):
    model, args = big_mlp()
    out = nncompile.parallelize(model, args, ComputeConfig(2, 2), gen_savedir=tmp_path,
                                load_module=False)
    assert json.loads((out / "plan.json").read_text())["policy"] == "autodist"


def test_bad_pas_config(tmp_path):
    with pytest.raises(ConfigError, match="parallel has no field"):
        compile_plan(tmp_path, *big_mlp(), mem_limit=3)
    with pytest.raises(ConfigError, match="neither a built-in profile"):
        compile_plan(tmp_path, *big_mlp(), device="tpu-v9")


class _BrokenSolver(pulp.LpSolver):
    def actualSolve(self, lp, **kwargs):
        raise pulp.PulpSolverError("cbc exited with signal 9")


class _GivesUp(pulp.LpSolver):
    def actualSolve(self, lp, **kwargs):
        lp.assignStatus(pulp.LpStatusNotSolved)
        return lp.status


def test_solver_failures_are_clear_errors(tmp_path, monkeypatch):
    monkeypatch.setattr(ilp, "_solver", lambda limit: (_BrokenSolver(), "CBC"))
    with pytest.raises(PolicyError, match=r"ILP solver \(CBC\) failed: cbc exited"):
        compile_plan(tmp_path, *big_mlp())
    monkeypatch.setattr(ilp, "_solver", lambda limit: (_GivesUp(), "CBC"))
    with pytest.raises(PolicyError, match="without a plan; raise parallel"):
        compile_plan(tmp_path, *big_mlp(), solver_time_limit=0.5)


def test_measured_profile_round_trips(tmp_path):
    prof = measure_profile("here", size=64)
    assert prof.flops["float32"] > 0 and prof.mem_bandwidth > 0
    path = save_profile(prof, tmp_path / "here.json")
    assert get_profile(str(path)) == prof
    (tmp_path / "bad.json").write_text('{"name": "x", "warp": 9}')
    with pytest.raises(ConfigError, match="malformed"):
        get_profile(str(tmp_path / "bad.json"))
