"""Dynamic shapes on fused projections and multi-head latent attention (torchrun, gloo, 2
ranks): Hugging Face GPT-BigCode (multi-query, fused c_attn), Falcon (multi-query and the new
architecture, fused query_key_value) and DeepSeek-V3 (MLA), traced once at (batch, seq) =
(2, 16) with both dynamic, then called at (3, 12) (another token count), at (4, 8) (the traced
token count in another shape: a baked size would read the wrong elements there, not fail)
and back at (2, 16). At each, the loss and every gathered gradient equal one device's.

    torchrun --nproc_per_node=2 tests/workers/dynamic_fused.py --savedir gen --out report.json
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.nn as nn
import transformers as tf

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import dynamic  # noqa: E402
from models import HFCausalLM  # noqa: E402

import nncompile  # noqa: E402

RTOL, ATOL = 1e-5, 1e-6
TRACED = (2, 16)
SIZES = [(3, 12), (4, 8), (2, 16)]
# tp on every model; tp_sp with a sequence that is always even (so it is split); autodist
CASES = [("gpt_bigcode", "tp"), ("falcon_multi_query", "tp"), ("falcon_new", "tp"),
         ("deepseek_v3", "tp"), ("falcon_new", "tp_sp"), ("gpt_bigcode", "autodist")]


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    if name == "gpt_bigcode":
        cfg = tf.GPTBigCodeConfig(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32,
                                  attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
        return HFCausalLM(tf.GPTBigCodeForCausalLM(cfg)).train()
    if name.startswith("falcon"):
        kw = dict(new_decoder_architecture=True, num_kv_heads=2) if name == "falcon_new" else {}
        cfg = tf.FalconConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                              num_attention_heads=4, max_position_embeddings=32,
                              attention_dropout=0.0, hidden_dropout=0.0, bos_token_id=0,
                              eos_token_id=0, **kw)
        return HFCausalLM(tf.FalconForCausalLM(cfg)).train()
    cfg = tf.DeepseekV3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16,
        kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8,
        n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=2,
        max_position_embeddings=32, rope_scaling=None)
    return HFCausalLM(tf.DeepseekV3ForCausalLM(cfg)).train()


def batch(b: int, t: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + seed)
    ids = torch.randint(0, 64, (b, t), generator=g)
    labels = ids.clone()
    labels[0, :2] = -100                    # some ignored labels
    return {"input_ids": ids, "labels": labels}


def check(name: str, policy: str, savedir: str) -> dict:
    seq = {"name": "seq", "max": 32, "multiple_of": 2} if policy == "tp_sp" else \
        {"name": "seq", "max": 32}
    dims = {k: {0: "batch", 1: seq} for k in ("input_ids", "labels")}
    pm = nncompile.parallelize(build(name), batch(*TRACED, 0), nncompile.ComputeConfig(2, 2),
                               pas_policy=policy, gen_savedir=savedir, reuse="override",
                               instance_name=f"{name}_{policy}", dynamic_dims=dims)
    errors = {}
    for b, t in SIZES:
        for p in pm.parameters():
            p.grad = None
        data = batch(b, t, seed=b)
        loss = pm(**data)
        loss.backward()
        grads = pm.gather_grads()
        ref = build(name)
        ref_loss = ref(**data)
        ref_loss.backward()
        what = f"{name} {policy} at ({b}, {t})"
        torch.testing.assert_close(loss.detach(), ref_loss.detach(), rtol=RTOL, atol=ATOL,
                                   msg=lambda m: f"{what} loss: {m}")
        worst, compared = 0.0, 0
        for fqn, p in ref.named_parameters():
            if p.grad is None:
                continue
            scale = max(1.0, float(p.grad.abs().max()))
            torch.testing.assert_close(grads[fqn], p.grad, rtol=RTOL, atol=ATOL * scale,
                                       msg=lambda m: f"{what} grad {fqn}: {m}")
            worst = max(worst, float((grads[fqn] - p.grad).abs().max()))
            compared += 1
        errors[f"{b}x{t}"] = {"loss": loss.item(), "max_grad_err": worst, "grads": compared}
    plan = json.loads((Path(pm.gencode_path).parent / "plan.json").read_text())
    return {"model": name, "policy": policy, "sizes": errors,
            "collectives": plan["collectives"]}


if __name__ == "__main__":
    dynamic.main(lambda savedir: [check(name, policy, savedir) for name, policy in CASES])
