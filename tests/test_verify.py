"""nncompile.verify in one process (every rank a thread over the threaded process group) and
ComputeConfig(check=True): a plan that diverges is named down to the op and refused."""
import os

import pytest
import torch

import models
import nncompile
from nncompile.ir import Partial, Replicate, Strategy
from nncompile.passes.policies import tp
from nncompile.rules import RULES


def test_verify_in_one_process_on_the_example_gpt(tmp_path):
    for cfg in (nncompile.ComputeConfig(2), nncompile.ComputeConfig(2, 4)):
        report = nncompile.verify(models.build("gpt"), models.batch("gpt", 0), cfg, "tp",
                                  gen_savedir=str(tmp_path))
        assert report.ok, str(report)
        assert report.ranks == (cfg.runtime_ngpus or cfg.plan_ngpus)
        assert report.max_error < 1e-5 and report.divergence is None
        assert f"{report.ranks} ranks in one process" in str(report)


def _mislabel(graph, config):
    """tp, then one row-split linear (its output a partial sum) labelled replicated."""
    g = tp(graph, config)
    op = next(o for o in g.ops if o.target_name == "aten.linear.default"
              and isinstance(o.strategy.outputs[0], Partial))
    op.strategy = Strategy(op.strategy.inputs, (Replicate(),), "mislabelled")
    _mislabel.op = op.name
    return g


@pytest.fixture
def allow_mislabel(monkeypatch):
    """Let the plan pass accept the mislabelled strategy, as a buggy rule would offer it."""
    rule = RULES["linear"]

    def buggy(op, n):
        out = rule(op, n)
        return out + [Strategy(s.inputs, (Replicate(),), "mislabelled") for s in out
                      if isinstance(s.outputs[0], Partial)]
    monkeypatch.setitem(RULES, "linear", buggy)


def test_verify_names_the_op_of_a_mislabelled_placement(tmp_path, allow_mislabel):
    model = models.build("mlp")
    report = nncompile.verify(model, models.batch("mlp", 0), nncompile.ComputeConfig(2),
                              _mislabel, gen_savedir=str(tmp_path))
    assert not report.ok
    d = report.divergence
    assert d is not None and d.phase == "forward", str(report)
    assert d.value == _mislabel.op and d.op == "aten.linear.default"
    assert d.placement == "R" and d.max_error > 1e-3
    assert "tests/models.py" in d.source and "self." in d.source      # the user's line
    text = str(report)
    assert "MISMATCH" in text and f"%{_mislabel.op}" in text


def test_check_true_refuses_a_diverging_plan(tmp_path, allow_mislabel):
    cfg = nncompile.ComputeConfig(2, check=True)
    with pytest.raises(nncompile.PlanCheckError) as e:
        nncompile.parallelize(models.build("mlp"), models.batch("mlp", 0), cfg,
                              pas_policy=_mislabel, gen_savedir=str(tmp_path),
                              load_module=False)
    assert "aten.linear.default" in str(e.value) and "first divergence" in str(e.value)
    assert not (tmp_path / "MLP").exists()               # nothing kept to be reused


def test_check_true_accepts_a_sound_plan(tmp_path):
    cfg = nncompile.ComputeConfig(2, 4, check=True)
    out = nncompile.parallelize(models.build("hf_t5"), models.batch("hf_t5", 0), cfg,
                                pas_policy="tp", gen_savedir=str(tmp_path), load_module=False)
    assert (out / "gencode3.py").exists()


def test_check_true_needs_real_weights(tmp_path):
    with torch.device("meta"):
        model = models.MLP()
    with pytest.raises(nncompile.ConfigError, match="meta device"):
        nncompile.parallelize(model, models.batch("mlp", 0),
                              nncompile.ComputeConfig(2, check=True), pas_policy="tp",
                              gen_savedir=str(tmp_path), load_module=False)


class ShiftRight(torch.nn.Module):
    """Decoder inputs built in place, as T5/BART's `_shift_right` does."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(16, 8)
        self.head = torch.nn.Linear(8, 16)

    def forward(self, y):
        d = y.new_zeros(y.shape)
        d[:, 1:] = y[:, :-1].clone()
        d[:, 0] = 2
        d.masked_fill_(d == -100, 0)
        h = self.emb(d)
        h.mul_(2.0)
        return torch.nn.functional.cross_entropy(self.head(h).flatten(0, 1), y.flatten())


@pytest.mark.parametrize("policy", ["tp", "data"])
def test_in_place_writes_are_functionalized(tmp_path, policy):
    from nncompile.frontend import trace
    torch.manual_seed(0)
    y = torch.randint(3, 16, (4, 8))
    graph = trace(ShiftRight(), (y,))
    assert not [op for op in graph.ops if getattr(op.target, "_schema", None) is not None
                and op.target._schema.is_mutable]
    assert any(op.target_name == "aten.slice_scatter.default" for op in graph.ops)
    report = nncompile.verify(ShiftRight(), (y,), nncompile.ComputeConfig(2), policy,
                              gen_savedir=str(tmp_path))
    assert report.ok, str(report)


def test_the_ir_verifier_rejects_in_place_ops():
    from nncompile.frontend import trace
    from nncompile.ir import verify
    graph = trace(models.build("mlp"), models.batch("mlp", 0))
    op = next(o for o in graph.ops if o.target_name == "aten.relu.default")
    op.target = torch.ops.aten.relu_.default
    with pytest.raises(nncompile.GraphError, match="in place"):
        verify(graph)


class FillsEmpty(torch.nn.Module):
    """Uninitialized memory filled later (as Hugging Face's MoE experts do)."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        buf = torch.empty_like(x)
        buf = buf.copy_(self.fc(x))
        return buf.pow(2).mean()


def test_uninitialized_values_are_not_reported_as_divergence(tmp_path):
    torch.manual_seed(0)
    report = nncompile.verify(FillsEmpty(), (torch.randn(4, 8),), nncompile.ComputeConfig(2),
                              "tp", gen_savedir=str(tmp_path))
    assert report.ok and report.divergence is None, str(report)
