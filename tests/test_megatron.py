"""`tp` is Megatron-LM's plan and `tp_sp` its sequence-parallel variant: the collectives each
issues at run time, counted by torch's CommDebugMode on 2 gloo ranks (tests/workers/
megatron_comms.py), and the plan's shape on models the planner has not seen.
Parity of both policies with one device is in test_parity.py."""
import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import nncompile
from nncompile.frontend import trace
from nncompile.passes.policies import tp, tp_sp


def test_runtime_collectives_per_block(run_ranks, tmp_path):
    out = tmp_path / "report.json"
    run_ranks("tests/workers/megatron_comms.py", 2, "--savedir", str(tmp_path / "gen"),
              "--out", str(out))
    report = json.loads(out.read_text())
    assert {(r["model"], r["policy"]) for r in report} == {
        (m, p) for m in ("gpt", "hf_llama") for p in ("tp", "tp_sp")}
    for r in report:
        blocks = r["blocks"]
        if r["policy"] == "tp":
            # one all-reduce after attention and one after the MLP; nothing else forward;
            # backward: Megatron's f (sync_grad) before each region
            assert r["forward"] == {"allreduce_": 2 * blocks}, r
            assert r["backward"] == {"allreduce_": 2 * blocks}, r
        else:
            # all_gather before and reduce_scatter after each region (gloo has no
            # reduce_scatter: it runs as an all-reduce), one all_gather leaving the blocks
            assert r["forward"] == {"allgather_": 2 * blocks + 1, "allreduce_": 2 * blocks}, r
            # duals: reduce-scatter <-> all-gather, the scatter into block 0 gathers, and
            # one bucket sums the sequence-split norms' weight gradients
            assert r["backward"] == {"allgather_": 2 * blocks + 1,
                                     "allreduce_": 2 * blocks + 1}, r


class SwiGLUBlock(nn.Module):
    """A Llama-like block written by hand: fused-free q/k/v with fewer kv heads, RMSNorm,
    SwiGLU; attention through explicit matmuls and softmax (no sdpa)."""

    def __init__(self, d=32, heads=4, kv_heads=2, hidden=64):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, d // heads
        self.norm1, self.norm2 = nn.RMSNorm(d), nn.RMSNorm(d)
        self.q = nn.Linear(d, d, bias=False)
        self.k = nn.Linear(d, kv_heads * self.hd, bias=False)
        self.v = nn.Linear(d, kv_heads * self.hd, bias=False)
        self.o = nn.Linear(d, d, bias=False)
        self.gate = nn.Linear(d, hidden, bias=False)
        self.up = nn.Linear(d, hidden, bias=False)
        self.down = nn.Linear(hidden, d, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        h = self.norm1(x)
        q = self.q(h).view(b, t, self.heads, self.hd).transpose(1, 2)
        k = self.k(h).view(b, t, self.kv_heads, self.hd).transpose(1, 2)
        v = self.v(h).view(b, t, self.kv_heads, self.hd).transpose(1, 2)
        rep = self.heads // self.kv_heads
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        att = (q @ k.transpose(-1, -2)) * self.hd ** -0.5
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.o(y)
        return x + self.down(F.silu(self.gate(self.norm2(x))) * self.up(self.norm2(x)))


class Tiny(nn.Module):
    def __init__(self, blocks=2, vocab=64, d=32):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(SwiGLUBlock(d) for _ in range(blocks))
        self.norm = nn.RMSNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids, labels):
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x)
        return F.cross_entropy(self.head(self.norm(x)).flatten(0, 1), labels.flatten())


def _plan(policy, model, batch, n=2):
    g = trace(model, batch)
    return policy(g, nncompile.ComputeConfig(n, n))


def _strategies(g) -> dict[str, str]:
    return {op.module_path: op.strategy.note for op in g.ops
            if op.target_name.endswith("linear.default")}


@pytest.mark.parametrize("kv_heads", [2, 1])
def test_hand_written_block_gets_column_row_pairs(kv_heads):
    torch.manual_seed(0)
    model = Tiny()
    for layer in model.layers:
        layer.kv_heads = kv_heads
        hd = layer.hd
        layer.k = nn.Linear(32, kv_heads * hd, bias=False)
        layer.v = nn.Linear(32, kv_heads * hd, bias=False)
    batch = {"ids": torch.randint(0, 64, (2, 8)), "labels": torch.randint(0, 64, (2, 8))}
    notes = _strategies(_plan(tp, model, batch))
    for i in range(2):
        mlp = {k: notes[f"layers.{i}.{k}"] for k in ("gate", "up", "down")}
        assert mlp == {"gate": "split n", "up": "split n", "down": "split k"}, notes
        attn = {k: notes[f"layers.{i}.{k}"] for k in ("q", "k", "v", "o")}
        if kv_heads == 2:        # heads split across the plan, kv heads too
            assert attn == {"q": "split n", "k": "split n", "v": "split n", "o": "split k"}
        else:                    # one kv head cannot be split: attention stays whole
            assert set(attn.values()) == {"replicate"}, attn
    assert notes["head"] == "replicate"


