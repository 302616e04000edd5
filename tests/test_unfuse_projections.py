"""unfuse_projections: a fused projection cut into pieces (q, k, v; gate, up) becomes one
projection per piece over *parts* of the fused parameter, so `tp` splits q, k and v by heads.
Structure on a tiny module, `part_slices`, and third-party model code (nanoGPT's layout from
examples/nanogpt, Hugging Face GPT-2, GPT-BigCode, Phi-3, Falcon, GPT-NeoX) at plan 2: the share
of block weights split, 2 forward all-reduces per block, parity with one device."""
from __future__ import annotations

import importlib.util
import json
import math
import re
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import nncompile
from nncompile.frontend import trace
from nncompile.ir import (ParamPart, Replicate, Shard, assert_graph_equal, parse_graph,
                          part_slices, print_graph, run_graph)
from nncompile.passes import UnfuseProjections, unfuse_projections

ROOT = Path(__file__).resolve().parents[1]


class FusedAttention(nn.Module):
    """nanoGPT's attention: one `c_attn` for q, k, v, its output `.split(C, dim=2)`."""

    def __init__(self, C=16, H=4, whole=False, drop_v=False):
        super().__init__()
        self.c_attn, self.c_proj = nn.Linear(C, 3 * C), nn.Linear(C, C)
        self.H, self.C, self.whole, self.drop_v = H, C, whole, drop_v

    def forward(self, x):
        B, T, C = x.shape
        y = self.c_attn(x)
        if self.drop_v:               # only q and k sliced out: the pieces do not cover it
            q, k = y[..., :C], y[..., C:2 * C]
            v = k
        else:
            q, k, v = y.split(C, dim=2)
        q, k, v = (t.view(B, T, self.H, C // self.H).transpose(1, 2) for t in (q, k, v))
        out = self.c_proj(F.scaled_dot_product_attention(q, k, v, is_causal=True)
                          .transpose(1, 2).reshape(B, T, C))
        return (out + y.sum() if self.whole else out).sum()


def _state(m):
    return {**dict(m.named_parameters()), **dict(m.named_buffers())}


@pytest.fixture(scope="module")
def fused():
    torch.manual_seed(0)
    m = FusedAttention()
    x = torch.randn(2, 8, 16)
    return m, x, trace(m, (x,))


def test_fused_qkv_becomes_three_projections_over_parts(fused):
    m, x, g = fused
    after = unfuse_projections(g)
    parts = [v for v in after.params if v.part is not None]
    assert [v.fqn for v in parts] == [f"c_attn.{w}[{i}/3]" for w in ("weight", "bias")
                                      for i in range(3)]
    assert len({v.fqn for v in after.params}) == len(after.params)
    assert not any(v.fqn in ("c_attn.weight", "c_attn.bias") for v in after.params)
    w1 = next(v for v in parts if v.fqn == "c_attn.weight[1/3]")
    assert w1.meta.shape == (16, 16)
    assert w1.part == ParamPart("c_attn.weight", (48, 16), (48, 16), ((16, 32), (0, 16)),
                                ((0,), (1,)))
    assert next(v for v in parts if v.fqn == "c_attn.bias[2/3]").part.box == ((32, 48),)
    linears = [op for op in after.ops if op.target_name == "aten.linear.default"]
    assert len(linears) == 4 and not any(op.target_name == "aten.split.Tensor"
                                         for op in after.ops)
    # the same values as the fused graph, read from the original state; printed IR reads back
    torch.testing.assert_close(run_graph(after, _state(m), [x])[0], run_graph(g, _state(m), [x])[0])
    assert_graph_equal(parse_graph(print_graph(after)), after)
    assert unfuse_projections(after) is after                       # idempotent
    assert UnfuseProjections(1)(g) is g                             # one device keeps one GEMM


class NestedMQA(nn.Module):
    """Multi-query q | kv, then kv -> k | v (GPT-BigCode's older spelling): nested splits."""

    def __init__(self, C=16, H=4):
        super().__init__()
        self.c_attn, self.H, self.C = nn.Linear(C, C + 2 * (C // H)), H, C

    def forward(self, x):
        B, T, C = x.shape
        q, kv = self.c_attn(x).split((C, 2 * (C // self.H)), dim=-1)
        k, v = kv.split(C // self.H, dim=-1)
        q = q.view(B, T, self.H, C // self.H).transpose(1, 2)
        k, v = k.unsqueeze(1), v.unsqueeze(1)
        return F.scaled_dot_product_attention(q, k, v).sum()


class Spellings(nn.Module):
    """A fused projection as `x @ w.T + b` (Falcon's FalconLinear), as a Conv1D addmm with an
    [in, out] weight (GPT-2), and as an einsum, each cut into two pieces."""

    def __init__(self, C=8):
        super().__init__()
        self.w, self.b = nn.Parameter(torch.randn(2 * C, C)), nn.Parameter(torch.randn(2 * C))
        self.conv_w = nn.Parameter(torch.randn(C, 2 * C))
        self.conv_b = nn.Parameter(torch.randn(2 * C))
        self.e = nn.Parameter(torch.randn(2 * C, C))

    def forward(self, x):
        a, b = (x @ self.w.T + self.b).chunk(2, dim=-1)
        c, d = torch.addmm(self.conv_b, x.view(-1, x.shape[-1]), self.conv_w).view(
            *x.shape[:-1], -1).split(x.shape[-1], dim=-1)
        e, f = torch.einsum("btd,ed->bte", x, self.e).chunk(2, dim=-1)
        return (a * b + c * d + e * f).sum()


def test_every_linear_spelling_is_cut():
    torch.manual_seed(0)
    m, x = Spellings(), torch.randn(2, 4, 8)
    g = trace(m, (x,))
    after = unfuse_projections(g)
    parts = {v.fqn: v.part.box for v in after.params if v.part is not None}
    assert parts == {"w[0/2]": ((0, 8), (0, 8)), "w[1/2]": ((8, 16), (0, 8)),
                     "b[0/2]": ((0, 8),), "b[1/2]": ((8, 16),),
                     "conv_w[0/2]": ((0, 8), (0, 8)), "conv_w[1/2]": ((0, 8), (8, 16)),
                     "conv_b[0/2]": ((0, 8),), "conv_b[1/2]": ((8, 16),),
                     "e[0/2]": ((0, 8), (0, 8)), "e[1/2]": ((8, 16), (0, 8))}, parts
    torch.testing.assert_close(run_graph(after, _state(m), [x])[0], run_graph(g, _state(m), [x])[0])


def test_nested_splits_give_one_part_per_piece():
    torch.manual_seed(0)
    m, x = NestedMQA(), torch.randn(2, 8, 16)
    g = trace(m, (x,))
    after = unfuse_projections(g)
    boxes = {v.fqn: v.part.box for v in after.params if v.part is not None}
    assert boxes == {"c_attn.weight[0/3]": ((0, 16), (0, 16)),
                     "c_attn.weight[1/3]": ((16, 20), (0, 16)),
                     "c_attn.weight[2/3]": ((20, 24), (0, 16)),
                     "c_attn.bias[0/3]": ((0, 16),), "c_attn.bias[1/3]": ((16, 20),),
                     "c_attn.bias[2/3]": ((20, 24),)}
    torch.testing.assert_close(run_graph(after, _state(m), [x])[0], run_graph(g, _state(m), [x])[0])


@pytest.mark.parametrize("kw", [{"whole": True}, {"drop_v": True}])
def test_output_used_whole_or_pieces_not_covering_stays_fused(kw):
    m = FusedAttention(**kw)
    g = trace(m, (torch.randn(2, 8, 16),))
    assert unfuse_projections(g) is g


class _Block(FusedAttention):
    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.H, C // self.H).transpose(1, 2)
                   for t in self.c_attn(x).split(C, dim=2))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.c_proj(a.transpose(1, 2).reshape(B, T, C))


class _Net(nn.Module):
    def __init__(self, C, H):
        super().__init__()
        self.layers = nn.ModuleList(_Block(C, H) for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.sum()


@pytest.mark.parametrize("heads", [4, 3])
def test_parts_split_by_heads_or_one_warning_line_says_why(heads):
    from nncompile.passes.policies import tp
    torch.manual_seed(0)
    g = unfuse_projections(trace(_Net(12, heads), (torch.randn(2, 4, 12),)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        planned = tp(g, nncompile.ComputeConfig(2, 2))
    got = {v.fqn: repr(v.placement) for v in planned.params if v.fqn.startswith("layers.0.")}
    text = "\n".join(str(w.message) for w in caught if "run replicated" in str(w.message))
    if heads == 4:
        assert not text, text
        assert got == {**{f"layers.0.c_attn.{w}[{i}/3]": "S(0)" for w in ("weight", "bias")
                          for i in range(3)},
                       "layers.0.c_proj.weight": "S(1)", "layers.0.c_proj.bias": "R"}, got
    else:                       # 3 heads do not split over 2 ranks: one line for the parts
        assert set(got.values()) == {"R"}, got
        assert "c_attn[0/3], [1/3], [2/3] (layers.0, layers.1): heads not divisible by 2 " \
               "(3 heads in layers.0)" in text, text


def test_part_slices_contiguous_interleaved_and_errors():
    q = ParamPart("w", (96, 32), (96, 32), ((32, 64), (0, 32)), ((0,), (1,)))
    assert part_slices(q, (32, 32), Shard(0), 1, 2) == ((48, 64), (0, 32))
    assert part_slices(q, (32, 32), Shard(1), 0, 2) == ((32, 64), (0, 16))
    assert part_slices(q, (32, 32), Replicate(), 1, 2) == ((32, 64), (0, 32))
    # GPT-NeoX: [H * 3 * d, C] viewed (H, 3 * d, C); k = [:, d:2d] -> heads split
    k = ParamPart("w", (96, 32), (4, 24, 32), ((0, 4), (8, 16), (0, 32)), ((0, 1), (2,)))
    assert part_slices(k, (32, 32), Shard(0), 1, 2) == ((2, 4), (8, 16), (0, 32))
    full = torch.randn(96, 32)
    part = full.reshape(4, 24, 32)[:, 8:16].reshape(32, 32)
    box = part_slices(k, (32, 32), Shard(0), 1, 2)
    local = full.reshape(4, 24, 32)[tuple(slice(a, b) for a, b in box)].reshape(16, 32)
    torch.testing.assert_close(local, part.chunk(2, 0)[1])
    # within one head: a range that is a box of the inner dim
    assert part_slices(k, (32, 32), Shard(0), 3, 8) == ((1, 2), (12, 16), (0, 32))
    # a dim merging view dims (3, 4): half of its 12 rows is no box of the view
    bad = ParamPart("w", (12, 2), (3, 4, 2), ((0, 3), (0, 4), (0, 2)), ((0, 1), (2,)))
    with pytest.raises(ValueError, match="not a box"):
        part_slices(bad, (12, 2), Shard(0), 0, 2)


# ---- third-party models at plan 2 ------------------------------------------------------------
class _LM(nn.Module):
    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, input_ids):
        return self.m(input_ids=input_ids, labels=input_ids, use_cache=False).loss


def _hf(cfg_name, model_name, **kw):
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = getattr(tf, cfg_name)(vocab_size=64, **kw)
    for name in ("attn_pdrop", "resid_pdrop", "embd_pdrop", "attention_dropout", "hidden_dropout"):
        if hasattr(cfg, name):
            setattr(cfg, name, 0.0)
    return _LM(getattr(tf, model_name)(cfg)), {"input_ids": torch.randint(0, 64, (2, 8))}


def _nanogpt():
    spec = importlib.util.spec_from_file_location("nanogpt_model",
                                                  ROOT / "examples/nanogpt/model.py")
    mod = sys.modules[spec.name] = importlib.util.module_from_spec(spec)   # its dataclass
    spec.loader.exec_module(mod)
    torch.manual_seed(0)
    m = mod.GPT(mod.GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=4, n_embd=32,
                              dropout=0.0))
    ids = torch.randint(0, 64, (2, 8))
    return m, {"idx": ids, "targets": ids}


MODELS = {
    "nanogpt": _nanogpt,
    "gpt2": lambda: _hf("GPT2Config", "GPT2LMHeadModel", n_embd=32, n_layer=2, n_head=4,
                        n_positions=16),
    "gpt_bigcode": lambda: _hf("GPTBigCodeConfig", "GPTBigCodeForCausalLM", n_embd=32,
                               n_layer=2, n_head=4, n_positions=16),
    "phi3": lambda: _hf("Phi3Config", "Phi3ForCausalLM", hidden_size=32, intermediate_size=64,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        max_position_embeddings=16, pad_token_id=0),
    "falcon_multi_query": lambda: _hf("FalconConfig", "FalconForCausalLM", hidden_size=32,
                                      num_hidden_layers=2, num_attention_heads=4),
    "falcon_grouped": lambda: _hf("FalconConfig", "FalconForCausalLM", hidden_size=32,
                                  num_hidden_layers=2, num_attention_heads=4,
                                  new_decoder_architecture=True, num_kv_heads=2),
    "gpt_neox": lambda: _hf("GPTNeoXConfig", "GPTNeoXForCausalLM", hidden_size=32,
                            intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                            max_position_embeddings=16),
}
# the fused parameter of each model and how many parts it becomes
FUSED = {"nanogpt": ("attn.c_attn.weight", 3), "gpt2": ("attn.c_attn.weight", 3),
         "gpt_bigcode": ("attn.c_attn.weight", 3), "phi3": ("mlp.gate_up_proj.weight", 2),
         "falcon_multi_query": ("self_attention.query_key_value.weight", 3),
         "falcon_grouped": ("self_attention.query_key_value.weight", 3),
         "gpt_neox": ("attention.query_key_value.weight", 3)}


def split_share(plan: dict, model: nn.Module) -> float:
    """Share of the block weights' elements (2-D or more, in a numbered block) plan.json
    places split; a part counts with its own elements."""
    shapes = {k: tuple(p.shape) for k, p in model.named_parameters()}
    parts = plan.get("param_parts", {})
    total = split = 0
    for key, place in plan["params"].items():
        source = parts[key]["source"] if key in parts else key
        if len(shapes[source]) < 2 or not re.search(r"\.\d+\.", source):
            continue
        n = math.prod(b - a for a, b in parts[key]["box"]) if key in parts \
            else math.prod(shapes[key])
        total += n
        split += n if place.startswith("S") else 0
    return split / total


@pytest.mark.parametrize("name", list(MODELS))
def test_tp_splits_fused_projections_and_matches_one_device(name, tmp_path):
    model, batch = MODELS[name]()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = nncompile.verify(model, batch, nncompile.ComputeConfig(2, 2), pas_policy="tp",
                                  gen_savedir=str(tmp_path))
    assert report.ok, report
    fused, k = FUSED[name]
    assert any(key.endswith(f".0.{fused}") for key in report.errors), report.errors  # compared
    out = next(tmp_path.glob("verify_*"))
    plan = json.loads((out / "plan.json").read_text())
    replicated = [str(w.message) for w in caught if "run replicated" in str(w.message)]
    assert not replicated, replicated[0]
    assert split_share(plan, model) >= 0.9, plan["params"]
    # Megatron's 2 forward all-reduces per block (after attention, after the MLP)
    assert plan["collectives"]["comm.all_reduce"] == 2 * 2, plan["collectives"]
    keys = [key for key, p in plan["param_parts"].items() if p["source"].endswith(
        f".0.{fused}")]
    assert len(keys) == k and all(key.endswith(f"[{i}/{k}]") for i, key in enumerate(keys))
    q = plan["params"][keys[0]]
    assert q.startswith("S"), (keys[0], q)       # q (or gate) split: by heads (or columns)
    code = (out / "gencode1.py").read_text()
    assert f"{fused}[1/{k}]" in code                 # the part's row, and a comment
    assert f"part 0 of {k} of " in code or f"parts [0/{k}]" in code
