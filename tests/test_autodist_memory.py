"""autodist's memory options: ZeRO stage, optimizer/parameter offload and recompute, chosen
("auto") jointly with the placement ILP. Plans for 4 ranks in one process, nothing runs; the
expected bytes are counted here from the model's parameters (passes/autodist/memory_model.py
has the formulas)."""
import json
import re

import pytest
import torch

import models
import nncompile
from models import GPT
from nncompile import ComputeConfig, ConfigError, PlanInfeasibleError, PolicyError
from nncompile.frontend import trace
from nncompile.ir import MemoryChoice
from nncompile.passes import build_pipeline, get_policy, run_pipeline
from nncompile.passes.autodist import BUILTIN, MemoryModel, ilp, memory_search, plan_problem
from nncompile.passes.autodist.memory_model import leanest_picks, unit_of

N_LAYER, T, B = 4, 64, 8
F32, ADAM = 4, 8            # bytes per parameter element, Adam state bytes per element
Z = 4                       # plan_ngpus=1, runtime_ngpus=4: the ZeRO group is all 4 ranks
MB = 1e6


def _gpt():
    with torch.device("meta"):
        model = GPT(vocab_size=256, block_size=T, n_layer=N_LAYER, n_head=4, n_embd=128)
    args = {"idx": torch.zeros(B, T, dtype=torch.long, device="meta"),
            "targets": torch.zeros(B, T, dtype=torch.long, device="meta")}
    return model, args


@pytest.fixture(scope="module")
def gpt():
    model, args = _gpt()
    return model, args, trace(model, args)


@pytest.fixture(scope="module")
def counts(gpt):
    """Bytes counted from the model: P trainable parameters (the tied lm_head/wte once), C the
    traced constant (the int64 positions), the largest ZeRO-3 unit (a block)."""
    model = gpt[0]
    n = sum(p.numel() for p in model.parameters())
    block = sum(p.numel() for p in model.h[0].parameters())
    assert block * F32 > model.wte.weight.numel() * F32      # a block is the largest unit
    return {"n": n, "P": n * F32, "C": T * 8, "unit": block * F32}


def plan(gpt, runtime=4, policy="autodist", plan_ngpus=1, **options):
    """The planned graph (trace -> ... -> recompute -> localize; no code generated)."""
    pas = {"device": "h100-80g"}
    for key in ("mem_limit_gb", "recompute_modules", "save_plan_path", "load_plan_path"):
        if key in options:
            pas[key] = options.pop(key)
    config = ComputeConfig(plan_ngpus, runtime, parallel=pas, **options)
    return run_pipeline(gpt[2], build_pipeline(config, get_policy(policy))).graph


def memory(g) -> dict:
    return g.plan_state.autodist["memory"]


def expected_state(c, stage, offload=False):
    """parameters, gradients, optimizer state on the device per rank at plan_ngpus=1 (every
    parameter whole on its plan unit) and dp = 4; ZeRO-1/2 step a copy of their P / Z."""
    P, C = c["P"], c["C"]
    e = c["n"]
    opt = {0: ADAM * e, 1: (ADAM * e + P) / Z, 2: (ADAM * e + P) / Z, 3: ADAM * e / Z}[stage]
    return {"parameters": (P / Z if stage == 3 else P) + C,
            "gradients": P / Z if stage >= 2 else P,
            "optimizer_state": 0 if offload else opt}


def test_unit_of_names_blocks_and_owning_modules():
    assert unit_of("transformer.h.3.attn.q_proj.weight") == "transformer.h.3"
    assert unit_of("lm_head.weight") == "lm_head"
    assert unit_of("encoder.fc1.bias") == "encoder.fc1"
    assert unit_of("scale") == "root"


def test_persistent_bytes_per_stage_match_counting(gpt, counts):
    rows = {}
    for stage in range(4):
        g = plan(gpt, use_zero=stage)
        assert g.plan_state.memory == MemoryChoice(stage, False, False, ())   # kept as given
        mem = memory(g)
        assert mem["choice"] == {"zero": stage, "offload_optimizer": False,
                                 "offload_params": False, "recompute": []}
        assert [c["status"] for c in mem["candidates"]] == ["chosen"]
        got = mem["per_rank_bytes"]
        for kind, want in expected_state(counts, stage).items():
            assert got[kind] == pytest.approx(want, abs=1), (stage, kind)
        comm = {0: 0, 1: 0, 2: counts["P"], 3: 2 * counts["unit"]}[stage]   # bucket: P < 25 MiB
        assert got["communication_buffers"] == pytest.approx(comm, abs=1), stage
        assert got["total"] == sum(v for k, v in got.items() if k != "total")
        assert got["total"] == pytest.approx(g.plan_state.autodist["memory_gb"] * 1e9, abs=8)
        rows[stage] = got
    assert len({r["activations"] for r in rows.values()}) == 1     # no recompute: unchanged

    def state(r):
        return r["parameters"] + r["gradients"] + r["optimizer_state"]
    assert state(rows[3]) <= 0.27 * state(rows[0])
    assert state(rows[0]) == 4 * counts["P"] + counts["C"]          # P + P + 2P (Adam fp32)
    assert rows[0]["total"] > rows[2]["total"] > rows[1]["total"] > rows[3]["total"]


