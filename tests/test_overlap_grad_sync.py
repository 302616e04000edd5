"""The fused sync_grad and all_gather of passes/overlap_grad_sync.py: their backward gives
what the collective followed by separate linears gives, on 2 ranks in one process (threaded process group), for
the inputs real models pass: biases or none, frozen weights (LoRA), an output whose gradient
never arrives, an input that needs no gradient, and bf16 autocast."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from nncompile.runtime.program import comm
from nncompile.tools.simulate import run_ranks


def _case(rank: int, frozen: bool, unused: bool, x_grad: bool, autocast: bool, gather: bool):
    group = dist.group.WORLD
    gen = torch.Generator().manual_seed(0)
    x0 = torch.randn(2, 6, 8, generator=gen)
    if gather:                                          # tp_sp: this rank's rows of the sequence
        x0 = x0.chunk(2, dim=1)[rank]
    weights = [torch.randn(6, 8, generator=gen) for _ in range(3)]
    biases = [torch.randn(6, generator=gen), None, torch.randn(6, generator=gen)]
    out = {}
    for fused in (False, True):
        x = (x0 + rank).requires_grad_(x_grad)          # each rank's own input gradient
        ws = [w.clone().requires_grad_(not (frozen and i == 0)) for i, w in enumerate(weights)]
        bs = [None if b is None else b.clone().requires_grad_() for b in biases]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            linears = tuple(zip(ws, bs))
            if gather and fused:
                ys = comm.all_gather(x, dim=1, group=group, reduce_grad=True, linears=linears)
            elif gather:
                xs = comm.all_gather(x, dim=1, group=group, reduce_grad=True)
                ys = [F.linear(xs, w, b) for w, b in zip(ws, bs)]
            elif fused:
                ys = comm.sync_grad(x, group=group, linears=linears)
            else:
                xs = comm.sync_grad(x, group=group)
                ys = [F.linear(xs, w, b) for w, b in zip(ws, bs)]
        used = ys[:2] if unused else ys
        loss = sum((y.float() * (i + 1 + rank)).sum() for i, y in enumerate(used))
        loss.backward()
        out[fused] = ([y.detach() for y in ys], x.grad,
                      [w.grad for w in ws], [None if b is None else b.grad for b in bs])
    return out


@pytest.mark.parametrize("gather", [False, True], ids=["sync_grad", "all_gather"])
@pytest.mark.parametrize("frozen,unused,x_grad,autocast", [
    (False, False, True, False), (True, True, True, False), (False, False, False, False),
    (False, True, True, True)])
def test_fused_backward_equals_the_collective_then_linears(frozen, unused, x_grad, autocast,
                                                           gather):
    results = run_ranks(2, lambda r: _case(r, frozen, unused, x_grad, autocast, gather))
    for rank, out in enumerate(results):
        (ys0, gx0, gw0, gb0), (ys1, gx1, gw1, gb1) = out[False], out[True]
        for a, b in zip(ys0, ys1):
            assert a.dtype == b.dtype
            torch.testing.assert_close(a, b)
        if x_grad:           # summed over both ranks: equal on both (their rows, gathered)
            torch.testing.assert_close(gx0, gx1)
            if not gather:
                torch.testing.assert_close(gx1, results[1 - rank][True][1])
        else:
            assert gx0 is None and gx1 is None
        for a, b in zip(gw0 + gb0, gw1 + gb1):
            assert (a is None) == (b is None)
            if a is not None:
                torch.testing.assert_close(a, b)
        if frozen:
            assert gw1[0] is None
        if unused:
            assert gw1[2] is None and gb1[2] is None


def test_zero3_tp_frees_the_gathered_weights_the_fused_linears_read(tmp_path):
    """Under ZeRO-3 the fused op saves its weights through the saved-tensor hooks like a
    linear does: after forward no gathered unit is alive; backward gathers them again, and
    the loss and gradients equal one device's."""
    import copy
    import gc

    import models
    import nncompile

    model = models.build("gpt")        # built once: threads seeding the global RNG would race

    def run(rank):
        pm = nncompile.parallelize(copy.deepcopy(model), models.batch("gpt", 0),
                                   nncompile.ComputeConfig(2, 2, use_zero=3), pas_policy="tp",
                                   gen_savedir=tmp_path, instance_name="z3tp")
        code = (tmp_path / "z3tp" / f"gencode{rank}.py").read_text()
        loss = pm(**models.batch("gpt", 0))
        gc.collect()
        alive = sum(r() is not None for u in pm.zero.units for r in u.live.values())
        loss.backward()
        return code.count("linears=("), alive, loss.detach(), pm.gather_grads()

    results = run_ranks(2, run)
    ref = model
    ref_loss = ref(**models.batch("gpt", 0))
    ref_loss.backward()
    for fused, alive, loss, grads in results:
        assert fused == 2 * 2 and alive == 0, (fused, alive)
        torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=1e-6)
        for name, p in ref.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-6)
