"""On a GPU (skipped where none is visible: CI runs on CPUs; docs/versions.md says how these run
on a GPU machine): the generated program of an unmodified Hugging Face Llama trains on one GPU
like the model (AdamW, float32 with TF32 off), its eager and torch.compile forms agree, and in
bfloat16 its attention is one causal scaled_dot_product_attention call and its peak GPU memory
stays within 5% of the model's."""
from __future__ import annotations

import copy
import os
import sys

import pytest
import torch

import nncompile
from nncompile import ComputeConfig

sys.path.insert(0, os.path.dirname(__file__))
import models  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a visible GPU")

DEVICE = "cuda"


@pytest.fixture(autouse=True)
def exact_float32():
    """Plain float32 matmuls (no TF32), so the two programs round alike."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def _batch(vocab: int, rows: int, seq: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, seq), generator=g).to(DEVICE)
    return {"input_ids": ids, "labels": ids}


def _train(model, batch, steps: int, parallel: bool = False) -> list[float]:
    opt = (nncompile.build_optimizer(model, torch.optim.AdamW, lr=1e-3) if parallel
           else torch.optim.AdamW(model.parameters(), lr=1e-3))
    clip = (nncompile.clip_grad_norm_ if parallel
            else lambda m, n: torch.nn.utils.clip_grad_norm_(m.parameters(), n))
    losses = []
    for _ in range(steps):
        loss = model(**batch)
        loss.backward()
        clip(model, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
    return losses


def _llama(hidden: int = 64, layers: int = 2, vocab: int = 128, seq: int = 64):
    torch.manual_seed(0)
    return models.hf_llama(vocab=vocab, hidden=hidden, inter=2 * hidden, n_layer=layers,
                           n_head=4, n_kv=2, max_pos=seq).to(DEVICE).train()


@pytest.mark.parametrize("compile_", [False, True], ids=["eager", "compile"])
def test_llama_trains_on_one_gpu_like_the_model(tmp_path, compile_):
    model = _llama()
    batch = _batch(128, 4, 64)
    want = _train(copy.deepcopy(model), batch, 3)
    pm = nncompile.parallelize(copy.deepcopy(model), batch,
                               ComputeConfig(1, 1, compile=compile_), pas_policy="dp",
                               gen_savedir=tmp_path)
    assert next(pm.parameters()).device.type == "cuda"
    got = _train(pm, batch, 3, parallel=True)
    assert got == pytest.approx(want, rel=1e-4), (got, want)


def _peak(fn) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated()


def test_bf16_attention_is_causal_sdpa_and_memory_matches_the_model(tmp_path):
    model = _llama(hidden=256, layers=4, vocab=1024, seq=512).to(torch.bfloat16)
    batch = _batch(1024, 4, 512)
    pm = nncompile.parallelize(copy.deepcopy(model), batch, ComputeConfig(1, 1),
                               pas_policy="dp", gen_savedir=tmp_path)
    code = open(pm.gencode_path).read()
    assert "scaled_dot_product_attention" in code and "is_causal=True" in code, \
        "the traced causal mask was not folded into a causal attention call"

    def step(net):
        def run():
            net(**batch).backward()
            for p in net.parameters():
                p.grad = None
        run()                               # warm-up: kernels chosen, workspaces made
        return _peak(run)
    plain = step(model)
    generated = step(pm)
    assert generated <= 1.05 * plain, (generated / plain, generated, plain)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("zigzag", [False, True], ids=["contiguous", "zigzag"])
def test_attention_rows_on_cuda_are_the_causal_rows(dtype, zigzag, monkeypatch):
    """comm.attention_rows on CUDA (each block of query rows against the keys up to its last
    row, SDPA's causal_lower_right: flash in bfloat16) gives every context rank's rows of one
    causal attention, forward and backward, with grouped k/v heads."""
    from nncompile.runtime.program import comm
    n, L = 4, 256
    g = torch.Generator(device=DEVICE).manual_seed(0)
    q, k, v = (torch.randn(2, h, L, 64, device=DEVICE, dtype=dtype, generator=g)
               for h in (8, 2, 2))
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = torch.nn.functional.scaled_dot_product_attention(*ref_in, is_causal=True,
                                                           enable_gqa=True)
    grad = torch.randn(ref.shape, device=DEVICE, dtype=dtype, generator=g)
    ref.backward(grad)
    group = object()

    def close(got, want):       # bfloat16: 8 significant bits, each rank's sum rounded apart
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        else:
            err = (got.float() - want.float()).norm() / want.float().norm()
            assert err < 1e-2, err
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for r in range(n):
        monkeypatch.setattr(comm, "_size", lambda grp: n)
        monkeypatch.setattr(comm, "_rank", lambda grp, r=r: r)
        half = L // (2 * n)
        rows = (torch.cat([torch.arange(r * half, (r + 1) * half),
                           torch.arange((2 * n - 1 - r) * half, (2 * n - r) * half)])
                if zigzag else torch.arange(r * L // n, (r + 1) * L // n)).to(DEVICE)
        qr, kr, vr = (t.clone().requires_grad_() for t in (q[:, :, rows], k, v))
        out = comm.attention_rows(qr, kr, vr, is_causal=True, enable_gqa=True, group=group,
                                  zigzag=zigzag)
        close(out, ref[:, :, rows].detach())
        out.backward(grad[:, :, rows])
        close(qr.grad, ref_in[0].grad[:, :, rows])
        dk, dv = dk + kr.grad, dv + vr.grad
    close(dk, ref_in[1].grad)
    close(dv, ref_in[2].grad)


def test_context_parallel_on_one_gpu_trains_like_one_device(tmp_path):
    """cp 2 on two simulated ranks sharing the GPU (float32, TF32 off): the Llama's loss and
    every gradient equal one device's."""
    from nncompile.tools.simulate import run_ranks
    model, batch = _llama(seq=128), _batch(128, 2, 128)
    cfg = ComputeConfig(2, 2, parallel={"cp": 2})
    reports = run_ranks(2, lambda rank: nncompile.verify(model, batch, cfg, "tp",
                                                         gen_savedir=str(tmp_path)))
    assert all(r.ok for r in reports), "\n".join(map(str, reports))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_experts_on_cuda_equal_the_hugging_face_experts(dtype):
    """moe_experts on the GPU (bfloat16 on compute capability 9+: torch._grouped_mm, else one
    product per expert) gives Mixtral's experts module's output and weight gradients, an
    expert with no token included."""
    import transformers
    from nncompile.experts import _grouped_ok, routed_sum
    cfg = transformers.MixtralConfig(hidden_size=64, intermediate_size=128,
                                     num_local_experts=4, num_experts_per_tok=2)
    experts = transformers.models.mixtral.modeling_mixtral.MixtralExperts(cfg)
    experts = experts.to(DEVICE, dtype)
    for w in experts.parameters():
        torch.nn.init.normal_(w, std=0.125)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(96, 64, generator=g).to(DEVICE, dtype)
    index = torch.randint(0, 3, (96, 2), generator=g).to(DEVICE)    # expert 3: no token
    index[:, 1] = (index[:, 0] + 1) % 3
    weights = torch.rand(96, 2, generator=g).to(DEVICE, dtype)
    assert _grouped_ok(x) == (dtype == torch.bfloat16
                              and torch.cuda.get_device_capability() >= (9, 0))
    outs, grads = [], []
    for fn in (lambda: experts(x, index, weights),
               lambda: routed_sum(x, index, weights, experts.gate_up_proj, experts.down_proj,
                                  "silu", False)):
        experts.zero_grad()
        y = fn()
        y.float().square().sum().backward()
        outs.append(y.float())
        grads.append([w.grad.float() for w in experts.parameters()])
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    assert torch.allclose(outs[0], outs[1], rtol=tol, atol=tol * float(outs[0].abs().max()))
    for a, b in zip(*grads):
        assert torch.allclose(a, b, rtol=tol, atol=tol * float(a.abs().max()))
        assert float(b[3].abs().max()) == 0.0         # the expert without tokens: zeros