def test_huge_limit_keeps_the_fastest_stage_0(gpt):
    g = plan(gpt, use_zero="auto", mem_limit_gb=80.0)
    mem = memory(g)
    assert g.plan_state.memory.zero == 0 and mem["choice"]["zero"] == 0
    assert [c["choice"]["zero"] for c in mem["candidates"]] == [0, 1, 2, 3]
    chosen = next(c for c in mem["candidates"] if c["status"] == "chosen")
    assert all(c["time_ms"] >= chosen["time_ms"] for c in mem["candidates"])
    assert mem["ilp_solves"] == 1           # the others' lower bounds are slower already
    assert mem["auto"] == ["use_zero"] and mem["mem_limit_bytes"] == 80 * 10 ** 9


def _totals(counts, activations, bucket):
    comm = {0: 0, 1: 0, 2: bucket, 3: 2 * counts["unit"]}
    return {s: sum(expected_state(counts, s).values()) + comm[s] + activations
            for s in range(4)}


def test_limit_between_zero1_and_zero3_picks_a_leaner_stage(gpt, counts):
    act = memory(plan(gpt, use_zero=0))["per_rank_bytes"]["activations"]
    # default bucket (25 MiB > P): stage 2 keeps a whole gradient copy, only stage 3 fits
    tot = _totals(counts, act, counts["P"])
    limit = (tot[1] + tot[3]) / 2
    assert tot[3] < limit < min(tot[0], tot[1], tot[2])
    g = plan(gpt, use_zero="auto", mem_limit_gb=limit / 1e9)
    mem = memory(g)
    assert mem["choice"]["zero"] == 3 and mem["per_rank_bytes"]["total"] <= limit
    by_stage = {c["choice"]["zero"]: c for c in mem["candidates"]}
    for s in range(4):
        assert by_stage[s]["total"] == pytest.approx(tot[s], abs=2), s
        assert by_stage[s]["fits"] == (s == 3)
    # a 0.5 MiB bucket: ZeRO-2 fits too and is faster than ZeRO-3
    bucket = 2 ** 19
    tot = _totals(counts, act, bucket)
    limit = (tot[1] + tot[2]) / 2
    assert tot[3] < tot[2] < limit < tot[1] < tot[0]
    g = plan(gpt, use_zero="auto", mem_limit_gb=limit / 1e9, reducer_bucket_cap_mb=0.5)
    mem = memory(g)
    assert mem["choice"]["zero"] == 2
    assert mem["per_rank_bytes"]["communication_buffers"] == bucket
    assert mem["per_rank_bytes"]["total"] == pytest.approx(tot[2], abs=2)
    assert mem["per_rank_bytes"]["total"] <= limit
    times = {c["choice"]["zero"]: c["time_ms"] for c in mem["candidates"]}
    assert times[2] < times[3]
    # with recompute_modules="auto" as well, recomputing the blocks is cheaper than ZeRO
    g = plan(gpt, use_zero="auto", recompute_modules="auto", mem_limit_gb=limit / 1e9,
             reducer_bucket_cap_mb=0.5)
    mem = memory(g)
    assert mem["choice"] == {"zero": 0, "offload_optimizer": False, "offload_params": False,
                             "recompute": ["h.*"]}
    assert mem["per_rank_bytes"]["total"] <= limit
    assert mem["per_rank_bytes"]["activations"] < act / 2
    assert g.plan_state.recompute_regions == N_LAYER          # the recompute pass followed
    chosen = next(c for c in mem["candidates"] if c["status"] == "chosen")
    for c in mem["candidates"]:                                # the fastest that fits won
        assert c["fits"] == (c["status"] != "too large")
        if c["fits"]:
            assert c["time_ms"] >= chosen["time_ms"] - 1e-9
        if c["solved"] or c["status"] == "too large":
            assert (c["total"] <= limit) == c["fits"]


