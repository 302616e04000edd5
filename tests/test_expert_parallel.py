"""Expert parallelism (parallel.ep = E): each rank keeps its own tokens and
E-th of every MoE layer's experts; each token's picks travel to the ranks holding their
experts and back (all-to-all, counts exchanged first: runtime/program/experts.py). Hugging Face's
Mixtral, Qwen3-MoE and DeepSeek-V3 (top-2 of 4 experts, the router's load-balancing loss in
the loss) train like one device: under the `data` policy (everything else splits the batch)
and under `tp` (attention split by heads, the tokens chunked around the experts)."""
import copy
import json

import pytest
import torch

import models
import nncompile
from nncompile import ComputeConfig
from nncompile.errors import ConfigError
from test_moe import EXPERTS, batch, batch_at, expert_elements, moe, \
    train_units_like_one_device

LAYERS = {"mixtral": 2, "qwen3_moe": 2, "deepseek_v3": 1}


def ep(e: int, runtime: int | None = None, **kw) -> ComputeConfig:
    return ComputeConfig(e, runtime or e, parallel={"ep": e}, **kw)


@pytest.mark.parametrize("arch, policy", [("mixtral", "data"), ("qwen3_moe", "tp")])
def test_expert_parallel_equals_one_device(arch, policy, tmp_path):
    report = nncompile.verify(moe(arch), batch(), ep(2), policy, gen_savedir=str(tmp_path))
    assert report.ok, report
    code = next(tmp_path.glob("verify_*/gencode1.py")).read_text()
    assert code.count("= comm.dispatch_moe(") == LAYERS[arch]
    plan = json.loads(next(tmp_path.glob("verify_*/plan.json")).read_text())
    assert [r["experts_per_rank"] for r in plan["experts"]] == [2] * LAYERS[arch]
    # 64 tokens / 2 ranks x 2 picks x hidden 32 x 4 bytes, half of them to the other rank
    assert all(r["all_to_all_bytes_per_rank"] == 32 * 2 * 32 * 4 / 2 for r in plan["experts"])


SHAPES = {  # (plan_ngpus, runtime_ngpus, policy): the tensor ranks are plan_ngpus // E
    "ep2": (2, 2, "data"),          # the experts and the batch over both ranks
    "ep2_dp2": (2, 4, "data"),      # two such units, each its own batch
    "ep2_tp2": (4, 4, "tp"),        # an ep axis of 2 x 2 tensor ranks (attention by heads)
}


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "deepseek_v3"])
def test_five_adamw_steps_train_like_one_device(arch, shape, tmp_path):
    """ep 2 on 2 ranks, ep 2 x dp 2 and ep 2 x tp 2 on 4: every unit's losses (router loss
    included) and the weights after 5 AdamW steps equal one device on the units' batches;
    each rank holds half of the expert weights."""
    plan, runtime, policy = SHAPES[shape]
    model = moe(arch)
    whole = sum(p.numel() for n, p in model.named_parameters() if n.endswith(EXPERTS))
    cfg = ComputeConfig(plan, runtime, parallel={"ep": 2})
    for pm in train_units_like_one_device(model, cfg, policy, tmp_path):
        assert expert_elements(pm) * 2 == whole
        code = open(pm.gencode_path).read()
        assert code.count("= comm.dispatch_moe(") == LAYERS[arch]
        assert ("group=EP_GROUP" in code) == (shape == "ep2_tp2")
    rows = json.loads((tmp_path / "HFCausalLM" / "plan.json").read_text())["experts"]
    tokens = {"ep2": 32, "ep2_dp2": 16, "ep2_tp2": 16}[shape]   # one rank's, of 64 per step
    assert [r["all_to_all_bytes_per_rank"] for r in rows] == \
        [tokens * 2 * 32 * 4 / 2] * LAYERS[arch]                   # 2 picks x 32 wide, half away


