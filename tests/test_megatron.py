"""`tp` is Megatron-LM's plan and `tp_sp` its sequence-parallel variant: the collectives each
issues at run time, counted by torch's CommDebugMode on 2 gloo ranks (tests/workers/
megatron_comms.py), and the plan's shape on models the planner has not seen.
Parity of both policies with one device is in test_parity.py."""
import json

import re

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
    qwen2 = report.pop()
    assert {(r["model"], r["policy"]) for r in report} == {
        (m, p) for m in ("gpt", "hf_llama") for p in ("tp", "tp_sp")}
    # Qwen2 (2 blocks), a training forward after the input check: Megatron's 4 all-reduces,
    # and one all_gather of 40 bytes on the CPU group (the lockstep exchange,
    # runtime/protocol/lockstep.py), which check_lockstep=False removes
    assert qwen2["model"] == "hf_qwen2"
    assert qwen2["forward"] == {"allreduce_": 4, "allgather_": 1}, qwen2
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


class _Stops(nn.Module):
    """A block whose q/k/v splits cannot go on: a cumulative sum over the features the column
    split divides (no rule splits the dim it sums along); the MLP splits."""

    def __init__(self, d=32, heads=4):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.up, self.down = nn.Linear(d, 64), nn.Linear(64, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (lin(x).cumsum(-1).view(b, t, self.heads, -1).transpose(1, 2)
                   for lin in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, d)
        x = x + self.o(y)
        return x + self.down(F.relu(self.up(x)))


class _StopsModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.layers = nn.ModuleList(_Stops() for _ in range(2))

    def forward(self, ids):
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


def _replicated_warning(model, batch, n=2):
    with pytest.warns(UserWarning, match="run replicated") as rec:
        g = _plan(tp, model, batch, n)
    texts = [str(w.message) for w in rec if "run replicated" in str(w.message)]
    assert len(texts) == 1, texts                         # said once
    return g, texts[0]


def test_a_split_that_cannot_go_on_says_where_it_stopped():
    """The warning gives the reason actually found, first, once per layer kind (all blocks on
    one line), with the op and source line where the split stopped; it does not blame head
    counts that divide."""
    torch.manual_seed(0)
    g, text = _replicated_warning(_StopsModel(), {"ids": torch.randint(0, 64, (2, 8))})
    lines = text.splitlines()[1:]
    assert [ln.split(":")[0].strip() for ln in lines] == [
        "q (layers.0, layers.1)", "k (layers.0, layers.1)", "v (layers.0, layers.1)",
        "o (layers.0, layers.1)"], text
    assert lines[0].startswith("  q (layers.0, layers.1): its split stopped at "
                               "aten.cumsum.default in layers.0 (")
    assert "test_megatron.py:" in lines[0] and "no rule takes its inputs split" in lines[0]
    assert lines[3].startswith("  o (layers.0, layers.1): its input comes from q, k, v, which "
                               "run replicated"), text
    assert "not divisible" not in text and "Pick a plan size" not in text, text
    mlp = {v.fqn: str(v.placement) for v in g.params if ".up." in v.fqn or ".down." in v.fqn}
    assert mlp == {f"layers.{i}.{k}": p for i in range(2) for k, p in [
        ("up.weight", "S(0)"), ("up.bias", "S(0)"), ("down.weight", "S(1)"),
        ("down.bias", "R")]}, mlp


@pytest.mark.parametrize("kv_heads,n,hint", [
    (1, 2, "A single key/value head cannot be split by any plan size."),
    (2, 4, "Pick a plan size that divides the head counts to split them.")])
def test_heads_that_do_not_divide_are_named_as_the_cause(kv_heads, n, hint):
    """Key/value heads that do not divide by the plan: the head counts, checked, are the
    reason given."""
    torch.manual_seed(0)
    model = Tiny()
    for layer in model.layers:
        layer.kv_heads = kv_heads
        layer.k = nn.Linear(32, 8 * kv_heads, bias=False)
        layer.v = nn.Linear(32, 8 * kv_heads, bias=False)
    batch = {"ids": torch.randint(0, 64, (2, 8)), "labels": torch.randint(0, 64, (2, 8))}
    _, text = _replicated_warning(model, batch, n)
    first = text.splitlines()[1]
    assert first.startswith(f"  q (layers.0, layers.1): heads not divisible by {n} (4 / "
                            f"{kv_heads} heads in layers.0); its split stopped at "), text
    assert text.endswith(hint), text


# ---- linears in any spelling -------------------------------------------------------------
SPELLINGS = ("matmul_T", "linear", "addmm", "einsum")


def _project(x, w, b, spelling):
    """x W^T + b written the ways model code writes it."""
    if spelling == "matmul_T":                  # FalconLinear
        return x @ w.T + b
    if spelling == "linear":
        return F.linear(x, w, b)
    if spelling == "addmm":
        return torch.addmm(b, x.reshape(-1, x.shape[-1]), w.t()).view(*x.shape[:-1], -1)
    return torch.einsum("...k,nk->...n", x, w) + b


class FalconStyleBlock(nn.Module):
    """Attention and MLP with every projection a bare weight and bias parameter, applied in
    one spelling (or each projection in the next spelling, for "mixed")."""
    PROJ = {"q": (32, 32), "k": (32, 32), "v": (32, 32), "o": (32, 32), "up": (64, 32),
            "down": (32, 64)}

    def __init__(self, spelling, heads=4):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(32), nn.LayerNorm(32)
        self.w = nn.ParameterDict({k: nn.Parameter(torch.randn(o, i) * i ** -0.5)
                                   for k, (o, i) in self.PROJ.items()})
        self.b = nn.ParameterDict({k: nn.Parameter(torch.randn(o) * 0.1)
                                   for k, (o, i) in self.PROJ.items()})
        self.spell = {k: SPELLINGS[i % 4] if spelling == "mixed" else spelling
                      for i, k in enumerate(self.PROJ)}

    def proj(self, k, x):
        return _project(x, self.w[k], self.b[k], self.spell[k])

    def forward(self, x):
        b, t, d = x.shape
        h = self.ln1(x)
        q, k, v = (self.proj(n, h).view(b, t, self.heads, -1).transpose(1, 2) for n in "qkv")
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj("o", y.transpose(1, 2).reshape(b, t, d))
        return x + self.proj("down", F.gelu(self.proj("up", self.ln2(x))))


class FalconStyle(nn.Module):
    def __init__(self, spelling, blocks=2):
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.h = nn.ModuleList(FalconStyleBlock(spelling) for _ in range(blocks))
        self.head = nn.Linear(32, 64, bias=False)

    def forward(self, ids, labels):
        x = self.emb(ids)
        for block in self.h:
            x = block(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def _ids(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"ids": torch.randint(0, 64, (2, 8), generator=g),
            "labels": torch.randint(0, 64, (2, 8), generator=g)}


def _weight_notes(g):
    """{projection fqn: placement of its weight}"""
    return {v.fqn: str(v.placement) for v in g.params if len(v.meta.shape) == 2}


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_linears_in_any_spelling_get_column_row_pairs(spelling):
    """x @ w.T + b, F.linear, addmm and einsum all give q/k/v/up column splits (weight rows
    split) and o/down row splits (weight columns split), as aten.linear does."""
    from nncompile.passes.policies.megatron import split_share
    torch.manual_seed(0)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)       # no "linears run replicated"
        g = _plan(tp, FalconStyle(spelling), _ids())
    notes = _weight_notes(g)
    for i in range(2):
        got = {k: notes[f"h.{i}.w.{k}"] for k in FalconStyleBlock.PROJ}
        assert got == {"q": "S(0)", "k": "S(0)", "v": "S(0)", "o": "S(1)", "up": "S(0)",
                       "down": "S(1)"}, (spelling, got)
    biases = {v.fqn: str(v.placement) for v in g.params if v.fqn.startswith("h.0.b.")}
    assert biases == {"h.0.b.q": "S(0)", "h.0.b.k": "S(0)", "h.0.b.v": "S(0)",
                      "h.0.b.up": "S(0)", "h.0.b.o": "R", "h.0.b.down": "R"}, biases
    assert notes["emb.weight"] == notes["head.weight"] == "R"
    assert split_share(g) == 1.0


def test_falcon_style_block_matches_one_device_with_two_all_reduces_per_block(tmp_path):
    """Every spelling in one model: 2 forward all-reduces per block, and loss and gradients
    of 2 simulated ranks equal one device's."""
    torch.manual_seed(0)
    model = FalconStyle("mixed")
    cfg = nncompile.ComputeConfig(2, 2)
    report = nncompile.verify(model, _ids(), cfg, pas_policy="tp", gen_savedir=str(tmp_path),
                              inputs=_ids(1))
    assert report.ok, report
    plan = json.loads((tmp_path / "verify_FalconStyle" / "plan.json").read_text())
    counts = plan["collectives"]
    # backward: Megatron's f on the normed input of each region, and on v's own reshape of it
    # (the addmm spelling flattens its input: a second replicated value entering the region)
    assert counts["comm.all_reduce"] == 2 * 2 and counts["comm.sync_grad"] == 3 * 2, counts
    assert not {k for k in counts} - {"comm.all_reduce", "comm.sync_grad", "comm.to_partial"}


def _falcon(**kw) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    return _CausalLM(transformers.FalconForCausalLM(transformers.FalconConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=32, ffn_hidden_size=64, bos_token_id=0, eos_token_id=0, **kw)))


