"""How the reducer cuts gradients into buckets (runtime/program/reducer.py), without a process group:
the first bucket of the async reducer closes at 1 MiB as DDP's does, later ones at the cap, and
a model whose gradients fit one bucket gets the sync trigger (nothing to overlap: the one hook
per parameter only moves its gradient into the bucket, launching nothing)."""
import torch

from nncompile.runtime.program.reducer import FIRST_BUCKET_MB, Reducer


def _params(sizes):
    return [torch.nn.Parameter(torch.zeros(n)) for n in sizes]


def _rows(params):
    return [(p, None, 2, 0.5) for p in params]


def test_async_first_bucket_is_small_then_the_cap():
    mib = 2 ** 20 // 4                                   # float32 elements in 1 MiB
    params = _params([3 * mib] * 3 + [mib // 2] * 4)     # backward order: the small ones first
    r = Reducer(_rows(params), bucket_cap_mb=25.0, async_=True)
    sizes = [b.numel * 4 / 2 ** 20 for b in r.buckets]
    assert r.async_ and len(r.buckets) == 2, sizes
    assert sizes[0] == FIRST_BUCKET_MB                   # two half-MiB gradients
    assert sizes[1] == 10.0                              # the other 10 MiB, under the cap
    sync = Reducer(_rows(params), bucket_cap_mb=25.0, async_=False)
    assert [b.numel for b in sync.buckets] == [sum(p.numel() for p in params)]


def test_one_bucket_runs_the_sync_trigger():
    params = _params([1000, 2000])
    r = Reducer(_rows(params), bucket_cap_mb=25.0, async_=True)
    assert len(r.buckets) == 1 and not r.async_
    assert all(len(p._post_accumulate_grad_hooks) == 1 for p in params)
    fresh = torch.ones(2000)
    params[1].grad = fresh
    for hook in params[1]._post_accumulate_grad_hooks.values():
        hook(params[1])               # lands the gradient in the bucket, launches nothing
    assert params[1].grad is r.buckets[0].views[0] and not r._queued
    assert torch.equal(params[1].grad, fresh)
    r = Reducer(_rows(params), bucket_cap_mb=0.004, async_=True)     # 4 KiB: two buckets
    assert len(r.buckets) == 2 and r.async_
    assert all(p._post_accumulate_grad_hooks for p in params)
