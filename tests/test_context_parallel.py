"""Context parallelism (parallel.cp): the sequence split along the cp mesh
axis equals one device on Hugging Face causal LMs (GQA, rotary, labels=input_ids, a padding
mask), alone and with tensor parallelism; the training loop with data parallelism is in the
conformance suite (cells cp_dp, cp_tp)."""
import copy
import json

import pytest
import torch
from torch import nn

import nncompile
from nncompile import ComputeConfig
from nncompile.errors import ConfigError

transformers = pytest.importorskip("transformers")


class CausalLM(nn.Module):
    """A training script's call: labels=input_ids (the model shifts them), a padding mask."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids, attention_mask=None):
        return self.lm(input_ids=input_ids, attention_mask=attention_mask,
                       labels=input_ids).loss


def hf(arch: str) -> nn.Module:
    torch.manual_seed(0)
    common = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  attn_implementation="sdpa")
    cfg, cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}[arch]
    return CausalLM(cls(cfg(**common))).train()


def batch(seq: int, padded: bool = False) -> dict:
    g = torch.Generator().manual_seed(seq)
    out = {"input_ids": torch.randint(0, 64, (2, seq), generator=g)}
    if padded:                       # the second row's last quarter is padding
        mask = torch.ones(2, seq, dtype=torch.long)
        mask[1, -seq // 4:] = 0
        out["attention_mask"] = mask
    return out


@pytest.mark.parametrize("arch, seq, plan, padded, order", [
    ("llama", 64, 2, False, "zigzag"), ("qwen2", 128, 2, False, "zigzag"),
    ("llama", 64, 4, False, "zigzag"), ("qwen2", 64, 4, True, "zigzag"),
    ("llama", 256, 2, True, "zigzag"), ("llama", 64, 2, True, "contiguous"),
    ("qwen2", 64, 4, False, "contiguous")])
def test_sequence_split_equals_one_device(arch, seq, plan, padded, order, tmp_path):
    """cp 2 alone (plan 2) or with tp 2 (plan 4), in the zigzag (default) or contiguous
    order: loss and every gradient (verify: rtol 1e-5)."""
    cfg = ComputeConfig(plan, plan, parallel={"cp": 2,
                                                "cp_order": order})
    report = nncompile.verify(hf(arch), batch(seq, padded), cfg, "tp",
                              gen_savedir=str(tmp_path))
    assert report.ok, str(report)
    code = next(tmp_path.rglob("gencode0.py")).read_text()
    assert "CP_GROUP = self.axis_group('cp')" in code
    assert code.count("comm.attention_rows(") == 2                # one per layer
    assert "comm.cross_entropy_rows(" in code and "group=CP_GROUP" in code


def test_the_plan_splits_the_sequence_and_gathers_only_keys_and_values(tmp_path):
    out = nncompile.parallelize(hf("llama"), batch(64), ComputeConfig(2, 2, parallel={
        "cp": 2}), pas_policy="tp", gen_savedir=str(tmp_path),
        load_module=False)
    plan = json.loads((out / "plan.json").read_text())
    cp = [r for r in plan["collective_ops"] if r.get("axis") == "cp"]
    gathers = [r for r in cp if r["kind"] == "all_gather"]     # k and v of each layer
    assert len(gathers) == 2 * 2
    # every rank's gradient of the gathered k and v is partial (its own query rows): summed
    # over cp, by the gather's backward (reduce_scatter) or a sync_grad after the key cache's
    # cat (the default use_cache) and before attention
    summed = [r for r in gathers if r["backward"] == "reduce_scatter"] + \
        [r for r in cp if r["kind"] == "sync_grad"]
    assert len(summed) == 2 * 2, cp
    assert not [r for r in plan["collective_ops"] if r.get("axis") != "cp"]   # no tp: plan 1
    code = (out / "gencode0.py").read_text()
    # the zigzag order (the default): rank r holds chunks r and 3 - r of 4
    assert "input_ids_chunk = comm.chunk(input_ids, dim=1, zigzag=True, group=CP_GROUP)" in code
    assert "zigzag=True" in code[code.index("comm.attention_rows("):][:400]
    assert "MESH_AXES = {'cp': 2}" in code and "PARTIAL_GRAD_AXES = {'cp': [" in code
    assert "# nncompile IR: plan_ngpus=1 axes=cp:2" in \
        sorted((out / "graphs").glob("*.py"))[-1].read_text()


@pytest.mark.parametrize("pas, match", [
    ({"cp": 3}, r"divides plan_ngpus=2: one of \[1, 2\]"),
    ({"cp": 2, "pp": 2}, "leaves 1 per stage"),
    ({"cp": "auto", "pp": 2}, "'auto' does not combine"),
    ({"cp": 2, "cp_attention": "ring"}, "'allgather'"),
    ({"cp": 2, "cp_attention": "ulysses",
      "cp_order": "zigzag"}, "the only order 'ulysses' runs"),
])
def test_bad_context_parallel_is_refused(pas, match):
    with pytest.raises(ConfigError, match=match):
        ComputeConfig(2, 2, parallel=pas)


def test_a_sequence_that_does_not_split_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="multiple of 4"):
        nncompile.parallelize(hf("llama"), batch(62), ComputeConfig(2, 2, parallel={
            "cp": 2}), pas_policy="tp", gen_savedir=str(tmp_path),
            load_module=False)


@pytest.mark.parametrize("padded", [False, True])
def test_ulysses_all_to_all_equals_one_device(padded, tmp_path):
    """context_parallel_attention='ulysses': attention on C-th of the heads over the whole
    sequence (all-to-all from sequence to heads and back)."""
    cfg = ComputeConfig(2, 2, parallel={"cp": 2,
                                          "cp_attention": "ulysses"})
    report = nncompile.verify(hf("llama"), batch(64, padded), cfg, "tp",
                              gen_savedir=str(tmp_path))
    assert report.ok, str(report)
    code = next(tmp_path.rglob("gencode0.py")).read_text()
    assert "comm.attention_rows(" not in code
    assert code.count("comm.all_to_all(") >= 2 * 2 and "group=CP_GROUP" in code


@pytest.mark.parametrize("ranks, zigzag", [(2, False), (4, False), (2, True), (4, True)])
def test_causal_rows_are_exact_blocks_merged_by_their_lse(ranks, zigzag, monkeypatch):
    """comm.attention_rows on each rank's rows (float64, GQA; contiguous, or the zigzag order:
    chunks r and 2C-1-r of 2C): outputs and the gradients of q, k and v summed over the ranks
    equal one causal attention, without a mask."""
    from nncompile.runtime.program import comm
    torch.manual_seed(0)
    q = torch.randn(2, 4, 32, 8, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 2, 32, 8, dtype=torch.float64, requires_grad=True) for _ in "kv")
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                           enable_gqa=True)
    grad = torch.randn_like(ref)
    want = torch.autograd.grad(ref, (q, k, v), grad)
    monkeypatch.setattr(comm, "_size", lambda group: ranks)
    chunk = 32 // (2 * ranks)
    out, dq, dk, dv = torch.zeros_like(ref), torch.zeros_like(q), 0, 0
    for r in range(ranks):
        monkeypatch.setattr(comm, "_rank", lambda group, r=r: r)
        blocks = [2 * r, 2 * r + 1] if not zigzag else [r, 2 * ranks - 1 - r]
        rows = [i for b in blocks for i in range(b * chunk, (b + 1) * chunk)]
        qr = q[:, :, rows].detach().requires_grad_()
        kr, vr = k.detach().requires_grad_(), v.detach().requires_grad_()
        o = comm.attention_rows(qr, kr, vr, is_causal=True, enable_gqa=True, group="cp",
                                zigzag=zigzag)
        assert "CausalRows" in str(o.grad_fn) or "Cat" in str(o.grad_fn)   # no mask
        a, b, c = torch.autograd.grad(o, (qr, kr, vr), grad[:, :, rows])
        out[:, :, rows], dq[:, :, rows] = o.detach(), a
        dk, dv = dk + b, dv + c
    for x, y in zip((out, dq, dk, dv), (ref,) + want):
        assert (x - y).abs().max() < 1e-12


@pytest.mark.parametrize("arch, attention", [("llama", "allgather"), ("qwen2", "ulysses")])
def test_cp_times_data_parallel_on_four_ranks(arch, attention, tmp_path):
    """cp 2 x dp 2 (4 threaded ranks, a process group each): loss and every gradient after the
    runtime's reduction over cp and dp equal one device, with a padding mask."""
    from nncompile.tools.simulate import run_ranks
    model, data = hf(arch), batch(64, padded=True)
    cfg = ComputeConfig(2, 4, parallel={"cp": 2,
                                          "cp_attention": attention})
    reports = run_ranks(4, lambda rank: nncompile.verify(model, data, cfg, "tp",
                                                         gen_savedir=str(tmp_path)))
    assert all(r.ok for r in reports), "\n".join(map(str, reports))
    code = next(tmp_path.rglob("gencode3.py")).read_text()
    assert "CP_GROUP = self.axis_group('cp')" in code and "rank 3 of 4" in code


