"""Mixture-of-experts models from Hugging Face (Mixtral, Qwen3-MoE: top-2 of 4 experts with the
router's load-balancing loss in the loss; DeepSeek-V3: group-limited routing with a shared
expert and multi-head latent attention) train like one device under the tensor plan, autodist
and context parallelism. Under `tp` each layer's experts split across the plan's ranks
(passes/fuse_experts.py, nncompile/rules/experts.py): every rank routes every token exactly,
computes the rows of its own experts and the outputs are summed; a rank whose experts get no
token computes nothing and still takes part."""
import copy

import pytest
import torch
from torch.distributed.tensor import DTensor

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
    ("qwen3_moe", "tp", {"cp": 2}),
    # MLA: q and k heads (nope + rope) wider than v's
    ("deepseek_v3", "tp", {"cp": 2}),
])
def test_moe_model_equals_one_device(arch, policy, pas, tmp_path):
    report = nncompile.verify(moe(arch), batch(), ComputeConfig(2, 2, parallel=pas), policy,
                              gen_savedir=str(tmp_path))
    assert report.ok, report


EXPERTS = ("experts.gate_up_proj", "experts.down_proj")


def expert_elements(pm) -> int:
    """This rank's expert parameter elements (pm.named_parameters(): the model's names)."""
    return sum((p.to_local() if isinstance(p, DTensor) else p).numel()
               for n, p in pm.named_parameters() if n.endswith(EXPERTS))


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "deepseek_v3"])
def test_experts_split_across_the_plan(arch, tmp_path):
    """plan 4, 4 experts: each rank holds one expert of every MoE layer (a quarter of the
    expert parameters), the layer's output is summed over the plan, and training steps equal
    one device's. The experts module is recognized by its interface whatever form this
    transformers computes it in (grouped products, masked rows, a loop)."""
    from nncompile.tools.simulate import run_ranks
    model, data = moe(arch), batch()
    whole = sum(p.numel() for n, p in model.named_parameters() if n.endswith(EXPERTS))
    layers = 2 if arch != "deepseek_v3" else 1
    cfg = ComputeConfig(4, 4)

    def rank_fn(rank):
        pm = nncompile.parallelize(copy.deepcopy(model), data, cfg, pas_policy="tp",
                                   gen_savedir=str(tmp_path))
        return expert_elements(pm), open(pm.gencode_path).read().count("comm.local_moe(")

    for mine, calls in run_ranks(4, rank_fn):
        assert mine * 4 == whole and calls == layers
    report = nncompile.verify(model, data, cfg, "tp", gen_savedir=str(tmp_path / "v"))
    assert report.ok, report


def test_all_tokens_routed_to_one_ranks_experts(tmp_path):
    """A router that sends every token to experts 0 and 1 (rank 0's at plan 2): rank 1
    computes no rows, nothing is dropped, nothing hangs, and the step equals one device."""
    model = moe("mixtral")
    for layer in model.model.model.layers:
        layer.mlp.gate.weight.data.zero_()            # equal scores: top-2 = experts 0, 1
    report = nncompile.verify(model, batch(), ComputeConfig(2, 2), "tp",
                              gen_savedir=str(tmp_path))
    assert report.ok, report


def train_units_like_one_device(model, cfg, policy, tmp_path) -> list:
    """5 AdamW steps of `model` compiled for `cfg` with `policy`, each data-parallel unit on
    its share of the batch: every unit's losses (the router's load-balancing loss included)
    and the weights equal one device accumulating over the shares. Returns each rank's
    module."""
    from nncompile.tools.simulate import run_ranks
    units = cfg.runtime_ngpus // cfg.plan_ngpus
    rows = 4 // units
    batches = [[{k: v[u * rows:(u + 1) * rows] for k, v in batch_at(step).items()}
                for u in range(units)] for step in range(5)]
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    want = []
    for step in range(5):
        losses = []
        for u in range(units):
            loss = ref(**batches[step][u])
            (loss / units).backward()
            losses.append(float(loss))
        opt.step()
        opt.zero_grad()
        want.append(losses)

    def rank_fn(rank):
        pm = nncompile.parallelize(copy.deepcopy(model), batches[0][0], cfg, pas_policy=policy,
                                   gen_savedir=str(tmp_path))
        popt = nncompile.build_optimizer(pm, torch.optim.AdamW, lr=1e-2)
        got = []
        for step in range(5):
            loss = pm(**batches[step][pm.dp_rank])
            loss.backward()
            popt.step()
            popt.zero_grad()
            got.append(float(loss))
        return pm.dp_rank, got, pm.gather_params(), pm

    out = []
    for unit, got, params, pm in run_ranks(cfg.runtime_ngpus, rank_fn):
        assert got == pytest.approx([w[unit] for w in want], rel=1e-5)
        for name, p in ref.named_parameters():
            bound = 5e-4 * float(p.detach().abs().max())
            assert float((params[name] - p.detach()).abs().max()) <= bound, name
        out.append(pm)
    return out


def test_experts_split_with_data_parallelism_trains_like_one_device(tmp_path):
    """Experts split over plan 2 x 2 data-parallel units: 5 AdamW steps like one device."""
    train_units_like_one_device(moe("mixtral"), ComputeConfig(2, 4), "tp", tmp_path)


def batch_at(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return {"input_ids": torch.randint(0, 64, (4, 16), generator=g),
            "labels": torch.randint(0, 64, (4, 16), generator=g)}
