"""The cost model on fixed plans (estimate_step) and the calibrated CPU profile: the estimate
of autodist's own plan is the ILP's objective, any policy's plan is costed by the same terms,
and 'cpu-gloo-2core' loads and prices what it measured (no timing)."""
import dataclasses

import pytest
import torch

import nncompile
from models import GPT
from nncompile.frontend import trace
from nncompile.passes import build_pipeline, run_pipeline
from nncompile.passes.autodist import BUILTIN, cost_model, estimate_step, get_profile, \
    save_profile
from nncompile.passes.policies import get_policy

DEVICE = "cpu-gloo-2core"


def gpt_batch(rows=4):
    torch.manual_seed(0)
    model = GPT(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32)
    batch = {"idx": torch.randint(0, 64, (rows, 16)), "targets": torch.randint(0, 64, (rows, 16))}
    return model, batch


def planned(policy, plan, world, rows=4, **pas_config):
    config = nncompile.ComputeConfig(plan, world, parallel=pas_config).resolved(world)
    model, batch = gpt_batch(rows)
    result = run_pipeline(trace(model, batch), build_pipeline(config, get_policy(policy)))
    return next(g for name, g, _ in result.history if name == "plan"), config


@pytest.mark.parametrize("plan,world", [(2, 2), (2, 4)])
def test_estimate_of_autodists_plan_is_its_objective(plan, world):
    g, config = planned("autodist", plan, world, device=DEVICE)
    est = estimate_step(g, config)
    assert est.total * 1e3 == pytest.approx(g.plan_state.autodist["objective_ms"], rel=1e-9)
    assert est.memory / 1e9 == pytest.approx(g.plan_state.autodist["memory_gb"], rel=1e-9)
    assert est.compute > 0 and est.optimizer > 0
    assert (est.grad_reduce > 0) == (world > plan)          # data-parallel units reduce


def test_fixed_plans_are_costed_by_the_same_terms():
    tp, config = planned("tp", 2, 2)
    t = estimate_step(tp, config, DEVICE)
    assert t.comm > 0 and t.grad_sync > 0 and t.grad_reduce == 0
    dp, config1 = planned("dp", 1, 2, rows=2)
    d = estimate_step(dp, config1, DEVICE)
    assert d.comm == d.grad_sync == 0 and d.grad_reduce > 0
    # dp's weights are whole on each rank, tp's split: more optimizer work per rank
    assert d.optimizer > t.optimizer
    # the gradient all-reduce travels in buckets: one bucket's overhead, not one per weight
    prof = get_profile(DEVICE)
    grads = sum(v.meta.numel * 4 for v in dp.params if v.requires_grad)
    fixed = prof.collective_overhead + 2 * prof.intra_latency       # one all-reduce's, g = 2
    assert d.grad_reduce < grads / prof.intra_bandwidth + len(dp.params) * fixed / 10
    assert d.grad_reduce == pytest.approx(
        prof.collective_overhead * grads / (25 * 2 ** 20) + grads / prof.intra_bandwidth
        + 2 * prof.intra_latency * grads / (25 * 2 ** 20), rel=1e-6)


def test_calibrated_profile_loads_and_round_trips(tmp_path):
    prof = get_profile(DEVICE)
    assert prof is BUILTIN[DEVICE] and prof.backend == "gloo" and prof.cores == 2
    for key in ("op_overhead", "optimizer_tensor_s", "optimizer_element_s"):
        assert getattr(prof, key) > 0, key
    path = save_profile(prof, tmp_path / "p.json")
    assert get_profile(str(path)) == prof
    # profiles without the new terms keep their JSON (plan fingerprints do not move)
    assert set(BUILTIN["cpu"].to_json()) == {
        "name", "flops", "mem_bandwidth", "mem_capacity_gb", "intra_bandwidth",
        "intra_latency", "inter_bandwidth", "inter_latency", "devices_per_node",
        "collective_overhead"}


def test_ranks_beyond_the_cores_stretch_compute_and_gloo_prices_its_fallbacks():
    def model(plan, world):
        return cost_model(nncompile.ComputeConfig(plan, world, parallel={
            "device": DEVICE}).resolved(world))
    assert model(2, 2).stretch == 1.0 and model(2, 4).stretch == 2.0
    assert model(4, 4).stretch == 2.0
    gloo = model(2, 2)
    assert gloo.collective("reduce_scatter", 1e6) == gloo.collective("all_reduce", 1e6)
    native = dataclasses.replace(gloo, profile=dataclasses.replace(gloo.profile, backend=None))
    assert native.collective("reduce_scatter", 1e6) < gloo.collective("reduce_scatter", 1e6)
