"""The op-rule table: which dims of each aten op may be split and what the split leaves.

One concern per file: contractions (einsum.py), elementwise (pointwise.py), views and layout
(shape_ops.py), model-level ops (nn_ops.py), convolutions and batch norm (conv.py).
`strategies(op, n)` is the only entry point.
"""
from . import conv, einsum, experts, nn_ops, pointwise, shape_ops  # noqa: F401  (register rules)
from .registry import LOCAL_ARGS, RANDOM_LOCAL, RULES, draws_random, register, replicated, \
    strategies, strided_splits

__all__ = ["LOCAL_ARGS", "RANDOM_LOCAL", "RULES", "draws_random", "register", "replicated",
           "strategies", "strided_splits"]
