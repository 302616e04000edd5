"""passes/fuse_attention.py: a constant causal mask becomes SDPA's is_causal=True, repeat_kv's
expand + reshape copies become enable_gqa=True, a padding mask (an input) and a narrow
sliding window stay; the generated module trains like the eager model, also under tp."""
import copy
import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import models
import nncompile
from nncompile import ComputeConfig
from nncompile.tools import inspection
from nncompile.frontend import trace
from nncompile.ir import run_graph, verify
from nncompile.passes import (build_pipeline, constant_fold, dce, fuse_attention, get_policy,
                              pass_name)
from nncompile.passes.fuse_attention import GQA_SUPPORTED, SDPA
from nncompile.tools.simulate import run_ranks

BATCH, SEQ = 4, 16


class HFMasked(nn.Module):
    """A causal LM called with an `attention_mask` input, returning its loss."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, labels):
        return self.model(input_ids=input_ids, attention_mask=attention_mask, labels=labels,
                          use_cache=False).loss


def _lm(kind: str, **kw) -> nn.Module:
    import transformers as tf
    common = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                  bos_token_id=0, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    if kind == "llama":
        return models.HFCausalLM(tf.LlamaForCausalLM(tf.LlamaConfig(**common, **kw)))
    if kind == "qwen2":
        return models.HFCausalLM(tf.Qwen2ForCausalLM(tf.Qwen2Config(**common, **kw)))
    if kind == "mistral":
        return models.HFCausalLM(tf.MistralForCausalLM(tf.MistralConfig(
            **common, **{"sliding_window": 64, **kw})))
    assert kind == "gpt2"
    return models.build("hf_gpt2")


def _batch(seed: int = 0) -> dict[str, torch.Tensor]:
    return models.batch("hf_llama", seed, BATCH, SEQ)


def _sdpa_lines(code: str) -> list[str]:
    return [ln for ln in code.splitlines() if "aten.scaled_dot_product_attention" in ln]


def _forward(code: str) -> str:
    return code.split("def forward_impl(")[1]


def _graph_after_pass(model, batch):
    g = dce(constant_fold(trace(model, batch)))
    out = fuse_attention(g)
    verify(out)
    return g, out


def _close(got, want, what):
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {m}")


def _eager(model, batch):
    ref = copy.deepcopy(model)
    loss = ref(**batch)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in ref.named_parameters()}


def _compiled(model, batch, path, name):
    pm = nncompile.parallelize(copy.deepcopy(model), batch, ComputeConfig(plan_ngpus=1),
                               pas_policy="dp", gen_savedir=path, instance_name=name)
    loss = pm(**batch)
    loss.backward()
    code = (path / name / "gencode0.py").read_text()
    plan = json.loads((path / name / "plan.json").read_text())
    return loss.detach(), pm.gather_grads(), code, plan


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral", "gpt2"])
def test_causal_lm_calls_sdpa_causal_without_mask_and_trains_like_eager(kind, tmp_path):
    model, batch = _lm(kind), _batch()
    gqa = kind != "gpt2" and GQA_SUPPORTED
    before, after = _graph_after_pass(model, batch)
    sdpas = [op for op in after.ops if op.target is SDPA]
    assert len(sdpas) == 2
    for op in sdpas:
        assert op.kwargs.get("is_causal") is True and len(op.args) == 3
        assert "attn_mask" not in op.kwargs
        assert op.kwargs.get("scale") is not None            # kept
        assert bool(op.kwargs.get("enable_gqa")) == gqa
        q, k = op.args[:2]
        assert k.meta.shape[1] == (2 if gqa else q.meta.shape[1])
    # the mask's constant ops are gone; the input graph is untouched
    assert not any(op.target_name == "aten.le.Tensor" for op in after.const_ops)
    assert any(isinstance(op.args[3] if len(op.args) > 3 else None, type(op.args[0]))
               for op in before.ops if op.target is SDPA)
    assert fuse_attention(after) is after or _same_calls(fuse_attention(after), after)
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    _close(run_graph(after, state, list(batch.values()))[0], model(**batch), "graph")

    want_loss, want_grads = _eager(model, batch)
    loss, grads, code, plan = _compiled(model, batch, tmp_path, kind)
    lines = _sdpa_lines(code)
    assert len(lines) == 2
    for ln in lines:
        call = ln.split("#")[0]
        assert "is_causal=True" in call and call.count(",") == 4 + gqa, call  # q, k, v + kw
        assert ("enable_gqa=True" in call) == gqa
    forward = _forward(code)
    if gqa:
        assert "aten.expand.default" not in forward, "repeat_kv copies left in the forward"
    assert "# attention: causal (is_causal=True, constant mask dropped)" in code
    assert [r["module"] for r in plan["attention"]] == [
        op.module_path for op in sdpas]
    assert all(r["form"].startswith("causal") for r in plan["attention"])
    assert ("GQA 4->2 heads (enable_gqa)" in plan["attention"][0]["form"]) == gqa
    shown = inspection.show(tmp_path / kind)
    assert f"  2 x {plan['attention'][0]['form']}: {sdpas[0].module_path}, " in shown, shown
    _close(loss, want_loss, "loss")
    for name, g in want_grads.items():
        _close(grads[name], g, name)


def _same_calls(a, b):
    ca = [(op.target_name, len(op.args), sorted(op.kwargs)) for op in a.ops]
    cb = [(op.target_name, len(op.args), sorted(op.kwargs)) for op in b.ops]
    return ca == cb and len(a.const_ops) == len(b.const_ops)


def test_padding_mask_input_is_kept(tmp_path):
    model = HFMasked(_lm("llama").model)
    batch = _batch()
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, :5] = 0                                # left padding
    mask[2, -3:] = 0                               # right padding
    batch = {"input_ids": batch["input_ids"], "attention_mask": mask, "labels": batch["labels"]}
    _, after = _graph_after_pass(model, batch)
    for op in (op for op in after.ops if op.target is SDPA):
        assert not op.kwargs.get("is_causal")
        assert "attention_mask" in op.attrs["attention"], op.attrs["attention"]
    want_loss, want_grads = _eager(model, batch)
    loss, grads, code, plan = _compiled(model, batch, tmp_path, "padded")
    for ln in _sdpa_lines(code):
        assert "is_causal" not in ln.split("#")[0]
    assert all(r["form"].startswith("masked: mask depends on input 'attention_mask'")
               for r in plan["attention"])
    _close(loss, want_loss, "loss")
    for name, g in want_grads.items():
        _close(grads[name], g, name)


def test_narrow_sliding_window_keeps_its_mask(tmp_path):
    model = _lm("mistral", sliding_window=6)
    batch = _batch()
    _, after = _graph_after_pass(model, batch)
    forms = [op.attrs["attention"] for op in after.ops if op.target is SDPA]
    assert forms and all(f.startswith(f"masked: sliding window 6 < sequence {SEQ}")
                         for f in forms), forms
    want_loss, want_grads = _eager(model, batch)
    loss, grads, code, _ = _compiled(model, batch, tmp_path, "window")
    assert all("is_causal" not in ln.split("#")[0] for ln in _sdpa_lines(code))
    _close(loss, want_loss, "loss")
    for name, g in want_grads.items():
        _close(grads[name], g, name)


def test_tp_splits_grouped_heads_and_matches_eager(tmp_path):
    model, batch = _lm("llama"), _batch()
    want_loss, want_grads = _eager(model, batch)
    copies = [copy.deepcopy(model) for _ in range(2)]

    def rank_fn(rank):
        pm = nncompile.parallelize(copies[rank], batch, ComputeConfig(2, 2), pas_policy="tp",
                                   gen_savedir=tmp_path, instance_name="tp")
        loss = pm(**batch)
        loss.backward()
        return loss.detach(), pm.gather_grads()

    results = run_ranks(2, rank_fn)
    code = (tmp_path / "tp" / "gencode0.py").read_text()
    plan = json.loads((tmp_path / "tp" / "plan.json").read_text())
    sdpa = [o for o in plan["ops"] if o["op"] == "aten.scaled_dot_product_attention.default"]
    assert sdpa and all(o["strategy"].startswith("split heads") for o in sdpa), sdpa
    for ln in _sdpa_lines(code):
        call, meta = ln.split("#")[0], ln.split("#")[1]
        assert "is_causal=True" in call and ("enable_gqa=True" in call) == GQA_SUPPORTED
        assert "f32[4, 2, 16, 8]" in meta, meta                   # 2 of the 4 q heads
    for loss, grads in results:
        _close(loss, want_loss, "loss")
        for name, g in want_grads.items():
            _close(grads[name], g, name)


# ---- Before / Expected on a hand-written module -------------------------------------------
class TinyAttention(nn.Module):
    """Causal mask from torch.tril(ones) in forward; repeat_kv by unsqueeze/expand/reshape."""

    def __init__(self, d=16, heads=4, kv_heads=2):
        super().__init__()
        self.h, self.kv, self.hd = heads, kv_heads, d // heads
        self.q = nn.Linear(d, d, bias=False)
        self.k = nn.Linear(d, kv_heads * self.hd, bias=False)
        self.v = nn.Linear(d, kv_heads * self.hd, bias=False)

    def qkv(self, x):
        """q, and k, v repeated to q's heads (repeat_kv's unsqueeze/expand/reshape)."""
        B, T, _ = x.shape
        q = self.q(x).view(B, T, self.h, self.hd).transpose(1, 2)
        k = self.k(x).view(B, T, self.kv, self.hd).transpose(1, 2)
        v = self.v(x).view(B, T, self.kv, self.hd).transpose(1, 2)
        r = self.h // self.kv
        k = k[:, :, None].expand(B, self.kv, r, T, self.hd).reshape(B, self.h, T, self.hd)
        v = v[:, :, None].expand(B, self.kv, r, T, self.hd).reshape(B, self.h, T, self.hd)
        return q, k, v

    def forward(self, x):
        T = x.shape[1]
        mask = torch.tril(torch.ones(T, T, dtype=torch.bool))
        out = F.scaled_dot_product_attention(*self.qkv(x), attn_mask=mask, scale=0.3)
        return out.sum()


def _calls(g):
    return [op.target_name.split(".")[1] for op in g.ops]


def test_before_expected_on_a_tiny_module():
    model, x = TinyAttention(), torch.randn(2, 8, 16)
    g = dce(constant_fold(trace(model, (x,))))
    before = _calls(g)
    assert before.count("expand") == 2 and "scaled_dot_product_attention" in before
    sdpa = next(op for op in g.ops if op.target is SDPA)
    assert sdpa.args[3].producer in g.const_ops            # the mask is a constant
    out = fuse_attention(g)
    verify(out)
    expected = [c for c in before if c not in ("unsqueeze", "expand")]
    if GQA_SUPPORTED:       # the two reshapes after the expands go too
        expected = [c for i, c in enumerate(before)
                    if c not in ("unsqueeze", "expand")
                    and not (c in ("reshape", "view") and i > 0
                             and before[i - 1] == "expand")]
    assert _calls(out) == expected, (_calls(out), expected)
    op = next(op for op in out.ops if op.target is SDPA)
    assert op.args[1].meta.shape == (2, 2, 8, 4) if GQA_SUPPORTED else True
    assert op.kwargs == {"is_causal": True, "scale": 0.3,
                         **({"enable_gqa": True} if GQA_SUPPORTED else {})}
    assert out.const_ops == [] and len(g.const_ops) >= 1       # the mask's ops removed
    assert op.attrs["attention"] == "causal (is_causal=True, constant mask dropped)" + (
        ", GQA 4->2 heads (enable_gqa)" if GQA_SUPPORTED else "")
    # the input graph is unchanged; a second run changes nothing
    assert sdpa.args[3] is not None and "is_causal" not in sdpa.kwargs
    again = fuse_attention(out)
    assert _calls(again) == _calls(out)
    assert next(o for o in again.ops if o.target is SDPA).attrs == op.attrs
    state = dict(model.named_parameters())
    _close(run_graph(out, state, [x])[0], model(x), "value")


def test_a_mask_from_a_buffer_or_not_causal_stays():
    class Buffered(TinyAttention):
        def __init__(self):
            super().__init__(kv_heads=4)
            self.register_buffer("mask", torch.ones(8, 8, dtype=torch.bool).tril())

        def forward(self, x):
            B, T, _ = x.shape
            q = self.q(x).view(B, T, self.h, self.hd).transpose(1, 2)
            a = F.scaled_dot_product_attention(q, q, q, attn_mask=self.mask)
            b = F.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(
                T, T, dtype=torch.bool).triu())
            c = F.scaled_dot_product_attention(q, q, q, attn_mask=torch.zeros(T, T).masked_fill(
                torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf")))
            return (a + b + c).sum()

    model, x = Buffered(), torch.randn(2, 8, 16)
    out = fuse_attention(dce(constant_fold(trace(model, (x,)))))
    forms = [op.attrs["attention"] for op in out.ops if op.target is SDPA]
    assert forms == ["masked: mask depends on buffer 'mask'",
                     "masked: constant mask that is not causal",
                     "causal (is_causal=True, constant mask dropped)"], forms


def test_the_pipeline_runs_the_pass_after_dce():
    names = [pass_name(p) for p in
             build_pipeline(ComputeConfig(plan_ngpus=2), get_policy("tp"))]
    assert names[names.index("dce") + 1] == "fuse_attention"


def test_kv_heads_that_do_not_split_over_the_plan_keep_their_copies():
    """Llama with 2 k/v heads at plan 4: tp splits the 4 q heads over 4 ranks, which only the
    repeated k/v can follow; the mask still goes."""
    model, batch = _lm("llama"), _batch()
    g = dce(constant_fold(trace(model, batch)))
    fused = next(p for p in build_pipeline(ComputeConfig(4, 4), get_policy("tp"))
                 if pass_name(p) == "fuse_attention")(g)
    verify(fused)
    for op in (op for op in fused.ops if op.target is SDPA):
        assert op.kwargs.get("is_causal") is True and not op.kwargs.get("enable_gqa")
        assert op.args[1].meta.shape[1] == 4
        assert op.attrs["attention"] == (
            "causal (is_causal=True, constant mask dropped), GQA 4->2 heads kept repeated: "
            "2 k/v heads do not split over plan_ngpus=4") or not GQA_SUPPORTED
    assert [op.target_name for op in fused.ops].count("aten.expand.default") == 4


class TinyDropout(TinyAttention):
    def forward(self, x):
        T = x.shape[1]
        mask = torch.zeros(T, T).masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1),
                                             torch.finfo(torch.float32).min)
        p = 0.25 if self.training else 0.0
        out = F.scaled_dot_product_attention(*self.qkv(x), attn_mask=mask, dropout_p=p,
                                             scale=0.3)
        return out.square().mean()


def test_attention_dropout_and_scale_are_kept_and_match_eager(tmp_path):
    """A float mask of 0 / finfo.min is causal too; dropout_p (a mode argument) and scale stay,
    and the generated module draws the same dropout as the eager model."""
    model, x = TinyDropout(), torch.randn(2, 8, 16)
    pm = nncompile.parallelize(copy.deepcopy(model), (x,), ComputeConfig(plan_ngpus=1),
                               pas_policy="dp", gen_savedir=tmp_path, instance_name="drop")
    line, = _sdpa_lines((tmp_path / "drop" / "gencode0.py").read_text())
    call = line.split("#")[0]
    assert "is_causal=True" in call and "scale=0.3" in call and "0.25" in call, call
    assert ("enable_gqa=True" in call) == GQA_SUPPORTED
    form = json.loads((tmp_path / "drop" / "plan.json").read_text())["attention"][0]["form"]
    assert form.startswith("causal (is_causal=True, constant mask dropped)"), form
    assert form.endswith("dropout_p 0.25 in training"), form
    ref = copy.deepcopy(model)
    losses = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        want = ref(x)
        torch.manual_seed(seed)
        losses.append(pm(x))
        _close(losses[-1], want, f"loss, seed {seed}")
    assert not torch.equal(losses[0], losses[1])             # dropout does draw
    pm.eval()
    ref.eval()
    _close(pm(x), ref(x), "eval loss")


def test_cost_model_counts_causal_attention_as_half_the_work():
    """is_causal=True given by the model (traced positionally) or set by the pass (by name):
    half the flops of the masked attention it replaces."""
    from nncompile.passes.autodist.cost_model import flops

    class Causal(nn.Module):
        def forward(self, q):
            return F.scaled_dot_product_attention(q, q, q, is_causal=True).sum()

    q = torch.randn(2, 4, 8, 4)
    masked = dce(constant_fold(trace(TinyAttention(), (torch.randn(2, 8, 16),))))
    fused = fuse_attention(masked)
    positional = trace(Causal(), (q,))

    def sdpa_flops(g):
        return next(flops(op) for op in g.ops if op.target is SDPA)
    full = 4.0 * 2 * 4 * 8 * 4 * 8                       # 4 * numel(q) * S
    assert sdpa_flops(masked) == full
    assert sdpa_flops(fused) == full / 2
    assert sdpa_flops(positional) == full / 2


class _Masks(nn.Module):
    """Attention under constant masks built like the models build theirs: key and query
    positions compared and and-ed (causal, a window, packed documents, full, keys before a
    fixed point, a shifted diagonal), plus two that are not one key interval per row."""

    def __init__(self):
        super().__init__()
        self.q = nn.Linear(8, 8)

    def forward(self, x):
        T = x.shape[1]
        q = self.q(x).unsqueeze(1)
        pos = torch.arange(T)
        kv, qi = pos[None, None, None, :], pos[None, None, :, None]
        doc = (torch.arange(T) >= T // 2).long().cumsum(0) * 0 + (torch.arange(T) >= T // 2)
        masks = [kv <= qi,                                            # causal
                 (kv <= qi) & (kv > qi - 5),                          # window 5
                 (kv <= qi) & (doc[None, None, None, :] == doc[None, None, :, None]),
                 torch.ones(1, 1, T, T, dtype=torch.bool),            # full
                 (kv < 7) & torch.ones(1, 1, T, 1, dtype=torch.bool),
                 kv <= qi + 1,                                        # one key ahead
                 (kv <= qi) | (kv == T - 1),                          # an `or`: two runs
                 kv != qi]                                            # not an interval
        return sum(F.scaled_dot_product_attention(q, q, q, attn_mask=m).sum() for m in masks)


@pytest.mark.parametrize("model, inputs", [
    ("masks", None), ("llama", None), ("mistral", {"sliding_window": 6}), ("qwen2", None)])
def test_key_intervals_give_the_verdict_of_the_whole_mask(model, inputs, monkeypatch):
    """passes/mask_intervals.py (how masks too large to evaluate are judged) gives every mask
    the verdict evaluating it whole gives."""
    import sys
    from nncompile.passes import mask_intervals
    fa_module = sys.modules["nncompile.passes.fuse_attention"]
    judged = []
    monkeypatch.setattr(fa_module, "mask_rows", lambda *a: judged.append(
        mask_intervals.mask_rows(*a)) or judged[-1])
    if model == "masks":
        m, args = _Masks(), (torch.randn(2, 24, 8),)
    else:
        m, args = _lm(model, **(inputs or {})), _batch()
    g = dce(constant_fold(trace(m, args)))

    def forms(small):
        monkeypatch.setattr(mask_intervals, "SMALL", small)
        return [op.attrs["attention"] for op in fuse_attention(g).ops if op.target is SDPA]

    whole, rows = forms(1 << 40), forms(0)
    assert whole == rows
    intervals = [r is not None for r in judged[len(judged) // 2:]]
    assert intervals == ([True] * 6 + [False] * 2 if model == "masks" else [True])
    if model == "masks":
        assert [f.split(",")[0] for f in rows] == [
            "causal (is_causal=True", "masked: sliding window 5 < sequence 24",
            "masked: constant mask that is not causal",
            "full (constant all-attending mask dropped)",
            "masked: constant mask that is not causal", "masked: constant mask that is not causal",
            "masked: constant mask that is not causal", "masked: constant mask that is not causal"]


def test_a_long_sequence_mask_is_judged_without_building_it():
    """At 65536 tokens (a 4 G-element mask) a Hugging Face Llama's traced causal mask still
    becomes is_causal=True, from its key intervals: no tensor of more than 2**22 elements is
    computed."""
    import transformers as tf
    from nncompile.ir import interpret
    with torch.device("meta"):
        m = models.HFCausalLM(tf.LlamaForCausalLM(tf.LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=65536)))
    ids = torch.zeros(1, 65536, dtype=torch.long)
    g = dce(constant_fold(trace(m, {"input_ids": ids, "labels": ids})))
    largest = []
    run = interpret.run_ops

    def recorded(ops, env):
        run(ops, env)
        largest.extend(v.meta.numel for op in ops for v in op.outputs if v.meta is not None)
    import sys
    with pytest.MonkeyPatch.context() as mp:
        for module in ("mask_intervals", "fuse_attention"):
            mp.setattr(sys.modules[f"nncompile.passes.{module}"], "run_ops", recorded)
        out = fuse_attention(g)
    forms = [op.attrs["attention"] for op in out.ops if op.target is SDPA]
    assert len(forms) == 2 and all(f.startswith("causal (is_causal=True") for f in forms)
    assert not any(len(v.meta.shape) == 4 and v.meta.shape[-1] == 65536 == v.meta.shape[-2]
                   for v in out.consts)
    assert largest and max(largest) <= 1 << 22
