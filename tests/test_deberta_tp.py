"""`tp` on Hugging Face DeBERTa-v2, whose attention merges batch and heads into one dim
(`view(-1, T, head_dim)`), runs bmm and a gather with an index expanded over that dim
(disentangled c2p / p2c attention) and repeats the relative-position projections once per
batch row. Heads split inside the merged dim is a strided split S(0|B) (StridedShard): the
plan splits every block weight, keeps Megatron's 2 forward all-reduces per block and equals
one device, also with DeBERTa-v3's settings (query and key projections shared with the
relative positions). Then the pieces one by one: the strided rules through the op-rule checker
(and wrong ones caught), the placement's text form, insert_comm's conversions to and from it,
and a shared weight that one reader cannot split staying whole.
"""
import json
import warnings

import pytest
import torch
import torch.nn as nn

import nncompile
from nncompile import ComputeConfig
from nncompile.ir import Shard, StridedShard, join_pieces, parse_placement, piece_of
from nncompile.tools.rule_check import _trace_cases, check_rules
from nncompile.tools.rule_samples import strided_ops
from nncompile.rules import RULES, strategies, strided_splits
from nncompile.rules.registry import make

transformers = pytest.importorskip("transformers")

LAYERS = 2


class MaskedLM(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.m = model

    def forward(self, input_ids, labels):
        return self.m(input_ids=input_ids, labels=labels).loss


def _deberta(v3: bool):
    """A tiny DeBERTa-v2; `v3`: DeBERTa-v3's settings (the query and key projections shared
    with the relative positions, a layer-normed position table, log buckets, dropout)."""
    torch.manual_seed(0)
    extra = dict(share_att_key=True, norm_rel_ebd="layer_norm", position_buckets=8) if v3 \
        else dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    cfg = transformers.DebertaV2Config(
        vocab_size=64, hidden_size=32, num_hidden_layers=LAYERS, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=64, relative_attention=True,
        pos_att_type=["c2p", "p2c"], **extra)
    model = MaskedLM(transformers.DebertaV2ForMaskedLM(cfg))
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": ids, "labels": ids}


def _share(plan: dict, model: nn.Module) -> float:
    """benchmarks/tp_split_share.py's measure: split share of the blocks' 2-D+ weights."""
    import re
    shapes = {n: p.shape for n, p in model.named_parameters()}
    total = split = 0
    for fqn, placement in plan["params"].items():
        shape = shapes.get(fqn)
        if shape is None or len(shape) < 2 or not re.search(r"\.\d+\.", fqn):
            continue
        total += shape.numel()
        split += shape.numel() if str(placement).startswith("S") else 0
    return split / total


@pytest.mark.parametrize("v3", [False, True], ids=["v2", "v3"])
def test_deberta_attention_splits_by_heads_and_matches_one_device(v3, tmp_path):
    model, batch = _deberta(v3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = nncompile.verify(model, batch, ComputeConfig(2, 2), pas_policy="tp",
                                  gen_savedir=str(tmp_path))
    assert report.ok, str(report)
    replicated = [str(w.message) for w in caught if "run replicated" in str(w.message)]
    assert not replicated, replicated[0]
    out = tmp_path / "verify_MaskedLM"
    plan = json.loads((out / "plan.json").read_text())
    assert _share(plan, model) >= 0.9, plan["params"]
    projections = ("query_proj", "key_proj", "value_proj") + (
        () if v3 else ("pos_key_proj", "pos_query_proj"))
    for i in range(LAYERS):
        attn = f"m.deberta.encoder.layer.{i}.attention"
        got = {k: plan["params"][f"{attn}.self.{k}.weight"] for k in projections}
        assert set(got.values()) == {"S(0)"}, got
        assert plan["params"][f"{attn}.output.dense.weight"] == "S(1)"
    counts = plan["collectives"]
    assert counts["comm.all_reduce"] == 2 * LAYERS, counts
    assert not {k for k in counts} - {"comm.all_reduce", "comm.sync_grad", "comm.to_partial",
                                      "comm.chunk"}, counts
    code = "".join(p.read_text() for p in sorted(out.glob("*.py")))
    assert "S(0|2)" in code                 # heads strided through the merged (batch * heads)


# ---- the strided rules through the op-rule checker (nncompile/tools/rule_check.py) ---------------
STRIDED_RULES = ["view", "repeat", "gather", "expand", "bmm"]


@pytest.fixture(scope="module")
def strided_cases():
    g = torch.Generator().manual_seed(0)
    return {rule: [c for fn, args in strided_ops(rule, g)
                   for c in _trace_cases(rule, "hand", fn, args, {})] for rule in STRIDED_RULES}


def test_strided_rules_are_checked(strided_cases):
    report = check_rules(STRIDED_RULES, cases=[c for cs in strided_cases.values() for c in cs])
    assert report.ok, str(report)
    for rule in STRIDED_RULES:
        strided = {n for n, note in report.checked[rule] if "strided" in note}
        assert strided == {2, 4}, (rule, report.checked[rule])


def test_plain_splits_only_outside_strided_splits(strided_cases):
    """Policies other than tp (autodist, greedy) and the cost model see plain splits only."""
    op = strided_cases["repeat"][0].op
    assert not any(isinstance(p, StridedShard) for s in strategies(op, 2)
                   for p in (*s.inputs, *s.outputs))
    with strided_splits():
        assert any(s.outputs == (StridedShard(0, 2),) for s in strategies(op, 2))


def _wrong(cases, rule, fn, monkeypatch):
    monkeypatch.setitem(RULES, rule, fn)
    report = check_rules([rule], cases=cases)
    assert not report.ok
    return report


def test_a_merge_read_as_a_plain_split_is_caught(strided_cases, monkeypatch):
    # (B*H, T, D) -> (B, H, T, D) said to carry S(0) to S(1): rank 0 would hold batch 0's heads
    def plain(op, n):
        x, out = op.args[0], op.outputs[0]
        return [make(op, {x: Shard(0)}, [Shard(1)], "merged dim as heads")] \
            if len(out.meta.shape) == len(x.meta.shape) + 1 else []
    report = _wrong(strided_cases["view"], "view", plain, monkeypatch)
    assert any("view [merged dim as heads]" in f for f in report.failures), report


def test_a_repeat_keeping_a_plain_split_is_caught(strided_cases, monkeypatch):
    def plain(op, n):
        x = op.args[0]
        return [make(op, {x: Shard(0)}, [Shard(0)], "repeat keeps S(0)")] \
            if x.meta.shape[0] % n == 0 else []
    report = _wrong(strided_cases["repeat"][:2], "repeat", plain, monkeypatch)
    assert any("repeat [repeat keeps S(0)]" in f for f in report.failures), report


def test_a_gather_reading_local_rows_of_a_whole_input_is_caught(strided_cases, monkeypatch):
    # index split on a dim it does not gather along, x whole: each rank reads x's first rows
    def rows(op, n):
        x, dim, index = op.args[:3]
        d = 0 if dim % len(index.meta.shape) != 0 else 1
        return [make(op, {index: Shard(d)}, [Shard(d)], "index rows, x whole")]
    report = _wrong(strided_cases["gather"], "gather", rows, monkeypatch)
    assert any("gather [index rows, x whole]" in f for f in report.failures), report


# ---- the placement ------------------------------------------------------------------------
def test_strided_placement_text_and_pieces():
    p = StridedShard(0, 2)
    assert repr(p) == "S(0|2)" and parse_placement("S(0|2)") == p
    assert parse_placement("S(1)") == Shard(1) and p != Shard(0)
    full = torch.arange(2 * 4 * 3).reshape(2, 4, 3)           # (B, H, T)
    merged = full.reshape(8, 3)                               # (B*H, T)
    for rank in range(2):                                     # heads split, batch whole
        want = full[:, 2 * rank:2 * rank + 2].reshape(4, 3)
        assert torch.equal(piece_of(merged, p, rank, 2), want)
    assert torch.equal(join_pieces([piece_of(merged, p, r, 2) for r in range(2)], p), merged)


# ---- insert_comm: conversions to and from a strided split ---------------------------------
class Merged(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(8, 8)

    def forward(self, x):                                     # x: (B, H, T, D)
        h = self.lin(x).reshape(8, 4, 8)                      # (B*H, T, D)
        return (h * 3.0).pow(2).mean()


def strided_mul(graph, config):
    """Everything replicated but `h * 3.0`, strided S(0|2): insert_comm chunks its whole input
    and gathers its result for the replicated pow."""
    g = graph.clone()
    with strided_splits():
        for op in g.ops:
            if op.target_name.endswith("mul.Tensor"):
                op.strategy = next(s for s in strategies(op, config.plan_ngpus)
                                   if s.outputs == (StridedShard(0, 2),))
    for op in g.ops:
        if op.strategy is not None:
            for v, pl in zip(op.outputs, op.strategy.outputs):
                v.placement = pl
    return g


def test_insert_comm_chunks_into_and_gathers_from_a_strided_split(tmp_path):
    from nncompile.frontend import trace
    from nncompile.ir import assert_graph_equal, parse_graph, print_graph
    from nncompile.passes.insert_comm import insert_comm
    from nncompile.passes.localize import localize
    from nncompile.passes.plan import Plan
    model, x = Merged(), torch.randn(2, 4, 4, 8)
    cfg = ComputeConfig(2, 2)
    g = trace(model, (x,))
    g.config = cfg                       # the request the passes read
    planned = Plan(strided_mul)(g)
    text = print_graph(planned)
    assert "S(0|2)" in text
    assert_graph_equal(planned, parse_graph(text))      # the printed plan reads back
    g = localize(insert_comm(planned))
    comm = {op.target_name: op for op in g.ops if op.target_name.startswith("comm.")}
    # both run on the (B, H*T...) view with the merged dim unmerged: a plain S(1) there
    assert comm["comm.chunk"].kwargs["dim"] == 1 and comm["comm.all_gather"].kwargs["dim"] == 1
    assert comm["comm.chunk"].outputs[0].meta.shape == (2, 4, 4, 8)
    views = [op for op in g.ops if op.strategy is not None
             and op.strategy.note == "unmerge strided split"]
    assert [op.args[1] for op in views] == [[2, 4, 4, 8], [4, 4, 8], [2, 2, 4, 8], [8, 4, 8]]
    report = nncompile.verify(model, (x,), cfg, pas_policy=strided_mul,
                              gen_savedir=str(tmp_path))
    assert report.ok, str(report)


# ---- tp: a weight several projections read ------------------------------------------------
class SharedQuery(nn.Module):
    """Attention whose query weight is read a second time by a projection whose output meets
    the residual stream (it cannot start a split): the weight must stay whole, not be split
    by the first reader and gathered for the second."""

    def __init__(self, d=32, heads=4):
        super().__init__()
        torch.manual_seed(0)
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (lin(x).view(b, t, self.heads, -1).transpose(1, 2)
                   for lin in (self.q, self.k, self.v))
        att = nn.functional.scaled_dot_product_attention(q, k, v)
        y = x + self.o(att.transpose(1, 2).reshape(b, t, d))
        y = y + nn.functional.linear(x, self.q.weight)
        return (y ** 2).mean()


def test_a_shared_weight_splits_only_when_every_reader_takes_it_alike(tmp_path):
    model, x = SharedQuery(), torch.randn(2, 8, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = nncompile.verify(model, (x,), ComputeConfig(2, 2), pas_policy="tp",
                                  gen_savedir=str(tmp_path))
    assert report.ok, str(report)
    plan = json.loads((tmp_path / "verify_SharedQuery" / "plan.json").read_text())
    assert plan["params"]["q.weight"] == "R", plan["params"]
    assert "comm.all_gather" not in plan["collectives"], plan["collectives"]
