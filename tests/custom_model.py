"""A model built from custom ops (nncompile.register_op): a linear layer written as a
torch.autograd.Function with its own backward, and a row softmax that must not be split
along the dim it normalizes."""
import torch
import torch.nn as nn
import torch.nn.functional as F

import nncompile


class MyLinear(torch.autograd.Function):
    """y = x @ w.T with a hand-written backward."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w.t()

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        grad_w = grad.reshape(-1, grad.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
        return grad @ w, grad_w


def row_softmax(x, scale: float = 1.0):
    return torch.softmax(x * scale, dim=-1)


my_linear = nncompile.register_op(MyLinear, "* k+, n k+ -> * n")
softmax_rows = nncompile.register_op(row_softmax, "* d^ -> * d^")


class CustomMLP(nn.Module):
    def __init__(self, d=16, hidden=32, n_out=8):
        super().__init__()
        self.up = nn.Parameter(torch.randn(hidden, d) / d ** 0.5)
        self.down = nn.Parameter(torch.randn(n_out, hidden) / hidden ** 0.5)
        self.head = nn.Linear(n_out, n_out)

    def forward(self, x, target):
        h = F.gelu(my_linear(x, self.up))
        y = my_linear(h, self.down)
        p = softmax_rows(self.head(y), 0.5)
        return ((p - target) ** 2).mean()


def batch(g: torch.Generator, batch_size: int = 4, seq: int = 4) -> dict[str, torch.Tensor]:
    return {"x": torch.randn(batch_size, seq, 16, generator=g),
            "target": torch.softmax(torch.randn(batch_size, seq, 8, generator=g), -1)}
