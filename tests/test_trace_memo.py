"""The trace memo (nncompile/frontend/trace_memo.py): a model traced again in the same process
is a copy of the first trace only when nothing a trace depends on changed, and the copy is
the graph a fresh trace gives, independent of the one handed out before."""
from __future__ import annotations

import types

import pytest
import torch
import torch.nn as nn

import nncompile
from nncompile.frontend import trace, trace_memo
from nncompile.ir.printer import print_graph_texts
from models import batch, build


def _text(g) -> str:
    texts = print_graph_texts(g)[0]
    return texts + ("" if g.eval_program is None else print_graph_texts(g.eval_program)[0])


def _traced(model, args, modes=True) -> tuple[str, bool]:
    """(the graph's text, whether it came from the memo)."""
    before = trace_memo.hits
    g = trace(model, args, modes=modes)
    return _text(g), trace_memo.hits > before


@pytest.fixture(autouse=True)
def _fresh_memo():
    trace_memo.clear()
    yield
    trace_memo.clear()


@pytest.mark.parametrize("name", ["gpt", "hf_llama", "hf_bart"])
def test_a_second_trace_is_the_first_ones_copy(name, monkeypatch):
    first, hit = _traced(build(name), batch(name, 0))
    assert not hit
    again, hit = _traced(build(name), batch(name, 0))
    assert hit and again == first
    monkeypatch.setenv("NNCOMPILE_TRACE_MEMO", "0")
    fresh, hit = _traced(build(name), batch(name, 0))
    assert not hit and fresh == first


def test_copies_are_independent():
    g1 = trace(build("gpt"), batch("gpt", 0), modes=True)
    for v in g1.values():                 # what callers do to the graph they get
        v.requires_grad = False
    g1.ops.clear()
    g1.trace_info.batched.append("x")
    g2 = trace(build("gpt"), batch("gpt", 0), modes=True)
    assert g2.ops and not g2.trace_info.batched
    assert any(v.requires_grad for v in g2.values())


class Scaled(nn.Module):
    def __init__(self, scale=2.0, d=8):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.scale = scale
        self.opts = {"act": "relu"}

    def forward(self, x):
        y = self.fc(x) * self.scale
        return torch.relu(y) if self.opts["act"] == "relu" else torch.tanh(y)


X = torch.randn(4, 8)


@pytest.mark.parametrize("change", [
    "attribute", "nested attribute", "parameter shape", "parameter dtype", "frozen",
    "submodule mode", "arg shape", "arg dtype", "tied weight", "method"])
def test_what_changes_a_trace_is_not_answered_from_the_memo(change, monkeypatch):
    base, _ = _traced(Scaled(), (X,), modes=False)
    m, args = Scaled(), (X,)
    if change == "attribute":
        m.scale = 3.0
    elif change == "nested attribute":
        m.opts["act"] = "tanh"
    elif change == "parameter shape":
        m, args = Scaled(d=4), (torch.randn(4, 4),)
    elif change == "parameter dtype":
        m = m.double()
        args = (X.double(),)
    elif change == "frozen":
        m.fc.bias.requires_grad_(False)
    elif change == "submodule mode":
        m.fc.eval()
    elif change == "arg shape":
        args = (torch.randn(5, 8),)
    elif change == "arg dtype":
        args = (X.double(),)
    elif change == "tied weight":
        m = nn.Sequential(nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False))
        _traced(m, (X,), modes=False)
        m = nn.Sequential(nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False))
        m[1].weight = m[0].weight
    elif change == "method":
        monkeypatch.setattr(Scaled, "forward", lambda self, x: self.fc(x) - 1)
    text, hit = _traced(m, args, modes=False)
    assert not hit, change
    if change in ("attribute", "nested attribute", "method", "parameter shape"):
        assert text != base
    monkeypatch.setenv("NNCOMPILE_TRACE_MEMO", "0")
    assert _traced(m, args, modes=False)[0] == text       # what a fresh trace gives