def test_autodist_chooses_the_context_parallel_size(tmp_path):
    """context_parallel='auto' (autodist): every C dividing plan_ngpus is planned, priced with
    its sequence split, and the fastest that fits is kept; plan.json says why; the program
    then runs at that C (here checked against one device)."""
    cfg = ComputeConfig(2, 2, parallel={"cp": "auto"})
    out = nncompile.parallelize(hf("llama"), batch(256), cfg, pas_policy="autodist",
                                gen_savedir=str(tmp_path), load_module=False)
    auto = json.loads((out / "plan.json").read_text())["autodist"]["context_parallel"]
    rows = auto["candidates"]
    assert [r["cp"] for r in rows] == [1, 2] and all(r["fits"] for r in rows)
    fastest = min(rows, key=lambda r: r["ms"])
    assert auto["chosen"] == fastest["cp"] and f"parallel.cp={fastest['cp']}" in auto["why"]
    code = (out / "gencode0.py").read_text()
    assert ("MESH_AXES = {'cp': 2}" in code) == (auto["chosen"] == 2)
    assert nncompile.verify(hf("llama"), batch(256), cfg, "autodist",
                            gen_savedir=str(tmp_path / "v")).ok


def test_context_parallel_auto_needs_autodist(tmp_path):
    with pytest.raises(ConfigError, match="'auto' is chosen by autodist"):
        nncompile.parallelize(hf("llama"), batch(64), ComputeConfig(2, 2, parallel={
            "cp": "auto"}), pas_policy="tp", gen_savedir=str(tmp_path),
            load_module=False)


