"""torch.amp.GradScaler over a ParallelModule on 2 simulated ranks equals the same loop on one
device: an inf in one rank's part of the gradients skips the step on every rank (tp, ZeRO-3:
one found-inf for the job, one all-reduce per unscale_), and ZeRO-1/2 optimizers, whose
segments get their gradients in step, are unscaled and skip like torch's (the scale sequence,
losses and weights equal)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import nncompile
from nncompile import ComputeConfig
from nncompile.runtime.optim import grad_scaler
from nncompile.tools.simulate import run_ranks

WORLD, STEPS, INF_AT = 2, 5, 1



def _batches():
    g = torch.Generator().manual_seed(0)
    return [{"idx": torch.randint(0, 64, (4, 16), generator=g),
             "targets": torch.randint(0, 64, (4, 16), generator=g)} for _ in range(STEPS)]


def _scaler():
    return torch.amp.GradScaler("cpu", init_scale=2.0 ** 16, growth_interval=2)


def _loop(model, opt, batch_of, poison):
    """nanoGPT's step: scale, backward, unscale, clip, step, update; poison() puts an inf
    into this rank's gradients at step INF_AT (or does nothing)."""
    scaler = _scaler()
    losses, scales = [], []
    for i, b in enumerate(_batches()):
        loss = model(**batch_of(b))
        scaler.scale(loss).backward()
        if i == INF_AT:
            poison()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach().clone())
        scales.append(scaler.get_scale())
    return losses, scales


def _a_local_grad(pm, opt):
    """A gradient this rank holds: pm's own (tp, ZeRO-1, ZeRO-3's flat pieces) or a ZeRO-2
    piece."""
    for p in pm.stored_parameters():
        if p.grad is not None and p.grad.numel():
            return p.grad
    return next(s.grad for s in opt.shards if s.grad is not None and s.grad.numel())


@pytest.mark.parametrize("policy,plan,zero,how", [
    ("tp", 2, 0, "build"), ("tp", 2, 0, "plain"), ("dp", 1, 1, "build"), ("dp", 1, 2, "build"),
    ("dp", 1, 3, "build"), ("dp", 1, 3, "plain"), ("tp", 2, 3, "build"),
    ("dp", 1, 1, "offload"), ("dp", 1, 3, "offload")])
def test_grad_scaler_skips_like_one_device(gpt, gen, policy, plan, zero, how, monkeypatch):
    counts = {}

    class Counting:                   # the scaler's collectives, per rank
        def __getattr__(self, name):
            return getattr(dist, name)

        def all_reduce(self, t, *args, **kw):
            counts[dist.get_rank()] = counts.get(dist.get_rank(), 0) + 1
            return dist.all_reduce(t, *args, **kw)
    monkeypatch.setattr(grad_scaler, "dist", Counting())
    ref = copy.deepcopy(gpt)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)

    def poison_ref():
        next(ref.parameters()).grad.view(-1)[0] = float("inf")
    ref_losses, ref_scales = _loop(ref, ref_opt, lambda b: b, poison_ref)
    assert ref_scales[INF_AT] == ref_scales[INF_AT - 1] / 2          # the step was skipped
    dp = WORLD // plan

    def rank_fn(rank):
        module = copy.deepcopy(gpt)
        first = {k: v[:v.shape[0] // dp] for k, v in _batches()[0].items()}
        pm = nncompile.parallelize(module, first,
                                   ComputeConfig(plan, WORLD, use_zero=zero,
                                                 offload_optimizer=how == "offload"),
                                   pas_policy=policy, gen_savedir=gen,
                                   instance_name=f"gs{policy}{zero}{how}")
        if how == "plain":            # torch's own AdamW over pm.parameters()
            opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
        else:
            opt = nncompile.build_optimizer(pm, torch.optim.AdamW, lr=1e-2)
        unit = rank // plan
        rows = 4 // dp

        def poison():                 # only the last rank's part of the gradients overflows
            if rank == WORLD - 1:
                _a_local_grad(pm, opt).view(-1)[0] = float("inf")
        losses, scales = _loop(pm, opt, lambda b: {k: v[unit * rows:(unit + 1) * rows]
                                                   for k, v in b.items()}, poison)
        return losses, scales, pm.gather_params()

    out = run_ranks(WORLD, rank_fn)
    assert counts == {r: STEPS for r in range(WORLD)}, counts     # one per unscale_
    for rank, (_, scales, _) in enumerate(out):
        assert scales == ref_scales, (rank, scales, ref_scales)
    losses = torch.stack([torch.stack(out[u * plan][0]) for u in range(dp)]).mean(0)
    torch.testing.assert_close(losses, torch.stack(ref_losses), rtol=1e-5, atol=1e-5)
    for fqn, want in ref.named_parameters():
        for rank in range(WORLD):
            torch.testing.assert_close(out[rank][2][fqn], want.detach(), rtol=1e-4, atol=1e-4,
                                       msg=lambda m: f"rank {rank} {fqn}: {m}")


def test_plain_optimizers_are_torch_s(gpt):
    """An optimizer over no ParallelModule's tensors is unscaled by torch's own code."""
    model = copy.deepcopy(gpt)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    scaler.scale(model(**_batches()[0])).backward()
    want = [p.grad / 4 for p in model.parameters()]
    scaler.unscale_(opt)
    for p, w in zip(model.parameters(), want):
        torch.testing.assert_close(p.grad, w)
