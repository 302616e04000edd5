"""Frozen parameters stay frozen (LoRA fine-tuning): the GPT with every weight frozen and
low-rank adapters on q/v/fc trains 5 AdamW steps under dp, data, tp and autodist (and ZeRO-1,
ZeRO-3 over dp 2 and tp 2 x ZeRO-3) on simulated ranks with the single-device losses and
adapters; the frozen weights come out bit-for-bit unchanged, get no gradient, no reduction and
no optimizer state, and are kept in checkpoints and merges. Hugging Face's Whisper, whose
encoder freezes its position table itself, trains under tp 2 x dp 2 with ZeRO-3 as on one
device. requires_grad is part of the fingerprint and of autodist's memory model."""
from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.tensor import DTensor
import torch.nn as nn

import models
import nncompile
from nncompile import ComputeConfig
from nncompile.tools.simulate import run_ranks

STEPS = 5


class LoRALinear(nn.Module):
    """base(x) + x A^T B^T with base frozen (PEFT's LoRA layer without dropout)."""

    def __init__(self, base: nn.Linear, r: int = 4):
        super().__init__()
        self.base = base.requires_grad_(False)
        self.lora_A = nn.Parameter(torch.randn(r, base.in_features) * 0.1)
        self.lora_B = nn.Parameter(torch.randn(base.out_features, r) * 0.1)

    def forward(self, x):
        return self.base(x) + (x @ self.lora_A.t()) @ self.lora_B.t()


def lora_gpt() -> nn.Module:
    model = models.build("gpt").requires_grad_(False)
    for block in model.h:
        block.attn.q_proj = LoRALinear(block.attn.q_proj)
        block.attn.v_proj = LoRALinear(block.attn.v_proj)
        block.mlp_fc = LoRALinear(block.mlp_fc)
    return model


def _batches():
    # no ignored targets: each data-parallel unit's mean loss then averages to the global one
    g = torch.Generator().manual_seed(0)
    return [{"idx": torch.randint(0, 64, (4, 16), generator=g),
             "targets": torch.randint(0, 64, (4, 16), generator=g)} for _ in range(STEPS)]


