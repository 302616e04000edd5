"""The op-rule table: which dims of each aten op may be split and what the split leaves.

One concern per file: contractions (einsum.py), elementwise (pointwise.py), views and layout
(shape_ops.py), model-level ops (nn_ops.py). `strategies(op, n)` is the only entry point.
"""
from . import einsum, nn_ops, pointwise, shape_ops  # noqa: F401  (register rules)
from .registry import RANDOM_LOCAL, RULES, draws_random, register, replicated, strategies

__all__ = ["RANDOM_LOCAL", "RULES", "draws_random", "register", "replicated", "strategies"]