@pytest.mark.parametrize("variant", ["per_head_qkv", "new_decoder_grouped_kv"])
def test_hf_falcon_splits_like_megatron(variant, tmp_path):
    """Hugging Face Falcon: every projection a FalconLinear (`x @ self.weight.T + bias`);
    its fused query_key_value keeps each head's (or each kv group's) q, k, v rows together,
    so a column split by rows splits it by heads. 2 forward all-reduces per block, every
    block weight split, equal to one device."""
    from nncompile.passes.policies.megatron import split_share
    kw = {"per_head_qkv": dict(multi_query=False, bias=True),
          "new_decoder_grouped_kv": dict(new_decoder_architecture=True, num_kv_heads=2)}[variant]
    model = _falcon(**kw)
    batch = {"input_ids": torch.randint(0, 64, (2, 16))}
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)       # no "linears run replicated"
        g = _plan(tp, model, batch)
    assert split_share(g) == 1.0
    cfg = nncompile.ComputeConfig(2, 2)
    report = nncompile.verify(model, batch, cfg, pas_policy="tp", gen_savedir=str(tmp_path))
    assert report.ok, report
    counts = json.loads((tmp_path / "verify__CausalLM" / "plan.json").read_text())[
        "collectives"]
    # parallel attention: both regions read one layer norm (two in the new architecture), so
    # one backward sync_grad per norm
    norms = 1 if variant == "per_head_qkv" else 2
    assert counts["comm.all_reduce"] == 2 * 2 and counts["comm.sync_grad"] == norms * 2, counts