def test_everything_else_is_replicated_and_sp_splits_the_sequence():
    torch.manual_seed(0)
    model = Tiny()
    batch = {"ids": torch.randint(0, 64, (2, 8)), "labels": torch.randint(0, 64, (2, 8))}
    g = _plan(tp, model, batch)
    for v in g.params:
        want_split = any(v.fqn.endswith(f".{k}.weight") for k in "qkvo") or \
            any(v.fqn.endswith(f".{k}.weight") for k in ("gate", "up", "down"))
        assert (str(v.placement) != "R") == want_split, (v.fqn, v.placement)
    g = _plan(tp_sp, model, batch)
    norms = [op for op in g.ops if "norm" in op.module_path and op.module_path.startswith("layers")]
    assert norms and all(str(o.placement) == "S(1)" for op in norms for o in op.outputs
                         if o.is_tensor), [(op.name, op.outputs[0].placement) for op in norms]
    assert all(str(v.placement) == "R" for v in g.params if "norm" in v.fqn)


def test_plan_1_and_non_transformer_models():
    torch.manual_seed(0)
    model = Tiny()
    batch = {"ids": torch.randint(0, 64, (2, 8)), "labels": torch.randint(0, 64, (2, 8))}
    g = _plan(tp, model, batch, n=1)
    assert not any(op.strategy and op.strategy.is_split for op in g.ops)
    # a model with no row partner for its linears (one linear then the loss) stays replicated
    lone = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
    g = _plan(tp, lone, {"input": torch.randn(4, 8)})
    assert all(str(v.placement) == "R" for v in g.params)


class _CausalLM(nn.Module):
    """A Hugging Face causal LM called the way training scripts call it: the default
    use_cache (its key/value cache starts as an empty tensor the keys are cat onto) and
    labels=input_ids."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids):
        return self.lm(input_ids=input_ids, labels=input_ids).loss


def _hf(arch: str) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    common = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=32)
    cfg, cls = {
        "mistral": (transformers.MistralConfig(num_key_value_heads=2, **common),
                    transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config(num_key_value_heads=2, **common),
                  transformers.Qwen2ForCausalLM),
        "gpt_neox": (transformers.GPTNeoXConfig(**common), transformers.GPTNeoXForCausalLM),
    }[arch]
    return _CausalLM(cls(cfg))


@pytest.mark.parametrize("arch", ["mistral", "qwen2", "gpt_neox"])
def test_hf_models_with_their_default_cache_get_megatrons_plan(arch, tmp_path):
    """2 forward all-reduces per block and attention split by heads, with the cache on; the
    plan also equals one device (verify, 2 ranks in one process)."""
    model = _hf(arch)
    batch = {"input_ids": torch.randint(0, 64, (2, 16))}
    cfg = nncompile.ComputeConfig(2, 2)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)       # no "linears run replicated"
        out = nncompile.parallelize(model, batch, cfg, pas_policy="tp",
                                    gen_savedir=str(tmp_path), load_module=False)
    counts = json.loads((out / "plan.json").read_text())["collectives"]
    assert counts["comm.all_reduce"] == 2 * 2 and counts["comm.sync_grad"] == 2 * 2, counts
    assert not {k for k in counts} - {"comm.all_reduce", "comm.sync_grad", "comm.to_partial"}
    assert nncompile.verify(model, batch, cfg, pas_policy="tp").ok


def test_a_split_that_cannot_go_on_says_where_it_stopped():
    """A fused qkv weight sliced per head group (Phi-3) stays replicated; the warning names
    the op and the source line where the split stopped."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = _CausalLM(transformers.Phi3ForCausalLM(transformers.Phi3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=32,
        pad_token_id=0)))
    with pytest.warns(UserWarning, match=r"split of lm\.model\.layers\.0\.self_attn\.qkv_proj "
                                         r"stopped at aten\.slice\.Tensor .*modeling_phi3\.py"):
        _plan(tp, model, {"input_ids": torch.randint(0, 64, (2, 8))})