@pytest.mark.parametrize("zero", [1, 3])
def test_zero_shards_over_the_context_ranks(zero, tmp_path):
    """The context ranks hold the same parameters, so ZeRO shards over them (here cp 2 and no
    data parallelism): each rank steps (ZeRO-1) or stores (ZeRO-3) half of them, and the step
    equals one device's."""
    from nncompile.tools.simulate import run_ranks
    model, data = hf("llama"), batch(64)
    cfg = ComputeConfig(2, 2, use_zero=zero, parallel={"cp": 2})
    total = sum(p.numel() for p in model.parameters())
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    ref(**data).backward()
    ref_opt.step()
    want = {n: p.detach() for n, p in ref.named_parameters()}

    def rank_fn(rank):
        pm = nncompile.parallelize(copy.deepcopy(model), data, cfg, pas_policy="tp",
                                   gen_savedir=str(tmp_path))
        opt = nncompile.build_optimizer(pm, torch.optim.SGD, lr=0.1, momentum=0.9)
        pm(**data).backward()
        opt.step()
        state = sum(s["momentum_buffer"].numel() for s in opt.state.values())
        stored = sum(p.numel() for p in pm.stored_parameters())
        return opt.zero_size, state, stored, pm.gather_params()

    for size, state, stored, weights in run_ranks(2, rank_fn):
        assert size == 2 and abs(state - total / 2) <= 64
        assert (stored < 0.51 * total) == (zero == 3)
        for name, w in want.items():
            torch.testing.assert_close(weights[name], w, rtol=1e-5, atol=1e-6)


def test_autodist_picks_context_parallelism_for_llama3_8b_at_128k(tmp_path):
    """A Llama-3-8B shape (meta tensors, float32) at 131072 tokens on 8 H100s: the traced causal
    mask (17 G elements) is judged from its key intervals, autodist prices every C with ZeRO
    over the data-parallel x context ranks and picks C > 1 within 80 GB per rank; the
    compiled program's activation estimate agrees with the plan's."""
    import models
    import transformers as tf
    cfg = tf.LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         max_position_embeddings=8192, rope_theta=500000.0,
                         bos_token_id=0, eos_token_id=0, pad_token_id=0)
    with torch.device("meta"):
        model = models.HFCausalLM(tf.LlamaForCausalLM(cfg))
    ids = torch.zeros(1, 131072, dtype=torch.long)
    config = ComputeConfig(8, 8, use_zero="auto", parallel={
        "cp": "auto", "device": "h100-80g", "recompute_modules": "auto"})
    out = nncompile.parallelize(model, {"input_ids": ids, "labels": ids}, config,
                                pas_policy="autodist", gen_savedir=str(tmp_path),
                                load_module=False)
    plan = json.loads((out / "plan.json").read_text())
    auto = plan["autodist"]
    chosen = auto["context_parallel"]["chosen"]
    assert chosen > 1 and auto["memory_gb"] <= 80, auto["context_parallel"]["why"]
    assert {r["cp"] for r in auto["context_parallel"]["candidates"]} == {1, 2, 4, 8}
    assert all(r["form"].startswith("causal (is_causal=True") for r in plan["attention"])
    predicted = plan["memory"]["per_rank_bytes"]["activations"]
    planned = auto["memory"]["per_rank_bytes"]["activations"]
    assert abs(predicted - planned) <= 0.1 * planned, (predicted, planned)
    assert f"MESH_AXES = {{'cp': {chosen}}}" in (out / "gencode0.py").read_text()