class Whisper(nn.Module):
    """Hugging Face's WhisperForConditionalGeneration returning its loss."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_features, decoder_input_ids, labels):
        return self.model(input_features=input_features, decoder_input_ids=decoder_input_ids,
                          labels=labels, use_cache=False).loss


def whisper() -> nn.Module:
    """A tiny random Whisper; its encoder's sinusoidal position table is frozen by
    transformers itself (requires_grad_(False)), a ZeRO-3 unit of its own."""
    from transformers import WhisperConfig, WhisperForConditionalGeneration
    cfg = WhisperConfig(vocab_size=64, num_mel_bins=8, d_model=32, encoder_layers=2,
                        decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
                        encoder_ffn_dim=64, decoder_ffn_dim=64, max_source_positions=16,
                        max_target_positions=32, dropout=0.0, attention_dropout=0.0,
                        activation_dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                        decoder_start_token_id=1)
    return Whisper(WhisperForConditionalGeneration(cfg)).train()


def _whisper_batches():
    g = torch.Generator().manual_seed(0)
    return [{"input_features": torch.randn(4, 8, 32, generator=g),
             "decoder_input_ids": torch.randint(3, 64, (4, 8), generator=g),
             "labels": torch.randint(3, 64, (4, 8), generator=g)} for _ in range(STEPS)]


def _reference(model, batches=_batches, **adamw):
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                            **{"lr": 1e-2, **adamw})
    losses = []
    for b in batches():
        loss = model(**b)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}


def _train(model, policy, plan, world, use_zero, savedir, batches=_batches, **adamw):
    dp = world // plan

    def rank_fn(rank):
        unit_batch = tuple(v[:v.shape[0] // dp] for v in batches()[0].values())
        pm = nncompile.parallelize(copy.deepcopy(model), unit_batch,
                                   ComputeConfig(plan, world, use_zero=use_zero),
                                   pas_policy=policy, gen_savedir=savedir)
        opt = nncompile.build_optimizer(pm, torch.optim.AdamW, **{"lr": 1e-2, **adamw})
        unit = rank // plan
        losses, frozen_grads = [], []
        for b in batches():
            rows = len(next(iter(b.values()))) // dp   # this unit's rows of the global batch
            loss = pm(**{k: v[unit * rows:(unit + 1) * rows] for k, v in b.items()})
            loss.backward()
            frozen_grads += [n for n, p in pm.named_parameters()
                             if not p.requires_grad and p.grad is not None]
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach().clone())
        state = opt.state_dict()
        return {"losses": losses, "params": pm.gather_params(), "frozen_grads": frozen_grads,
                "trainable": sorted(n for n, p in pm.named_parameters() if p.requires_grad),
                "trainable_numel": sum(   # this rank's elements (a DTensor's local ones)
                    (p.to_local() if isinstance(p, DTensor) else p).numel()
                    for p in pm.parameters() if p.requires_grad),
                "opt_numel": sum((t.to_local() if isinstance(t, DTensor) else t).numel()
                                 for st in state["state"].values()
                                 for t in st.values() if torch.is_tensor(t) and t.dim()),
                "model_sd": pm.local_state_dict(), "opt_sd": state}
    return run_ranks(world, rank_fn)


def _check_like_one_device(model, out, ref, plan, world, rtol):
    """Losses and trainable weights as on one device; the frozen ones unchanged, no gradient."""
    (ref_losses, ref_params), dp = ref, world // plan
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for r in out:
        assert not r["frozen_grads"], f"frozen parameters got gradients: {r['frozen_grads']}"
        for fqn, p in model.named_parameters():
            if not p.requires_grad:
                assert torch.equal(r["params"][fqn], before[fqn]), f"{fqn} changed"
                continue
            assert not torch.equal(r["params"][fqn], before[fqn]), f"{fqn} did not train"
            torch.testing.assert_close(r["params"][fqn], ref_params[fqn], rtol=rtol, atol=1e-6)
    losses = torch.stack([torch.stack(out[u * plan]["losses"]) for u in range(dp)]).mean(0)
    torch.testing.assert_close(losses, torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("policy,plan,world,use_zero", [
    ("dp", 1, 2, False), ("dp", 1, 2, True), ("data", 2, 2, False), ("tp", 2, 2, False),
    ("autodist", 2, 2, False), ("dp", 1, 2, 3), ("tp", 2, 4, 3)])
def test_lora_trains_like_one_device(tmp_path, policy, plan, world, use_zero):
    torch.manual_seed(0)
    model = lora_gpt()
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert len(frozen) > len(trainable) > 0
    ref = _reference(model)
    out = _train(model, policy, plan, world, use_zero, tmp_path / "gen")
    _check_like_one_device(model, out, ref, plan, world, rtol=1e-5)
    # the optimizer holds state (exp_avg, exp_avg_sq) for the rank's adapters only; under ZeRO
    # the data-parallel ranks' shards of them add up to that (under ZeRO-3 each rank's
    # adapters are its shards already)
    dp = world // plan
    for shard in range(plan):
        ranks = [u * plan + shard for u in range(dp)] if use_zero else [shard]
        held = ranks if use_zero == 3 else [shard]
        assert sum(out[r]["opt_numel"] for r in ranks) == \
            2 * sum(out[r]["trainable_numel"] for r in held)


def test_whisper_zero3_keeps_its_frozen_positions_and_trains_like_one_device(tmp_path):
    """Whisper's frozen position table is a ZeRO-3 unit of its own: under tp 2 x dp 2 with
    ZeRO-3 it stays frozen and the rest trains as on one device. AdamW at lr 1e-3, eps 1e-6:
    the cross-attention key projections' gradients fall below the default eps (1e-8), where
    AdamW's first steps (lr * g / (|g| + eps)) would turn the plan's float32 reordering of
    their sums (4e-7 of the gradients' scale) into lr-sized steps."""
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = whisper()
    assert [n for n, p in model.named_parameters() if not p.requires_grad] == \
        ["model.model.encoder.embed_positions.weight"]
    adamw = {"lr": 1e-3, "eps": 1e-6}
    ref = _reference(model, _whisper_batches, **adamw)
    out = _train(model, "tp", 2, 4, 3, tmp_path / "gen", _whisper_batches, **adamw)
    _check_like_one_device(model, out, ref, 2, 4, rtol=1e-5)


def test_frozen_weights_kept_in_merged_checkpoint(tmp_path):
    torch.manual_seed(0)
    model = lora_gpt()
    out = _train(model, "tp", 2, 2, False, tmp_path / "gen")
    merged, merged_opt = nncompile.merge_state_dicts([r["model_sd"] for r in out],
                                                     [r["opt_sd"] for r in out])
    ref = model.state_dict()
    assert set(merged) == set(ref)
    order = [n for n, _ in model.named_parameters()]
    for n, p in model.named_parameters():
        if not p.requires_grad:
            assert torch.equal(merged[n], ref[n]), n
            assert order.index(n) not in merged_opt["state"], f"optimizer state for frozen {n}"
        else:
            assert set(merged_opt["state"][order.index(n)]) >= {"exp_avg", "exp_avg_sq"}
    # the merged state loads into the original model, frozen flags untouched
    fresh = lora_gpt()
    fresh.load_state_dict(merged)
    assert {n for n, p in fresh.named_parameters() if not p.requires_grad} == \
        {n for n, p in model.named_parameters() if not p.requires_grad}


def test_requires_grad_is_in_the_fingerprint(tmp_path):
    batch = tuple(models.batch("mlp", 0).values())
    cfg = ComputeConfig(1)
    torch.manual_seed(0)
    model = models.build("mlp")
    nncompile.parallelize(model, batch, cfg, pas_policy="dp", gen_savedir=tmp_path,
                          load_module=False)
    model.fc1.requires_grad_(False)
    with pytest.raises(nncompile.ReuseError, match="graph"):
        nncompile.parallelize(model, batch, cfg, pas_policy="dp", gen_savedir=tmp_path,
                              load_module=False, reuse="match")
    text = (tmp_path / "MLP" / "gencode0.py").read_text()
    assert "FROZEN = []" in text
    nncompile.parallelize(model, batch, cfg, pas_policy="dp", gen_savedir=tmp_path,
                          load_module=False, reuse="override")
    text = (tmp_path / "MLP" / "gencode0.py").read_text()
    assert "FROZEN = ['fc1_weight', 'fc1_bias']" in text
    dumps = sorted((tmp_path / "MLP").rglob("*_trace.py"))
    assert dumps and "frozen param 'fc1.weight'" in dumps[0].read_text()


def test_autodist_counts_no_gradient_or_state_for_frozen():
    from nncompile.frontend import trace
    from nncompile.ir.placement import Replicate
    from nncompile.passes.autodist.cost_model import CostModel
    from nncompile.passes.autodist import get_profile
    torch.manual_seed(0)
    model = models.build("mlp")
    model.fc1.requires_grad_(False)
    g = trace(model, tuple(models.batch("mlp", 0).values()))
    cm = CostModel(get_profile("cpu"), n=2, training=True)
    rows = {v.fqn: v for v in g.params}
    w_frozen, w_train = rows["fc1.weight"], rows["fc2.weight"]
    assert not w_frozen.requires_grad and w_train.requires_grad
    frozen_bytes = w_frozen.meta.numel * 4
    assert cm.param_memory(w_frozen, Replicate()) == frozen_bytes
    assert cm.param_memory(w_train, Replicate()) == w_train.meta.numel * (4 + 4 + 8)
