"""`pm.require_backward_grad_sync`, DDP's flag nanoGPT toggles on accumulation micro-steps: on 2-4
simulated ranks, accumulation with it off on all but the last micro-step equals one device and
reduces once per step instead of once per micro-step; no_sync() restores it; without a reducer
(ZeRO-3, tp over the whole world) it is ignored."""
from __future__ import annotations

import copy

import pytest
import torch

import nncompile
from nncompile import ComputeConfig
from nncompile.tools.simulate import run_ranks

STEPS, ACC = 3, 2



def _micro_batches():
    g = torch.Generator().manual_seed(0)
    return [[{"idx": torch.randint(0, 64, (4, 16), generator=g),
              "targets": torch.randint(0, 64, (4, 16), generator=g)} for _ in range(ACC)]
            for _ in range(STEPS)]


@pytest.mark.parametrize("policy,plan,zero,world", [
    ("dp", 1, 0, 2), ("tp", 2, 0, 2), ("tp", 2, 0, 4), ("dp", 1, 2, 2), ("dp", 1, 3, 2)])
def test_accumulation_like_ddp(gpt, gen, policy, plan, zero, world):
    ref = copy.deepcopy(gpt)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ref_losses = []
    for micro in _micro_batches():
        for b in micro:
            loss = ref(**b) / ACC
            loss.backward()
            ref_losses.append(loss.detach())
        ref_opt.step()
        ref_opt.zero_grad()
    dp = world // plan

    def rank_fn(rank):
        module = copy.deepcopy(gpt)
        first = {k: v[:v.shape[0] // dp] for k, v in _micro_batches()[0][0].items()}
        pm = nncompile.parallelize(module, first, ComputeConfig(plan, world, use_zero=zero),
                                   pas_policy=policy, gen_savedir=gen,
                                   instance_name=f"rbgs{policy}{zero}{world}")
        opt = nncompile.build_optimizer(pm, torch.optim.AdamW, lr=1e-2)
        launches = [0]
        reducer = pm._reducer
        if reducer is not None:                   # count the gradient all-reduces
            launch = reducer._launch

            def counted(b):
                launches[0] += 1
                return launch(b)
            reducer._launch = counted
        unit, rows = rank // plan, 4 // dp
        losses = []
        for micro in _micro_batches():
            for i, b in enumerate(micro):
                pm.require_backward_grad_sync = i == ACC - 1      # as nanoGPT does
                loss = pm(**{k: v[unit * rows:(unit + 1) * rows] for k, v in b.items()}) / ACC
                loss.backward()
                losses.append(loss.detach().clone())
            opt.step()
            opt.zero_grad()
        flags = []
        pm.require_backward_grad_sync = False
        with pm.no_sync():
            flags.append(pm.require_backward_grad_sync)
        flags.append(pm.require_backward_grad_sync)       # no_sync restored False
        pm.require_backward_grad_sync = True
        flags.append(pm.require_backward_grad_sync)
        buckets = len(reducer.buckets) if reducer is not None else 0
        return losses, pm.gather_params(), launches[0], buckets, flags

    out = run_ranks(world, rank_fn)
    losses = torch.stack([torch.stack(out[u * plan][0]) for u in range(dp)]).mean(0)
    torch.testing.assert_close(losses, torch.stack(ref_losses), rtol=1e-5, atol=1e-5)
    for fqn, want in ref.named_parameters():
        torch.testing.assert_close(out[0][1][fqn], want.detach(), rtol=1e-4, atol=1e-4,
                                   msg=lambda m: f"{fqn}: {m}")
    for _, _, launches, buckets, flags in out:
        if zero == 3 or plan == world:   # no reducer (ZeRO-3; tp without dp): ignored, True
            assert buckets == 0 and flags == [True, True, True]
        else:                                     # one reduction per step, not per micro-step
            assert buckets > 0 and launches == STEPS * buckets, (launches, buckets)
            assert flags == [False, False, True]
