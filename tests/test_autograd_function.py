"""A user's torch.autograd.Function: torch.export inlines its forward and drops its custom
backward, so tracing refuses it unless it is made one op with nncompile.register_op."""
import pytest
import torch

import nncompile
from nncompile import ComputeConfig


APPLY = torch.autograd.Function.__dict__["apply"]


class STE(torch.autograd.Function):
    """Straight-through estimator: rounds forward, passes the gradient through unchanged."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x)

    @staticmethod
    def backward(ctx, g):
        return g


class Quantized(torch.nn.Module):
    def __init__(self, fn=None):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.fn = fn or STE.apply

    def forward(self, x):
        return (self.fn(self.lin(x) * 4.0) ** 2).mean()


class Direct(Quantized):
    def forward(self, x):
        return (STE.apply(self.lin(x) * 4.0) ** 2).mean()   # looked up while tracing


class NoGradInside(Quantized):
    def forward(self, x):
        y = self.lin(x)
        with torch.no_grad():
            scale = STE.apply(y.abs().amax()) + 1.0
        return (y / scale).pow(2).mean()


def _batch():
    torch.manual_seed(0)
    return (torch.randn(4, 8),)


@pytest.mark.parametrize("cls", [Quantized, Direct])
def test_unregistered_function_is_refused(tmp_path, cls):
    with pytest.raises(nncompile.TraceError) as e:
        nncompile.parallelize(cls(), _batch(), ComputeConfig(1), pas_policy="dp",
                              gen_savedir=tmp_path, load_module=False)
    msg = str(e.value)
    assert "test_autograd_function.STE" in msg and "register_op(STE" in msg
    assert "test_autograd_function.py:" in msg        # where it is defined / applied
    assert "drops its custom backward" in msg
    assert "STE.apply(" in msg if cls is Direct else "self.fn(" in msg      # the call site
    # the patched Function.apply is restored (a classmethod, or C's descriptor from torch 2.15)
    assert torch.autograd.Function.__dict__["apply"] is APPLY


def test_function_under_no_grad_is_allowed(tmp_path):
    torch.manual_seed(0)
    out = nncompile.parallelize(NoGradInside(), _batch(), ComputeConfig(1), pas_policy="dp",
                                gen_savedir=tmp_path, load_module=False)
    assert (out / "gencode0.py").exists()


def test_registered_function_keeps_its_backward(tmp_path):
    ste = nncompile.register_op(STE, "* d -> * d", name="ste_straight_through")
    torch.manual_seed(0)
    model, args = Quantized(ste), _batch()
    # eager: the STE's identity backward, not round's zero gradient
    model(*args).backward()
    grad = model.lin.weight.grad.clone()
    model.zero_grad()
    assert grad.abs().sum() > 0
    report = nncompile.verify(model, args, ComputeConfig(2), "data", gen_savedir=tmp_path)
    assert report.ok, report
    assert report.ref_max["lin.weight"] == pytest.approx(grad.abs().max().item())