@pytest.mark.parametrize("zero", [1, 2])
def test_zero_with_expert_parallel_trains_like_one_device(zero, tmp_path):
    """ep 2 x dp 2 with ZeRO-1 or -2 (optimizer state, and gradients, sharded over the two
    units holding the same experts): five AdamW steps like one device (ZeRO-3: the
    conformance cell ep_dp_zero3)."""
    cfg = ComputeConfig(2, 4, use_zero=zero, parallel={"ep": 2})
    train_units_like_one_device(moe("qwen3_moe"), cfg, "data", tmp_path)


def test_ep4_holds_a_quarter_of_the_experts(tmp_path):
    """ep 4: each rank's expert parameters are a quarter of one device's; DeepSeek-V3's shared
    expert and dense first layer are the rest, and the step equals one device."""
    from nncompile.tools.simulate import run_ranks
    model, data = moe("deepseek_v3"), batch()
    whole = sum(p.numel() for n, p in model.named_parameters() if n.endswith(EXPERTS))

    def rank_fn(rank):
        pm = nncompile.parallelize(copy.deepcopy(model), data, ep(4), pas_policy="data",
                                   gen_savedir=str(tmp_path))
        return expert_elements(pm)

    assert run_ranks(4, rank_fn) == [whole // 4] * 4
    report = nncompile.verify(model, data, ep(4), "data", gen_savedir=str(tmp_path / "v"))
    assert report.ok, report


@pytest.mark.parametrize("shape", ["ep2", "ep2_tp2"])
def test_all_tokens_dispatched_to_one_rank(shape, tmp_path):
    """Every token's picks are experts 0 and 1 (ep rank 0's at ep 2): ep rank 1 sends all
    its rows to ep rank 0 and computes none itself; nothing is dropped or hangs; exact."""
    model = moe("mixtral")
    for layer in model.model.model.layers:
        layer.mlp.gate.weight.data.zero_()            # equal scores: top-2 = experts 0, 1
    plan, runtime, policy = SHAPES[shape]
    cfg = ComputeConfig(plan, runtime, parallel={"ep": 2})
    report = nncompile.verify(model, batch(), cfg, policy, gen_savedir=str(tmp_path))
    assert report.ok, report


def test_checkpoints_resume_and_reshard_across_expert_parallel_sizes(tmp_path):
    """A checkpoint written at ep 2 x tp 2 (AdamW state of 2 experts per rank, split along the
    ep axis) resumes from the deduped format under the same plan and from DCP at ep 4 (the
    experts on the plan's four ranks): the next step gives the weights the first run gives."""
    from nncompile.tools.simulate import run_ranks
    model, data, nxt = moe("qwen3_moe"), batch(), batch_at(7)
    plan, runtime, policy = SHAPES["ep2_tp2"]
    first = ComputeConfig(plan, runtime, parallel={"ep": 2})

    def step(pm, opt, x):
        pm(**x).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def train(rank):
        pm = nncompile.parallelize(copy.deepcopy(model), data, first, pas_policy=policy,
                                   gen_savedir=str(tmp_path / "a"))
        opt = nncompile.build_optimizer(pm, torch.optim.AdamW, lr=1e-2)
        step(pm, opt, data)
        for fmt in ("dcp", "deduped"):
            nncompile.save_checkpoint(tmp_path / fmt, pm, opt, format=fmt)
        step(pm, opt, nxt)
        return pm.gather_params()

    def resume(cfg, fmt, policy):
        def rank_fn(rank):
            pm = nncompile.parallelize(copy.deepcopy(model), data, cfg, pas_policy=policy,
                                       gen_savedir=str(tmp_path / f"b_{fmt}"))
            opt = nncompile.build_optimizer(pm, torch.optim.AdamW, lr=1e-2)
            nncompile.load_checkpoint(tmp_path / fmt, pm, opt)
            step(pm, opt, nxt)
            return pm.gather_params()
        return run_ranks(cfg.runtime_ngpus, rank_fn)

    want = run_ranks(runtime, train)[0]
    for got in resume(ep(4), "dcp", "data") + resume(first, "deduped", policy):
        for name, w in want.items():
            assert torch.allclose(got[name], w, rtol=1e-5, atol=1e-6), name


def test_expert_parallel_errors(tmp_path):
    with pytest.raises(ConfigError, match="parallel.ep=3.*one of \\[1, 2, 4\\]"):
        ComputeConfig(4, 4, parallel={"ep": 3})
    with pytest.raises(ConfigError, match="does not combine with a pipeline, ZeRO"):
        ComputeConfig(4, 8, use_zero=1, parallel={"ep": 2})
    with pytest.raises(ConfigError, match="does not combine with parallel.cp"):
        ComputeConfig(2, 2, parallel={"ep": 2, "cp": 2})
    with pytest.raises(ConfigError, match="no mixture-of-experts layer"):
        nncompile.parallelize(models.MLP(), (torch.randn(4, 16), torch.randint(0, 8, (4,))),
                              ep(2), pas_policy="tp",
                              gen_savedir=str(tmp_path), load_module=False)
    with pytest.raises(ConfigError, match="'auto' is chosen by autodist"):
        nncompile.parallelize(moe("mixtral"), batch(), ComputeConfig(
            2, 2, parallel={"ep": "auto"}), pas_policy="tp",
            gen_savedir=str(tmp_path), load_module=False)


def test_autodist_chooses_the_experts_split(tmp_path):
    """expert_parallel="auto" at plan 4: autodist plans E = 1 (each layer's split free), 2 (an
    ep axis beside 2 tensor ranks) and 4 (dispatch on the plan's ranks), each priced with its
    batch and experts split and the dispatch's all-to-alls (cost_model.py), and keeps the
    fastest that fits the memory limit; under a limit that whole experts (12 MiB of weights,
    48 MiB with their gradients and AdamW state, ~56 MB in all) do not fit, each layer keeps
    its expert weights split. plan.json shows the candidates, each layer's choice and its
    all-to-all bytes."""
    import transformers
    torch.manual_seed(0)
    lm = transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=256, hidden_size=128, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
        num_experts_per_tok=2, output_router_logits=True))
    data = {"input_ids": torch.randint(0, 256, (4, 64)), "labels": torch.randint(0, 256, (4, 64))}
    cfg = ComputeConfig(4, 4, parallel={"ep": "auto", "mem_limit_gb": 0.045})
    nncompile.parallelize(models.HFCausalLM(lm).train(), data, cfg, pas_policy="autodist",
                          gen_savedir=str(tmp_path), load_module=False)
    plan = json.loads((tmp_path / "HFCausalLM" / "plan.json").read_text())
    auto = plan["autodist"]["expert_parallel"]
    assert [r["ep"] for r in auto["candidates"]] == [1, 2, 4] and auto["chosen"] in (1, 2, 4)
    assert plan["autodist"]["memory"]["per_rank_bytes"]["total"] <= 45e6
    code = (tmp_path / "HFCausalLM" / "gencode0.py").read_text()
    assert ("MESH_AXES = {'ep': 2}" in code) == (auto["chosen"] == 2)
    rows = plan["experts"]
    assert len(rows) == 2
    for r in rows:
        stored = [plan["params"][f"{r['module']}.{w}"] for w in ("gate_up_proj", "down_proj")]
        assert "S(0)" in stored or auto["chosen"] == 2, stored     # ep 2: split along ep
        if r["strategy"].startswith("dispatch"):   # 64 tokens x 2 picks x 128 x 4 B, 3/4 away
            assert r["all_to_all_bytes_per_rank"] == 64 * 2 * 128 * 4 * 3 / 4


def test_one_experts_block_applied_twice_is_dispatched_at_both_calls(tmp_path):
    """Qwen3-MoE with layer 1 reusing layer 0's MoE block (weights shared): torch.export names
    the second call by its access path; both calls are fused and dispatched, each rank holds
    half of the shared experts, and five AdamW steps equal one device."""
    model = moe("qwen3_moe")
    layers = model.model.model.layers
    layers[1].mlp = layers[0].mlp
    whole = sum(p.numel() for n, p in model.named_parameters() if n.endswith(EXPERTS))
    for pm in train_units_like_one_device(model, ep(2), "data", tmp_path):
        assert expert_elements(pm) * 2 == whole
        assert open(pm.gencode_path).read().count("= comm.dispatch_moe(") == 2
