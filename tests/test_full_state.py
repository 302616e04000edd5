"""nncompile.full_state_dict / full_optimizer_state_dict: what a DDP checkpoint holds (the
single-device module's state dict, and a torch optimizer's over its parameters in the same
groups), from every rank together or from rank 0 alone while the others wait at their next
forward (runtime/checkpoints/full_state.py), under each plan (under ZeRO-1/2 rank 0 gathers the
model alone and every rank the optimizer state: tests/test_rank0_eval.py shows the error of
gathering it alone); a single-device module and optimizer load
them and continue as one device does. AdamW's eps is 1e-3 so that a gradient that is zero up
to summation order (a key bias) is not normalised into a full-size update; a piece merged into
the wrong place moves weights by ~1e-2."""
import copy

import pytest
import torch

import models
import nncompile
from nncompile.tools.simulate import run_ranks

PLANS = {"dp": (1, 2, 0, "dp"), "zero1": (1, 2, 1, "dp"), "zero3": (1, 2, 3, "dp"),
         "tp": (2, 2, 0, "tp"), "tp_zero3": (2, 4, 3, "tp")}


def _groups(module):
    decay = [p for n, p in module.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in module.named_parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]


def _step(model, opt, batch):
    model(**batch).backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("alone", [False, True], ids=["every-rank", "rank0-alone"])
@pytest.mark.parametrize("plan", PLANS)
def test_full_state_loads_into_one_device_and_continues_exactly(plan, alone, tmp_path):
    plan_ngpus, world, zero, policy = PLANS[plan]
    base, batch = models.build("gpt"), models.batch("gpt", 0)
    ref = copy.deepcopy(base)
    ref_opt = torch.optim.AdamW(_groups(ref), lr=1e-2, eps=1e-3)
    for _ in range(2):
        _step(ref, ref_opt, batch)

    def rank_fn(rank):
        module = copy.deepcopy(base)
        opt = torch.optim.AdamW(_groups(module), lr=1e-2, eps=1e-3)   # before wrapping
        pm = nncompile.parallelize(module, batch,
                                   nncompile.ComputeConfig(plan_ngpus, world, use_zero=zero),
                                   pas_policy=policy, gen_savedir=tmp_path, instance_name=plan)
        opt = nncompile.build_optimizer(pm, opt)
        for _ in range(2):
            _step(pm, opt, batch)
        opt_sd = None
        if alone and zero in (1, 2):       # the replicas' forwards exchange nothing: every
            opt_sd = nncompile.full_optimizer_state_dict(pm, opt, to=0)   # rank gathers it,
            assert (opt_sd is None) == (rank > 0), (rank, opt_sd is None)  # for rank 0 only
        if alone and rank > 0:
            _step(pm, opt, batch)          # waits at this forward, sends its pieces meanwhile
            return None
        state = nncompile.full_state_dict(pm), \
            opt_sd or nncompile.full_optimizer_state_dict(pm, opt)
        if alone:
            _step(pm, opt, batch)
        return state
    results = run_ranks(world, rank_fn)
    model_sd, opt_sd = results[0]
    want = ref.state_dict()
    assert model_sd.keys() == want.keys()
    for k, v in want.items():
        torch.testing.assert_close(model_sd[k], v, rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{plan} {k}: {m}")
    # a one-device module and its optimizer (the same groups) continue from them as ref does
    fresh = copy.deepcopy(base)
    fresh.load_state_dict(model_sd)
    fresh_opt = torch.optim.AdamW(_groups(fresh), lr=1e-2, eps=1e-3)
    fresh_opt.load_state_dict(opt_sd)
    _step(ref, ref_opt, batch)
    _step(fresh, fresh_opt, batch)
    for (k, a), b in zip(fresh.state_dict().items(), ref.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{plan} after a step {k}: {m}")


def test_an_optimizer_not_built_for_the_module_is_named(tmp_path):
    batch = models.batch("gpt", 0)
    pm = nncompile.parallelize(models.build("gpt"), batch, nncompile.ComputeConfig(1),
                               pas_policy="dp", gen_savedir=tmp_path)
    opt = torch.optim.SGD(pm.parameters(), lr=0.1)
    with pytest.raises(nncompile.ConfigError, match=r"needs the optimizer nncompile\."
                                                    r"build_optimizer\(pm, \.\.\.\) returned"):
        nncompile.full_optimizer_state_dict(pm, opt)
