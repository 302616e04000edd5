"""Gradients land in the reducer's buckets once (runtime/program/reducer.py, DDP's
gradient_as_bucket_view): on 2 simulated ranks, after every backward `.grad` is a view of its
bucket's buffer, also after zero_grad(set_to_none=True); during backward no fresh gradient
outlives its own parameter's hook (a hook registered after the reducer's counts the gradients
outside the buckets); accumulation goes into the views in place; values equal one device over
several steps (sync, async, no_sync, accumulation with the pre-scale hook, ZeRO-2's sink).
Gradients reduced in another dtype keep their own `.grad` (no view)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import nncompile
from nncompile import ComputeConfig
from nncompile.runtime.store.user_hooks import ours
from nncompile.runtime.program.reducer import Reducer
from nncompile.tools.simulate import run_ranks

WORLD, STEPS, LR = 2, 3, 0.1


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 32)
        self.b = nn.Linear(32, 32)
        self.c = nn.Linear(32, 4)
        self.unused = nn.Linear(4, 4)       # no gradient: stays None

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x))))).pow(2).mean()


def _batch(step: int, rank: int, micro: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + 10 * rank + micro)
    return torch.randn(6, 8, generator=g)


def _in_buckets(reducer: Reducer, t: torch.Tensor) -> bool:
    ptr = t.untyped_storage().data_ptr()
    return any(b.buffer is not None and b.buffer.untyped_storage().data_ptr() == ptr
               for b in reducer.buckets)


def _reference(net, micro: int, scale: float):
    """One device: per step the sum over ranks and micro-batches of each gradient, times
    `scale`, then an SGD step; the gradients of every step."""
    net = copy.deepcopy(net)
    out = []
    for step in range(STEPS):
        net.zero_grad(set_to_none=True)
        for r in range(WORLD):
            for m in range(micro):
                net(_batch(step, r, m).to(net.a.weight.dtype)).backward()
        grads = {n: None if p.grad is None else p.grad * scale
                 for n, p in net.named_parameters()}
        with torch.no_grad():
            for n, p in net.named_parameters():
                if grads[n] is not None:
                    p -= LR * grads[n]
        out.append(grads)
    return out


def _train(net, rank: int, *, async_=False, micro=1, no_sync=True, scale=0.5, sink=False,
           dtype=None, reduce_dtype=None, reduce_now=False):
    """The same steps on one simulated rank through a Reducer; what each step left."""
    net = copy.deepcopy(net).to(dtype or torch.float32)
    params = list(net.parameters())
    r = Reducer([(p, None, WORLD, scale) for p in params], bucket_cap_mb=0.004 if async_
                else 25.0, async_=async_, reduce_dtype=reduce_dtype)
    names = {id(p): n for n, p in net.named_parameters()}
    hooks = all(p._post_accumulate_grad_hooks for p in params)     # the reducer's
    outside = []                      # per hook call: gradients not in a bucket buffer

    def count(p):
        outside.append(sum(q.grad is not None and not _in_buckets(r, q.grad) for q in params))
    for p in params:                  # registered after the reducer's hooks: runs after them
        p.register_post_accumulate_grad_hook(ours(count))    # (a probe: at accumulation)
    taken = {}
    if sink:
        def take(ps, views):
            for p, v in zip(ps, views):
                taken[names[id(p)]] = v.clone()
        r.sink = take
    steps = []
    for step in range(STEPS):
        net.zero_grad(set_to_none=True)
        taken.clear()
        first = {}
        for m in range(micro):
            r.sync = not reduce_now and (m == micro - 1 or not no_sync)
            loss = net(_batch(step, rank, m).to(params[0].dtype))
            r.watch(loss)
            loss.backward()
            if m == 0:
                first = {n: p.grad for n, p in net.named_parameters()}
        if reduce_now:                # a pipeline: every backward unsynced, then one reduction
            r.reduce_now()
        grads = dict(taken) if sink else {n: p.grad for n, p in net.named_parameters()}
        same = all(p.grad is None or (first[n] is p.grad) for n, p in net.named_parameters())
        views = [n for n, p in net.named_parameters()
                 if p.grad is not None and _in_buckets(r, p.grad)]
        steps.append({"grads": {n: None if g is None else g.detach().clone()
                                for n, g in grads.items()},
                      "views": views, "same": same,
                      "freed": all(b.buffer is None for b in r.buckets)})
        with torch.no_grad():
            for n, p in net.named_parameters():
                if grads.get(n) is not None:
                    p -= LR * grads[n].to(p.dtype)
    return {"steps": steps, "outside": max(outside), "calls": len(outside),
            "async": r.async_, "hooks": hooks}


def _check(out, ref, rtol=1e-5, atol=1e-6):
    for rank_out in out:
        for got, want in zip(rank_out["steps"], ref):
            assert got["grads"].keys() >= {n for n, g in want.items() if g is not None}
            for n, g in want.items():
                if g is None:
                    assert got["grads"].get(n) is None, n          # unused: stays None
                else:
                    torch.testing.assert_close(got["grads"][n].float(), g, rtol=rtol, atol=atol)


@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
def test_gradients_are_bucket_views_and_never_twice(async_):
    net = Net()
    out = run_ranks(WORLD, lambda rank: _train(net, rank, async_=async_))
    _check(out, _reference(net, 1, 0.5))
    used = [n for n, p in net.named_parameters() if not n.startswith("unused")]
    for o in out:
        assert o["async"] == async_
        assert o["calls"] == STEPS * len(used)
        assert o["outside"] == 0          # a fresh gradient dies in its own hook
        for s in o["steps"]:              # after set_to_none, .grad is the bucket's view again
            assert sorted(s["views"]) == sorted(used)


@pytest.mark.parametrize("no_sync", [True, False], ids=["no_sync", "reduce_each"])
@pytest.mark.parametrize("scale", [0.5, 1.0], ids=["mean", "partial_sum"])
def test_accumulation_in_place(no_sync, scale):
    """Two micro-batches: under no_sync (reduced once) or reduced after each (the already
    reduced part pre-scaled by 1 / (2 * scale) where that is not 1); the second backward
    accumulates into the same view the first one left."""
    net = Net()
    out = run_ranks(WORLD, lambda rank: _train(net, rank, micro=2, no_sync=no_sync,
                                               scale=scale))
    _check(out, _reference(net, 2, scale))
    for o in out:
        assert o["outside"] == 0
        assert all(s["same"] and s["views"] for s in o["steps"])


@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
def test_reduce_now_after_unsynced_backwards(async_):
    """A pipeline's step: micro-batch backwards with sync off land and accumulate in the
    buckets, then reduce_now() reduces them where they are."""
    net = Net()
    out = run_ranks(WORLD, lambda rank: _train(net, rank, async_=async_, micro=2,
                                               reduce_now=True))
    _check(out, _reference(net, 2, 0.5))
    for o in out:
        assert o["outside"] == 0
        assert all(s["same"] and s["views"] for s in o["steps"])


def test_zero2_sink_frees_and_reallocates():
    net = Net()
    out = run_ranks(WORLD, lambda rank: _train(net, rank, micro=2, sink=True))
    _check(out, _reference(net, 2, 0.5))
    for o in out:
        assert o["outside"] == 0
        assert all(s["freed"] for s in o["steps"])       # the sink took every bucket


def test_other_reduce_dtype_keeps_its_own_grad():
    """bf16 parameters reduced in float32: `.grad` stays a bf16 tensor (no view, no hook)."""
    net = Net()
    out = run_ranks(WORLD, lambda rank: _train(net, rank, dtype=torch.bfloat16,
                                               reduce_dtype=torch.float32))
    ref = _reference(copy.deepcopy(net).to(torch.bfloat16), 1, 0.5)
    _check(out, [{n: None if g is None else g.float() for n, g in s.items()} for s in ref],
           rtol=2e-2, atol=2e-3)
    for o in out:
        assert not o["hooks"]
        assert all(not s["views"] for s in o["steps"])
        assert all(g is None or g.dtype == torch.bfloat16 for g in o["steps"][0]["grads"].values())


@pytest.mark.parametrize("zero,async_", [(0, False), (0, True), (2, False)],
                         ids=["sync", "async", "zero2"])
def test_parallel_module_accumulation_parity(gpt, gen, zero, async_):
    """The generated dp module on 2 ranks, accumulating 2 micro-batches (under no_sync, then
    without) with zero_grad(set_to_none=True) per step, equals one device; its `.grad` are
    bucket views after each backward (ZeRO-2: handed to the optimizer, None)."""
    g = torch.Generator().manual_seed(0)
    batches = [[{"idx": torch.randint(0, 64, (4, 16), generator=g),
                 "targets": torch.randint(0, 64, (4, 16), generator=g)} for _ in range(2)]
               for _ in range(4)]
    ref = copy.deepcopy(gpt)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    for step, micro in enumerate(batches):
        for b in micro:
            (ref(**b) / 2).backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)

    def rank_fn(rank):
        pm = nncompile.parallelize(
            copy.deepcopy(gpt), {k: v[:2] for k, v in batches[0][0].items()},
            ComputeConfig(1, WORLD, use_zero=zero, use_async_reducer=async_,
                          reducer_bucket_cap_mb=0.01),
            pas_policy="dp", gen_savedir=gen, instance_name=f"gbv{zero}{int(async_)}")
        opt = nncompile.build_optimizer(pm, torch.optim.SGD, lr=LR)
        r = pm._reducer
        views = []
        for step, micro in enumerate(batches):
            for i, b in enumerate(micro):
                ctx = pm.no_sync() if step % 2 == 0 and i == 0 else torch.enable_grad()
                with ctx:
                    (pm(**{k: v[2 * rank:2 * rank + 2] for k, v in b.items()}) / 2).backward()
            grads = [p.grad for p in pm.parameters() if p.requires_grad]
            views.append(all(g is None for g in grads) if zero == 2 else
                         all(g is not None and _in_buckets(r, g) for g in grads))
            opt.step()
            opt.zero_grad(set_to_none=True)
        return pm.gather_params(), views, r.async_

    out = run_ranks(WORLD, rank_fn)
    want = dict(ref.named_parameters(remove_duplicate=False))
    for params, views, is_async in out:
        assert is_async == async_ and all(views)
        for name, t in params.items():
            torch.testing.assert_close(t, want[name].detach(), rtol=1e-5, atol=1e-6)
