"""`tp` keeps attention split by heads through the ops third-party model files put between
their projections: the complex rotary of Meta's and torchtitan's Llama (view_as_complex, a
complex product with freqs_cis, view_as_real), a head reshape with -1 (DeBERTa-v2's
`view(B, T, heads, -1)`), and SDPA with a per-head additive bias as attn_mask (Swin's relative
position bias: a learned table indexed by relative positions, alone or plus a per-window mask).
Each tiny model at plan 2: q/k/v column-split, o row-split, no "run replicated" warning, two
all-reduces per block, and two simulated ranks equal one device."""
import copy
import json
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import nncompile
from nncompile import ComputeConfig
from nncompile.ir import Replicate, Shard
from nncompile.tools.rule_check import _forward_backward, _trace_cases, check_rules
from nncompile.tools.rule_samples import samples
from nncompile.rules import RULES
from nncompile.rules.registry import make
from nncompile.tools.simulate import run_ranks

D, HEADS, SEQ, BATCH = 32, 4, 8, 2


def rotary_table(head_dim: int, positions: int) -> torch.Tensor:
    """freqs_cis: one unit complex number per (position, pair of channels)."""
    inv = 1.0 / 10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.outer(torch.arange(positions).float(), inv)
    return torch.polar(torch.ones_like(angles), angles)