def test_nothing_fits_names_the_leanest_combination(gpt, counts):
    with pytest.raises(PlanInfeasibleError) as e:
        plan(gpt, use_zero="auto", offload_optimizer="auto", recompute_modules="auto",
             mem_limit_gb=0.001)
    msg = str(e.value)
    assert "no plan fits mem_limit_gb=0.001 GB per rank with any of the 16 memory options" in msg
    assert "ZeRO-3, optimizer offload, recompute h.*" in msg
    assert (f"parameters {(counts['P'] / Z + counts['C']) / MB:.3g} MB, gradients "
            f"{counts['P'] / Z / MB:.3g} MB, optimizer state 0 MB") in msg
    assert f"communication buffers {2 * counts['unit'] / MB:.3g} MB" in msg
    need = float(re.search(r"leanest plan needs ([0-9.e-]+) GB", msg).group(1)) * 1e9
    assert need > 2 * counts["P"] / Z + 2 * counts["unit"]
    for fix in ("mem_limit_gb", "runtime_ngpus", "plan_ngpus", "offload_params=True"):
        assert fix in msg, fix
    # the same limit at the leanest combination's own bytes fits
    g = plan(gpt, use_zero="auto", offload_optimizer="auto", recompute_modules="auto",
             mem_limit_gb=need * 1.0001 / 1e9)
    assert g.plan_state.memory == MemoryChoice(3, True, False, ("h.*",))


def test_explicit_values_are_kept(gpt, counts):
    g = plan(gpt, use_zero=1, offload_optimizer=True, recompute_modules=["Block"],
             mem_limit_gb=0.02)
    assert g.plan_state.memory == MemoryChoice(1, True, False, ("Block",))
    mem = memory(g)
    assert len(mem["candidates"]) == 1 and mem["auto"] == []
    assert mem["per_rank_bytes"]["optimizer_state"] == 0
    assert mem["host_bytes"] == pytest.approx((ADAM * counts["n"] + counts["P"]) / Z, abs=1)
    assert g.plan_state.recompute_regions == N_LAYER
    with pytest.raises(PlanInfeasibleError, match="the leanest plan needs"):   # not widened
        plan(gpt, use_zero=1, mem_limit_gb=0.01)


def test_offload_time_is_the_host_copies(gpt, counts):
    """Offloading ZeRO-1's optimizer copies each gradient shard to the host and the updated
    shard back: 2 P / Z bytes at the profile's host bandwidth, the plan otherwise alike."""
    base = plan(gpt, use_zero=1).plan_state.autodist["objective_ms"]
    off = plan(gpt, use_zero=1, offload_optimizer=True).plan_state.autodist["objective_ms"]
    host_bw = BUILTIN["h100-80g"].host_bytes_per_s
    assert host_bw == 50e9
    assert off - base == pytest.approx(2 * counts["P"] / Z / host_bw * 1e3, rel=1e-6)


def test_zero3_offload_params_on_one_rank(gpt, counts):
    g = plan(gpt, runtime=1, use_zero="auto", offload_params=True)
    assert g.plan_state.memory == MemoryChoice(3, False, True, ())
    got = memory(g)["per_rank_bytes"]
    assert got["parameters"] == counts["C"] and got["gradients"] == 0
    assert got["optimizer_state"] == ADAM * counts["n"]                  # Z = 1, on the device
    assert got["communication_buffers"] == 2 * counts["unit"]
    assert memory(g)["host_bytes"] == 2 * counts["P"]


def test_leanest_closed_form_equals_the_ilp(gpt):
    """leanest_picks (no solver) finds the least memory the ILP can reach, ZeRO-3 peaks
    included, on a plan unit of 2 where placements differ in size."""
    config = ComputeConfig(2, 4, parallel={"device": "h100-80g"})
    g, prob = plan_problem(gpt[2], config)
    mm = MemoryModel.of(prob.model, config)
    for stage in range(4):
        p = mm.derive(g, prob, MemoryChoice(stage, stage == 2, False, ()))
        closed = ilp.memory_of(p, leanest_picks(p))
        assert closed == pytest.approx(ilp.leanest_memory(p), rel=1e-6), stage
    assert closed < ilp.replicated_memory(p)


