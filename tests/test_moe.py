"""Mixture-of-experts models from Hugging Face (Mixtral, Qwen3-MoE: top-2 of 4 experts with the
router's load-balancing loss in the loss; DeepSeek-V3: group-limited routing with a shared
expert and multi-head latent attention) train like one device under the tensor plan, autodist
and context parallelism. Their experts run replicated along the plan (each rank holds every
expert); the router, the sort of tokens by expert and the grouped matrix products are exact on
every rank."""
import pytest
import torch

import models
import nncompile
from nncompile import ComputeConfig

tf = pytest.importorskip("transformers")

COMMON = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=0)


def moe(arch: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if arch == "mixtral":
        lm = tf.MixtralForCausalLM(tf.MixtralConfig(
            **COMMON, intermediate_size=64, num_key_value_heads=2, num_local_experts=4,
            num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.02))
    elif arch == "qwen3_moe":
        lm = tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(
            **COMMON, intermediate_size=64, moe_intermediate_size=16, num_key_value_heads=2,
            num_experts=4, num_experts_per_tok=2, head_dim=8, output_router_logits=True,
            router_aux_loss_coef=0.02, decoder_sparse_step=1))
    else:
        if not hasattr(tf, "DeepseekV3Config"):
            pytest.skip("transformers without DeepSeek-V3")
        lm = tf.DeepseekV3ForCausalLM(tf.DeepseekV3Config(
            **COMMON, intermediate_size=64, moe_intermediate_size=16, num_key_value_heads=4,
            q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8,
            v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1,
            n_group=2, topk_group=1, rope_scaling=None))
    return models.HFCausalLM(lm).train()


def batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {"input_ids": torch.randint(0, 64, (4, 16), generator=g),
            "labels": torch.randint(0, 64, (4, 16), generator=g)}


@pytest.mark.parametrize("arch, policy, pas", [
    ("mixtral", "tp", {}), ("qwen3_moe", "tp", {}), ("deepseek_v3", "tp", {}),
    ("mixtral", "autodist", {}),
    ("qwen3_moe", "tp", {"context_parallel": 2}),
    # MLA: q and k heads (nope + rope) wider than v's
    ("deepseek_v3", "tp", {"context_parallel": 2}),
])
def test_moe_model_equals_one_device(arch, policy, pas, tmp_path):
    report = nncompile.verify(moe(arch), batch(), ComputeConfig(2, 2, pas_config=pas), policy,
                              gen_savedir=str(tmp_path))
    assert report.ok, report