@pytest.mark.parametrize("second", ["tp", "cp4"])
def test_dcp_checkpoint_reshards_across_context_sizes(second, tmp_path):
    """A DCP checkpoint of cp 2 x tp 2 with ZeRO-1 over the context ranks (momentum sharded)
    resumes under tp 4 without context parallelism or under cp 4: the next step gives the
    weights the cp 2 run gives."""
    from nncompile.tools.simulate import run_ranks
    model, data, nxt = hf("llama"), batch(64), batch(64, padded=False)
    nxt = {"input_ids": nxt["input_ids"].roll(1, 1)}
    first = ComputeConfig(4, 4, use_zero=1, parallel={"cp": 2})
    other = ComputeConfig(4, 4, parallel={"cp": 4 if second == "cp4" else 1})

    def step(pm, opt, x):
        pm(**x).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def train(rank):
        pm = nncompile.parallelize(copy.deepcopy(model), data, first, pas_policy="tp",
                                   gen_savedir=str(tmp_path / "a"))
        opt = nncompile.build_optimizer(pm, torch.optim.SGD, lr=0.1, momentum=0.9)
        step(pm, opt, data)
        nncompile.save_checkpoint(tmp_path / "ckpt", pm, opt, format="dcp")
        step(pm, opt, nxt)
        return opt.zero_size, pm.gather_params()

    def resume(rank):
        pm = nncompile.parallelize(copy.deepcopy(model), data, other, pas_policy="tp",
                                   gen_savedir=str(tmp_path / "b"))
        opt = nncompile.build_optimizer(pm, torch.optim.SGD, lr=0.1, momentum=0.9)
        nncompile.load_checkpoint(tmp_path / "ckpt", pm, opt)
        step(pm, opt, nxt)
        return pm.gather_params()

    trained = run_ranks(4, train)
    assert trained[0][0] == 2                    # ZeRO-1 over the two context ranks
    want = trained[0][1]
    for got in run_ranks(4, resume):
        for name, w in want.items():
            torch.testing.assert_close(got[name], w, rtol=1e-5, atol=1e-6, msg=name)


def test_compiled_context_parallel_program_is_one_graph_and_equal(tmp_path):
    """torch.compile of a cp 2 program (dynamo's trace, backend="eager", fullgraph): the
    attention rows, zigzag collectives and row-split loss trace as one graph and compute what
    the uncompiled program computes. (Inductor gives the same within 1e-5: measured.)"""
    from torch._dynamo.utils import counters
    from nncompile.tools.simulate import run_ranks
    model, data = hf("llama"), batch(64)
    cfg = ComputeConfig(2, 2, parallel={"cp": 2})

    def rank_fn(rank):
        out = {}
        for compiled in (False, True):
            pm = nncompile.parallelize(copy.deepcopy(model), data, cfg, pas_policy="tp",
                                       gen_savedir=str(tmp_path))
            if compiled:
                pm.compile(backend="eager", fullgraph=True)
            loss = pm(**data)
            loss.backward()
            out[compiled] = (loss.detach(), {n: p.grad for n, p in pm.named_parameters()})
        torch.testing.assert_close(out[True], out[False], rtol=0, atol=0)

    counters.clear()
    run_ranks(2, rank_fn)
    assert not counters["graph_break"]
    torch._dynamo.reset()


def test_inference_only_program_splits_the_sequence_and_equals_the_model(tmp_path):
    """inference_only=True with cp 2: the eval forward on the sequence split gives the model's
    loss in eval mode."""
    from nncompile.tools.simulate import run_ranks
    model, data = hf("llama").eval(), batch(64, padded=True)
    with torch.no_grad():
        want = model(**data)
    cfg = ComputeConfig(2, 2, inference_only=True, parallel={"cp": 2})

    def rank_fn(rank):
        pm = nncompile.parallelize(copy.deepcopy(model), data, cfg, pas_policy="tp",
                                   gen_savedir=str(tmp_path))
        assert pm.MESH_AXES == {"cp": 2}
        with torch.no_grad():
            return pm(**data)

    for got in run_ranks(2, rank_fn):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("order", ["zigzag", "contiguous"])