def complex_rotary(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """x [B, T, H, hd]: channel pairs as complex numbers, rotated by freqs [T, hd/2]."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    freqs = freqs.view(1, x.shape[1], 1, pairs.shape[-1])
    return torch.view_as_real(pairs * freqs).flatten(3).type_as(x)


class RotaryAttention(nn.Module):
    """torchtitan-style attention: q/k/v views with -1 heads, complex rotary, causal SDPA."""

    def __init__(self, d=D, heads=HEADS, seq=SEQ):
        super().__init__()
        self.hd = d // heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.register_buffer("freqs_cis", rotary_table(self.hd, 2 * seq))

    def forward(self, x):
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, -1, self.hd)
        k = self.wk(x).view(b, t, -1, self.hd)
        v = self.wv(x).view(b, t, -1, self.hd)
        freqs = self.freqs_cis[:t]
        q, k = complex_rotary(q, freqs), complex_rotary(k, freqs)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(b, t, -1))


class AttributeRotaryAttention(RotaryAttention):
    """Meta's reference Llama keeps freqs_cis as a plain tensor attribute (a traced constant),
    not a buffer."""

    def __init__(self):
        super().__init__()
        table = self.freqs_cis
        del self.freqs_cis
        self.freqs_cis = table


class HeadViewAttention(nn.Module):
    """DeBERTa-v2's head reshape: `view(B, T, heads, -1)`, then permute."""

    def __init__(self, d=D, heads=HEADS):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (lin(x).view(b, t, self.heads, -1).permute(0, 2, 1, 3)
                   for lin in (self.q, self.k, self.v))
        att = (q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5).softmax(-1)
        return self.o((att @ v).permute(0, 2, 1, 3).reshape(b, t, -1))


class WindowAttention(nn.Module):
    """Swin-style attention over windows of W tokens: a learned relative position bias table
    [2W-1, heads] indexed by a buffer of relative positions, [1, H, W, W] as SDPA's attn_mask;
    `shifted` adds a fixed per-window mask [nW, 1, W, W] ([nW, H, W, W], q 5-D)."""

    def __init__(self, d=D, heads=HEADS, window=SEQ // 2, shifted=False):
        super().__init__()
        self.heads, self.window, self.shifted = heads, window, shifted
        self.qkv = nn.ModuleList(nn.Linear(d, d) for _ in range(3))
        self.proj = nn.Linear(d, d)
        self.bias_table = nn.Parameter(torch.randn(2 * window - 1, heads) * 0.5)
        pos = torch.arange(window)
        self.register_buffer("rel_index", pos[:, None] - pos[None, :] + window - 1)
        windows = SEQ // window
        mask = torch.zeros(windows, window, window)
        mask[-1, : window // 2, window // 2:] = -100.0        # the wrapped-around window
        self.register_buffer("window_mask", mask)

    def forward(self, x):
        b, t, c = x.shape
        nw, w = t // self.window, self.window
        bias = self.bias_table[self.rel_index.view(-1)].view(w, w, -1)
        bias = bias.permute(2, 0, 1).contiguous().unsqueeze(0)             # [1, H, W, W]
        if self.shifted:
            q, k, v = (lin(x).view(b, nw, w, self.heads, -1).transpose(2, 3)
                       for lin in self.qkv)                                 # [B, nW, H, W, hd]
            mask = bias + self.window_mask.unsqueeze(1)                    # [nW, H, W, W]
        else:
            q, k, v = (lin(x).view(b * nw, w, self.heads, -1).transpose(1, 2)
                       for lin in self.qkv)                                 # [B*nW, H, W, hd]
            mask = bias
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.proj(o.transpose(-3, -2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, attn: nn.Module):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.attn = attn
        self.fc, self.out = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.out(F.gelu(self.fc(self.norm2(x))))


class Net(nn.Module):
    def __init__(self, make_attn, blocks=2):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(Block(make_attn()) for _ in range(blocks))
        self.norm = nn.LayerNorm(D)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return (self.norm(x) ** 2).mean()


MODELS = {
    "complex_rotary": lambda: Net(RotaryAttention),
    "complex_rotary_attribute": lambda: Net(AttributeRotaryAttention),
    "view_minus_one": lambda: Net(HeadViewAttention),
    "relative_bias": lambda: Net(WindowAttention),
    "shifted_windows": lambda: Net(lambda: WindowAttention(shifted=True)),
}
# per attention: q, k, v (column: weight rows split) and the output projection (row)
ATTN = {"complex_rotary": ("wq", "wk", "wv", "wo"),
        "complex_rotary_attribute": ("wq", "wk", "wv", "wo"),
        "view_minus_one": ("q", "k", "v", "o"),
        "relative_bias": ("qkv.0", "qkv.1", "qkv.2", "proj"),
        "shifted_windows": ("qkv.0", "qkv.1", "qkv.2", "proj")}


def _close(got, want, what):
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("kind", list(MODELS))
def test_tp_splits_attention_and_matches_one_device(kind, tmp_path):
    model = MODELS[kind]()
    x = torch.randn(BATCH, SEQ, D, generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = nncompile.parallelize(model, (x,), ComputeConfig(2, 2), pas_policy="tp",
                                    gen_savedir=tmp_path, instance_name=kind,
                                    load_module=False)
    replicated = [str(w.message) for w in caught if "replicated" in str(w.message)]
    assert not replicated, replicated[0]
    plan = json.loads((out / "plan.json").read_text())
    q, k, v, o = ATTN[kind]
    for i in range(2):
        got = {name: plan["params"][f"layers.{i}.attn.{name}.weight"] for name in (q, k, v, o)}
        assert got == {q: "S(0)", k: "S(0)", v: "S(0)", o: "S(1)"}, (kind, got)
    if kind in ("relative_bias", "shifted_windows"):          # the bias table: heads split
        assert plan["params"]["layers.0.attn.bias_table"] == "S(1)", plan["params"]
    assert plan["collectives"].get("comm.all_reduce") == 2 * 2, plan["collectives"]

    ref = copy.deepcopy(model)
    want = ref(x)
    want.backward()
    copies = [copy.deepcopy(model) for _ in range(2)]

    def rank_fn(rank):
        pm = nncompile.parallelize(copies[rank], (x,), ComputeConfig(2, 2), pas_policy="tp",
                                   gen_savedir=tmp_path, instance_name=kind)
        loss = pm(x)
        loss.backward()
        return loss.detach(), pm.gather_grads()

    for loss, grads in run_ranks(2, rank_fn):
        _close(loss, want.detach(), "loss")
        for name, p in ref.named_parameters():
            _close(grads[name], p.grad, name)


def test_a_small_complex_constant_prints_and_parses_back():
    """freqs_cis kept as a plain attribute is inlined as a literal (<= 64 elements): complex
    numbers print as complex(re, im) and read back."""
    from nncompile.frontend import trace
    from nncompile.ir import assert_graph_equal, parse_graph, print_graph
    g = trace(MODELS["complex_rotary_attribute"](), (torch.randn(BATCH, SEQ, D),))
    text = print_graph(g)
    assert "complex(1.0, 0.0)" in text
    back = parse_graph(text)
    assert_graph_equal(g, back)
    assert print_graph(back) == text


# ---- the rules themselves, through the op-rule checker (nncompile/tools/rule_check.py) ----------
HEAD_RULES = ["view_as_complex", "view_as_real", "index.Tensor", "mul", "view",
              "scaled_dot_product_attention"]


@pytest.fixture(scope="module")
def head_cases():
    """The hand-written samples (nncompile/tools/rule_samples.py) of each rule, traced."""
    g = torch.Generator().manual_seed(0)
    return {rule: [c for fn, args in samples(rule, g)
                   for c in _trace_cases(rule, "hand", fn, args, {})] for rule in HEAD_RULES}


def test_head_rules_are_checked_with_complex_gradients(head_cases):
    report = check_rules(HEAD_RULES, cases=[c for cs in head_cases.values() for c in cs])
    assert report.ok, str(report)
    for rule in ("view_as_complex", "view_as_real", "index.Tensor"):
        assert {n for n, _ in report.checked[rule]} == {2, 4}, report.checked[rule]
    # complex values take part in backward: view_as_real's input gradient is complex
    case = head_cases["view_as_real"][0]
    _, grads = _forward_backward(case.op, False, [x.clone() for x in case.values],
                                 [torch.randn(case.op.outputs[0].meta.shape,
                                              dtype=torch.float64)])
    assert grads[0] is not None and grads[0].is_complex()
    complex_mul = [c for c in head_cases["mul"] if c.values[0].is_complex()]
    report = check_rules(["mul"], cases=complex_mul)
    assert complex_mul and report.ok and {n for n, _ in report.checked["mul"]} == {2, 4}


def _wrong(rule_cases, rule, fn, monkeypatch):
    monkeypatch.setitem(RULES, rule, fn)
    report = check_rules([rule], cases=rule_cases)
    assert not report.ok
    return report


def test_a_rotary_rule_that_moves_the_split_is_caught(head_cases, monkeypatch):
    # view_as_real said to carry a split of dim 0 onto the new (real, imaginary) dim
    def moved(op, n):
        x = op.args[0]
        last = len(op.outputs[0].meta.shape) - 1
        return [make(op, {x: Shard(0)}, [Shard(last)], "split dim 0 -> pair")] \
            if x.meta.shape[0] % n == 0 else []
    report = _wrong(head_cases["view_as_real"], "view_as_real", moved, monkeypatch)
    assert any("view_as_real [split dim 0 -> pair]" in f for f in report.failures), report


def test_splitting_the_indexed_dim_of_a_bias_table_is_caught(head_cases, monkeypatch):
    # table[positions] with the table's rows split: each rank only holds some positions
    def rows(op, n):
        x = op.args[0]
        return [make(op, {x: Shard(0)}, [Shard(0)], "split indexed dim")] \
            if x.meta.shape[0] % n == 0 and op.args[1][0] is not None else []
    report = _wrong(head_cases["index.Tensor"], "index.Tensor", rows, monkeypatch)
    assert any("index.Tensor [split indexed dim]" in f for f in report.failures), report


def test_a_per_head_mask_left_whole_is_caught(head_cases, monkeypatch):
    # q/k/v split by heads while a per-head bias [1, H, L, S] stays whole on every rank
    cases = [c for c in head_cases["scaled_dot_product_attention"]
             if len(c.values) > 3 and c.values[3].shape[-3] > 1]
    assert len(cases) >= 3                  # additive [1, H], boolean [B, H], windows [nW, H]

    def whole_mask(op, n):
        q, k, v, mask = op.args[:4]
        d = len(q.meta.shape) - 3
        return [make(op, {q: Shard(d), k: Shard(d), v: Shard(d), mask: Replicate()},
                     [Shard(d)], "split heads, mask whole")]
    report = _wrong(cases, "scaled_dot_product_attention", whole_mask, monkeypatch)
    assert any("split heads, mask whole" in f for f in report.failures), report
