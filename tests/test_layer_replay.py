"""Layer replay (nncompile/frontend/layer_replay.py): a run of identical layers is traced once and
copied; the IR must be the one a full trace gives, name for name, and a layer whose trace
could differ must be traced for real."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from nncompile.frontend import layer_replay
from nncompile.frontend import trace
from nncompile.ir import print_graph
from models import batch, hf_bart, hf_gpt2, hf_llama


def _shape(x):
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, [_shape(e) for e in x])
    if isinstance(x, dict):
        return (type(x).__name__, {k: _shape(e) for k, e in x.items()})
    return getattr(x, "name", None) if type(x).__name__ == "Value" else (type(x).__name__, x)


def _summary(g):
    return (print_graph(g),
            [(o.target, _shape(o.args), _shape(o.kwargs), o.module_path, o.module_stack,
              o.source, o.multi_output) for o in g.ops],
            [(v.name, v.kind, v.fqn, v.requires_grad, v.meta) for v in g.values()],
            g.out_spec, _shape(g.outputs))


def _both(model, args, monkeypatch):
    """(replayed trace, what layer_replay reported, full trace)."""
    g = trace(model, args)
    info = dict(layer_replay.last)
    monkeypatch.setenv("NNCOMPILE_REPLAY", "0")
    full = trace(model, args)
    monkeypatch.delenv("NNCOMPILE_REPLAY")
    return g, info, full


@pytest.mark.parametrize("name,build,layers", [
    ("hf_llama", lambda: hf_llama(n_layer=4), 3),
    ("hf_gpt2", lambda: hf_gpt2(n_layer=3, pdrop=0.1), 2),
    ("hf_bart", lambda: hf_bart(n_layer=3), 4),        # writes in place: functionalized
])
def test_replay_equals_full_trace(name, build, layers, monkeypatch):
    torch.manual_seed(0)
    g, info, full = _both(build().train(), batch(name, 0), monkeypatch)
    assert info == {"replayed": layers}
    assert _summary(g) == _summary(full)


class Block(nn.Module):
    def __init__(self, d, idx, scale_by_idx=False):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.idx = idx
        self.scale_by_idx = scale_by_idx

    def forward(self, x, scale: float = 1.0):
        y = F.gelu(self.fc(x)) * scale
        if self.scale_by_idx:
            y = y / (self.idx + 1)          # reads the attribute that differs per layer
        return x + y


class Stack(nn.Module):
    def __init__(self, n=4, d=8, scale_by_idx=False, per_layer_arg=False, mixed=False):
        super().__init__()
        blocks = []
        for i in range(n):
            blocks.append(nn.Sequential(nn.Linear(d, d)) if mixed and i % 2
                          else Block(d, i, scale_by_idx))
        self.blocks = nn.ModuleList(blocks)
        self.per_layer_arg = per_layer_arg
        self.inp = nn.Linear(d, d)

    def forward(self, x):
        x = self.inp(x)             # every block's input needs a gradient
        for i, b in enumerate(self.blocks):
            if isinstance(b, Block):
                x = b(x, scale=float(i + 1) if self.per_layer_arg else 1.0)
            else:
                x = b(x)
        return x.sum()


@pytest.mark.parametrize("kwargs,replayed", [
    ({}, 3),                           # identical blocks: 3 of 4 replayed
    ({"scale_by_idx": True}, 0),       # forward reads idx, which differs: traced for real
    ({"per_layer_arg": True}, 0),      # a different literal argument per call
    ({"mixed": True}, 2),              # two kinds of block, each its own run
])
def test_replay_only_when_the_trace_cannot_differ(kwargs, replayed, monkeypatch):
    torch.manual_seed(0)
    g, info, full = _both(Stack(**kwargs), (torch.randn(2, 8),), monkeypatch)
    assert info.get("replayed", 0) == replayed, info
    assert _summary(g) == _summary(full)


def test_hooks_and_shared_modules_are_not_replayed(monkeypatch):
    torch.manual_seed(0)
    m = Stack()
    m.blocks[2].register_forward_hook(lambda mod, a, out: out * 2)
    g, info, full = _both(m, (torch.randn(2, 8),), monkeypatch)
    assert info == {"replayed": 2}          # blocks 1 and 3; block 2 has a hook
    assert _summary(g) == _summary(full)
    shared = Stack()
    shared.blocks[3] = shared.blocks[1]     # one module object twice in the list
    g, info, full = _both(shared, (torch.randn(2, 8),), monkeypatch)
    assert info == {}                       # shared modules: no replay at all
    assert _summary(g) == _summary(full)


class Captures(nn.Module):
    """A block that reads a tensor its parent stored on it rather than an argument."""

    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.extra = None

    def forward(self, x):
        return self.fc(x) + self.extra


class CaptureStack(nn.Module):
    def __init__(self, n=3, d=8):
        super().__init__()
        self.blocks = nn.ModuleList(Captures(d) for _ in range(n))

    def forward(self, x):
        bias = x.mean(0)
        for b in self.blocks:
            b.extra = bias
            x = b(x)
        for b in self.blocks:
            b.extra = None
        return x.sum()


def test_a_value_read_outside_the_arguments_falls_back(monkeypatch):
    torch.manual_seed(0)
    g, info, full = _both(CaptureStack(), (torch.randn(2, 8),), monkeypatch)
    assert "fallback" in info
    assert _summary(g) == _summary(full)