def test_branch_and_bound_finds_the_exhaustive_optimum(monkeypatch):
    """Pruning by lower bounds picks what solving every candidate picks, and every bound is
    at most the candidate's solved step time (a plan unit of 2: placements trade memory)."""
    model, args = models.build("gpt"), models.batch("gpt", 0)
    small = (model, args, trace(model, args))
    _, prob = plan_problem(small[2], ComputeConfig(2, 4, parallel={"device": "h100-80g"}))
    lean0 = ilp.memory_of(prob, leanest_picks(prob))      # no ZeRO can fit below this
    options = dict(plan_ngpus=2, use_zero="auto", mem_limit_gb=0.97 * lean0 / 1e9)
    pruned = plan(small, **options).plan_state
    monkeypatch.setattr(memory_search, "lower_bound", lambda *args: float("-inf"))
    every = plan(small, **options).plan_state
    assert pruned.memory == every.memory and pruned.memory.zero > 0
    assert pruned.autodist["objective_ms"] == pytest.approx(every.autodist["objective_ms"])
    assert pruned.autodist["memory"]["ilp_solves"] < every.autodist["memory"]["ilp_solves"]
    for a, b in zip(pruned.autodist["memory"]["candidates"],
                    every.autodist["memory"]["candidates"]):
        if a["status"] == "slower (bound)":
            assert b["solved"] and a["time_ms"] <= b["time_ms"] * (1 + 1e-9)


@pytest.mark.parametrize("policy", ["dp", "tp", lambda graph, config: graph])
@pytest.mark.parametrize("option", [{"use_zero": "auto"}, {"offload_optimizer": "auto"},
                                    {"parallel": {"recompute_modules": "auto"}}])
def test_auto_under_another_policy_is_a_config_error(policy, option):
    config = ComputeConfig(1, 4, **option)
    with pytest.raises(ConfigError, match="chosen by autodist.*pas_policy='autodist' or a "
                                          "concrete value"):
        build_pipeline(config, get_policy(policy))


def test_parallelize_writes_the_memory_report(tmp_path, counts):
    model, args = _gpt()
    config = ComputeConfig(1, 4, parallel={"device": "h100-80g", "mem_limit_gb": 0.02,
                                             "recompute_modules": "auto"})
    out = nncompile.parallelize(model, args, config, gen_savedir=tmp_path, load_module=False,
                                instance_name="rc")
    plan_json = json.loads((out / "plan.json").read_text())
    mem = plan_json["autodist"]["memory"]
    assert set(mem) >= {"choice", "per_rank_bytes", "host_bytes", "mem_limit_bytes",
                        "candidates"}
    assert mem["choice"] == {"zero": 0, "offload_optimizer": False, "offload_params": False,
                             "recompute": ["h.*"]}
    assert set(mem["per_rank_bytes"]) == {"parameters", "gradients", "optimizer_state",
                                          "activations", "communication_buffers", "total"}
    assert mem["per_rank_bytes"]["total"] <= mem["mem_limit_bytes"] == 2 * 10 ** 7
    assert {c["status"] for c in mem["candidates"]} == {"too large", "chosen"}
    for c in mem["candidates"]:
        assert set(c) >= {"choice", "total", "time_ms", "fits"}
    assert (out / "gencode0.py").read_text().count("= checkpoint(recompute_h_") == N_LAYER
    report = (out / "plan_report.txt").read_text()
    assert "memory per rank: no ZeRO, recompute h.*" in report and "too large" in report
    why = nncompile.explain(out, "memory")
    assert why.startswith("memory options: no ZeRO, recompute h.*  chosen by autodist")
    assert "does not fit even at its leanest" in why
    assert f"{counts['P'] / MB:12.3f} MB" in why                      # gradients: P


def test_saved_plan_keeps_the_memory_choice(gpt, tmp_path):
    path = str(tmp_path / "plan.json")
    g = plan(gpt, use_zero="auto", mem_limit_gb=0.027, save_plan_path=path)
    assert json.loads(open(path).read())["memory"]["zero"] == g.plan_state.memory.zero == 3
    again = plan(gpt, use_zero="auto", load_plan_path=path)
    assert again.plan_state.memory == g.plan_state.memory
    assert plan(gpt, use_zero=1, load_plan_path=path).plan_state.memory.zero == 1
    saved = json.loads(open(path).read())
    del saved["memory"]
    open(path, "w").write(json.dumps(saved))
    with pytest.raises(PolicyError, match="records no memory options"):
        plan(gpt, use_zero="auto", load_plan_path=path)


def test_measured_peak_matches_the_choice_under_a_limit(run_ranks, tmp_path):
    """4 gloo ranks: with mem_limit_gb halfway between the ZeRO-1 and ZeRO-3 predictions autodist
    picks a leaner option (ZeRO-2/3 or recompute), and every rank's peak measured by
    nncompile.memory.profile over 3 AdamW steps is within 15 % of the predicted total
    (tests/workers/memory_auto.py)."""
    out = run_ranks("tests/workers/memory_auto.py", 4, "--dir", str(tmp_path))
    assert "ok memory auto:" in out, out[-3000:]