def test_torch_modes_and_the_working_directory_are_in_the_key(tmp_path, monkeypatch):
    m = Scaled()
    k = trace_memo.key(m, (X,), None, False)
    assert k == trace_memo.key(m, (X,), None, False)
    with torch.no_grad():
        assert trace_memo.key(m, (X,), None, False) != k
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert trace_memo.key(m, (X,), None, False) != k
    assert trace_memo.key(m, (X,), {0: "batch"}, False) != k
    assert trace_memo.key(m, (X,), None, True) != k
    monkeypatch.setenv("NNCOMPILE_REPLAY", "0")
    assert trace_memo.key(m, (X,), None, False) != k
    monkeypatch.delenv("NNCOMPILE_REPLAY")
    monkeypatch.chdir(tmp_path)
    assert trace_memo.key(m, (X,), None, False) != k


def test_a_redefined_helper_or_global_flag_is_a_new_trace():
    """A notebook cell run again: the model's module-level helper and flag are new objects."""
    cell = '''
import torch, torch.nn as nn
SHIFT = {shift}
def helper(y):
    return y + SHIFT
def outer(y):
    return helper(y) * 2
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
    def forward(self, x):
        return outer(self.fc(x))
'''
    ns = {"__name__": "cell"}
    exec(cell.format(shift=1.0), ns)          # noqa: S102 - a notebook's cell
    Net = ns["Net"]
    first, _ = _traced(Net(), (X,), modes=False)
    assert _traced(Net(), (X,), modes=False) == (first, True)
    ns["SHIFT"] = 5.0                          # the flag changed: a new trace
    text, hit = _traced(Net(), (X,), modes=False)
    assert not hit and "5.0" in text and text != first
    exec(cell.format(shift=5.0).replace("* 2", "* 3"), ns)   # the helper redefined, same Net
    text3, hit = _traced(Net(), (X,), modes=False)
    assert not hit and "3" in text3 and text3 != text


def test_an_object_it_cannot_describe_traces_without_the_memo():
    m = Scaled()
    deep = cur = {}
    for _ in range(40):                       # nested beyond what the key describes
        cur["x"] = {}
        cur = cur["x"]
    m.deep = deep
    assert trace_memo.key(m, (X,), None, False) is None
    assert _traced(m, (X,), modes=False)[1] is False
    assert _traced(m, (X,), modes=False)[1] is False


def test_parallelize_generates_the_same_code_from_a_kept_trace(tmp_path, monkeypatch):
    cfg = nncompile.ComputeConfig(2, 2)
    kw = dict(pas_policy="tp", load_module=False)
    nncompile.parallelize(build("gpt"), batch("gpt", 0), cfg, gen_savedir=tmp_path / "a", **kw)
    hits = trace_memo.hits
    nncompile.parallelize(build("gpt"), batch("gpt", 0), cfg, gen_savedir=tmp_path / "b", **kw)
    assert trace_memo.hits == hits + 1
    monkeypatch.setenv("NNCOMPILE_TRACE_MEMO", "0")
    nncompile.parallelize(build("gpt"), batch("gpt", 0), cfg, gen_savedir=tmp_path / "c", **kw)
    for r in range(2):
        codes = [(tmp_path / d / "GPT" / f"gencode{r}.py").read_text() for d in "abc"]
        assert codes[0] == codes[1] == codes[2]


def test_a_one_mode_trace_then_both_modes_equals_a_fresh_two_mode_trace(monkeypatch):
    """trace_modes compares its two traces (modes.merge): each is traced afresh, so a kept
    one-mode trace cannot stand in for one of them."""
    model = build("hf_gpt2")
    trace(model, batch("hf_gpt2", 0))                       # the training mode only
    both = _text(trace(model, batch("hf_gpt2", 0), modes=True))
    monkeypatch.setenv("NNCOMPILE_TRACE_MEMO", "0")
    assert both == _text(trace(model, batch("hf_gpt2", 0), modes=True))


def test_a_namespace_config_is_compared_by_content():
    m = Scaled()
    m.cfg = types.SimpleNamespace(act="relu")
    k = trace_memo.key(m, (X,), None, False)
    m.cfg.act = "tanh"
    assert trace_memo.key(m, (X,), None, False) != k