def test_gpt2_flattening_batch_and_sequence_equals_one_device(order, tmp_path):
    """Hugging Face GPT-2: its Conv1D flattens [batch, seq] into rows and its attention runs
    split by batch, so the sequence split meets batch and row splits; in the zigzag order a
    move between two splits gathers and chunks again (an all-to-all would hand out contiguous
    pieces)."""
    import models
    torch.manual_seed(0)
    model = models.hf_gpt2(n_layer=2, pdrop=0.0).train()
    g = torch.Generator().manual_seed(1)
    data = {"input_ids": torch.randint(0, 64, (8, 16), generator=g),
            "labels": torch.randint(0, 64, (8, 16), generator=g)}
    cfg = ComputeConfig(2, 2, parallel={"cp": 2,
                                          "cp_order": order})
    report = nncompile.verify(model, data, cfg, "tp", gen_savedir=str(tmp_path))
    assert report.ok, report


class PromptTuned(nn.Module):
    """Prompt tuning: learned prompt vectors before the token embeddings, so the sequence
    inside the model is the input's plus the prompt's length."""

    def __init__(self, n_prompt, vocab=64, d=32, heads=4):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.prompt = nn.Parameter(torch.randn(n_prompt, d) * 0.02)
        self.qkv, self.o, self.head = nn.Linear(d, 3 * d), nn.Linear(d, d), nn.Linear(d, vocab)
        self.heads = heads

    def forward(self, ids, labels):
        x = self.emb(ids)
        x = torch.cat([self.prompt.expand(x.shape[0], -1, -1), x], 1)
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2)
                   for t in self.qkv(x).split(C, -1))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        logits = self.head(x + self.o(y.transpose(1, 2).reshape(B, T, C)))[:, len(self.prompt):]
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                           labels.reshape(-1))


@pytest.mark.parametrize("n_prompt", [3, 4])
def test_prompt_tuning_splits_attention_or_says_why_not(tmp_path, n_prompt):
    """cp 2 (zigzag: 4 pieces) on 32 tokens: a 4-token prompt (36 inside the model) splits
    attention along cp; a 3-token one (35) cannot, and the plan says so (a PlanDroppedWarning,
    plan.json's `dropped` with the reason). Either way the loss and gradients are one device's."""
    import warnings
    from nncompile.passes.dropped import PlanDroppedWarning
    from nncompile.tools.simulate import run_ranks
    torch.manual_seed(0)
    model, ids = PromptTuned(n_prompt), torch.randint(0, 64, (2, 32))
    ref = copy.deepcopy(model)
    want = ref(ids, ids)
    want.backward()

    def rank_fn(rank):
        pm = nncompile.parallelize(copy.deepcopy(model), {"ids": ids, "labels": ids},
                                   ComputeConfig(2, 2, parallel={"cp": 2}),
                                   pas_policy="tp", gen_savedir=tmp_path)
        loss = pm(ids=ids, labels=ids)
        loss.backward()
        return loss.item(), pm.gather_grads()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        results = run_ranks(2, rank_fn)
    for loss, grads in results:
        assert abs(loss - want.item()) <= 1e-5 * abs(want.item())
        for name, p in ref.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6)
    out = tmp_path / "PromptTuned"
    dropped = json.loads((out / "plan.json").read_text())["dropped"]
    said = [str(w.message) for w in seen if issubclass(w.category, PlanDroppedWarning)]
    sdpa = next(ln for ln in (out / "gencode0.py").read_text().splitlines()
                if "scaled_dot_product_attention = " in ln)
    if n_prompt == 4:
        assert dropped == [] and not said, (dropped, said)
        assert "comm.attention_rows(" in sdpa and "@cp=S(2)" in sdpa, sdpa
    else:
        assert "aten.scaled_dot_product_attention" in sdpa and "@cp=" not in sdpa, sdpa
        assert len(dropped) == 1 and dropped[0]["asked"] == "parallel.cp=2", dropped
        assert "its sequence is 35 long inside the model (the inputs' is 32)" in \
            dropped[0]["reason"], dropped
        assert "multiple of 4" in dropped[0]["fix"], dropped
        assert said and "1 of 1 attention op(s) run on the whole sequence" in said[0], said