def test_split_share_of_a_full_plan_and_of_multi_query_falcon():
    """split_share: Llama's blocks are split whole; multi-query Falcon (one k/v head fused
    after the q heads) keeps query_key_value whole and splits the rest."""
    from nncompile.passes.policies.megatron import split_share
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    llama = _CausalLM(transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)))
    batch = {"input_ids": torch.randint(0, 64, (2, 8))}
    assert split_share(_plan(tp, llama, batch)) == 1.0
    assert split_share(_plan(tp, llama, batch, n=1)) == 0.0
    with pytest.warns(UserWarning) as rec:
        g = _plan(tp, _falcon(), batch)
    text = "\n".join(str(w.message) for w in rec if "run replicated" in str(w.message))
    # Falcon cuts its fused q|k|v by slicing (transformers < 5.25) or by split() (5.25 on)
    assert re.search(r"  self_attention\.query_key_value \(lm\.transformer\.h\.0, "
                     r"lm\.transformer\.h\.1\): heads not divisible by 2 \(4 / 1 heads in "
                     r"lm\.transformer\.h\.0\); its split stopped at "
                     r"aten\.(slice\.Tensor|split_with_sizes\.default) ", text), text
    assert "  self_attention.dense (lm.transformer.h.0, lm.transformer.h.1): its input comes " \
           "from self_attention.query_key_value, which run replicated" in text, text
    assert text.endswith("A single key/value head cannot be split by any plan size."), text
    qkv, dense, mlp = 32 * (32 + 2 * 8), 32 * 32, 2 * 32 * 64
    assert split_share(g) == pytest.approx(mlp / (qkv + dense + mlp))
    print(f"\nsplit share at plan 2: HF Llama 1.00, multi-query Falcon {split_share(g):.2f}")


def _deepseek_v3() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "DeepseekV3Config"):
        pytest.skip("transformers without DeepSeek-V3")
    torch.manual_seed(0)
    return _CausalLM(transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16,
        kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8,
        n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=2,
        max_position_embeddings=32, rope_scaling=None)))


def test_deepseek_v3_mla_splits_heads_after_the_low_rank_up_projection(tmp_path):
    """DeepSeek-V3's multi-head latent attention: the down-projections and their norms stay
    replicated, q_b_proj and kv_b_proj split by heads (the rotary key shared by every head
    broadcast to the local ones), o_proj split by rows: 2 forward all-reduces per block,
    equal to one device."""
    model = _deepseek_v3()
    batch = {"input_ids": torch.randint(0, 64, (2, 8))}
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)       # no "linears run replicated"
        g = _plan(tp, model, batch)
    notes = {v.fqn.split("self_attn.")[1]: str(v.placement) for v in g.params
             if ".layers.1.self_attn." in v.fqn}
    assert notes == {"q_a_proj.weight": "R", "q_a_layernorm.weight": "R",
                     "q_b_proj.weight": "S(0)", "kv_a_proj_with_mqa.weight": "R",
                     "kv_a_layernorm.weight": "R", "kv_b_proj.weight": "S(0)",
                     "o_proj.weight": "S(1)"}, notes
    attn = [v for v in g.params if ".self_attn." in v.fqn and len(v.meta.shape) == 2]
    split = sum(v.meta.numel for v in attn if str(v.placement) != "R")
    assert split / sum(v.meta.numel for v in attn) == pytest.approx(
        (48 * 16 + 64 * 16 + 32 * 32) / (16 * 32 + 48 * 16 + 20 * 32 + 64 * 16 + 32 * 32))
    cfg = nncompile.ComputeConfig(2, 2)
    report = nncompile.verify(model, batch, cfg, pas_policy="tp", gen_savedir=str(tmp_path))
    assert report.ok, report
    counts = json.loads((tmp_path / "verify__CausalLM" / "plan.json").read_text())[
        "collectives"]
    assert counts["comm.all_reduce"] == 2 * 2, counts
    assert not {k for k in counts} - {"comm.all_reduce", "comm.sync_grad", "comm.to_partial"}
