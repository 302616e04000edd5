"""copy.deepcopy(pm) and torch.optim.swa_utils.AveragedModel(pm), as DDP users write them:
the copy is an independent module on the same process groups, its average equals one
device's, and it evaluates like one device, under tp, ZeRO-2, ZeRO-3 and tp x ZeRO-3. Two
simulated ranks."""
from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.tensor import DTensor
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import models
import nncompile
from nncompile import ComputeConfig
from nncompile.tools.simulate import run_ranks

WORLD, STEPS = 2, 3


def _batch(step: int):
    return models.batch("gpt", step, batch_size=2, seq=16)


def _local(p):
    return p.to_local() if isinstance(p, DTensor) else p


def _train(model, swa, step_fn):
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(STEPS):
        opt.zero_grad()
        step_fn(model, step).backward()
        opt.step()
        swa.update_parameters(model)


def _reference(ema: bool):
    model = models.build("gpt")         # (built here: torch's generator is shared by threads)
    swa = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9) if ema else None)
    _train(model, swa, lambda m, step: m(**_batch(step)))
    swa.eval()
    with torch.no_grad():
        loss = swa(**_batch(9))
    return dict(swa.module.named_parameters()), loss


@pytest.mark.parametrize("policy,plan,zero,ema", [("tp", 2, 0, False), ("dp", 1, 2, True),
                                                  ("dp", 1, 3, False), ("tp", 2, 3, True)])
def test_averaged_model_of_pm_equals_one_device(tmp_path, policy, plan, zero, ema):
    """AveragedModel(pm) (SWA's mean, or an EMA) over 3 steps: the averaged weights and the
    copy's eval loss equal one device's; training pm does not move the copy, and the copy
    has its own storage (under ZeRO-3 its own flat pieces, under its own DTensor
    parameters)."""
    want, want_loss = _reference(ema)
    base = models.build("gpt")

    def rank_fn(rank):
        pm = nncompile.parallelize(copy.deepcopy(base), _batch(0), ComputeConfig(plan, WORLD,
                                   use_zero=zero), pas_policy=policy, gen_savedir=tmp_path,
                                   instance_name=f"swa_{policy}{zero}")
        swa = AveragedModel(pm, multi_avg_fn=get_ema_multi_avg_fn(0.9) if ema else None)
        shared = {_local(p).data_ptr() for p in pm.parameters()} & \
            {_local(p).data_ptr() for p in swa.module.parameters()}
        # with plan 1 both units see the same batch, so the average is one device's
        _train(pm, swa, lambda m, step: m(**_batch(step)))
        swa.eval()
        with torch.no_grad():
            loss = swa(**_batch(9))
        return swa.module.gather_params(), loss, shared, pm.gather_params()
    for got, loss, shared, live in run_ranks(WORLD, rank_fn):
        assert not shared
        torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
        for fqn, w in want.items():
            torch.testing.assert_close(got[fqn], w.detach(), rtol=1e-5, atol=1e-6)
        assert any(not torch.equal(live[k], got[k]) for k in got)   # the average is not pm


def test_a_copy_shares_the_output_specs_and_warns_nothing(tmp_path):
    """AveragedModel(pm) deep-copies pm: the pytree specs of its outputs are shared (they are
    immutable; copying one made torch warn about its LeafSpec in the user's output)."""
    import warnings
    pm = nncompile.parallelize(models.build("gpt"), models.batch("gpt", 0), ComputeConfig(1),
                               pas_policy="dp", gen_savedir=tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        avg = AveragedModel(pm)
    assert avg.module._out_spec is pm._out_spec
    with torch.no_grad():
        assert torch.equal(avg(**models.batch("gpt", 0)), pm(**models.batch("gpt", 0)))
