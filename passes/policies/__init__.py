"""Policies decide placements only; they never touch codegen.

`get_policy(name_or_callable)` returns `policy(graph, config) -> graph`.
"""
from __future__ import annotations

from typing import Callable

from nncompile.errors import PolicyError

from nncompile.passes.autodist import autodist

from .builtin import data, dp, split_everything
from .megatron import tp, tp_sp

POLICIES: dict[str, Callable] = {"autodist": autodist, "dp": dp, "data": data, "tp": tp,
                               "tp_sp": tp_sp}
NOT_YET = {"pp": "pipeline parallelism",
           "hybrid": "pipeline + tensor parallelism"}


def get_policy(policy) -> Callable:
    if callable(policy):
        return policy
    if policy in POLICIES:
        return POLICIES[policy]
    if policy in NOT_YET:
        raise PolicyError(f"policy {policy!r} ({NOT_YET[policy]}) is not available yet; "
                          f"choose one of {sorted(POLICIES)} or pass a callable "
                          "policy(graph, config) -> graph")
    raise PolicyError(f"unknown policy {policy!r}; choose one of {sorted(POLICIES)} "
                      "or pass a callable policy(graph, config) -> graph")


__all__ = ["POLICIES", "get_policy", "autodist", "dp", "data", "tp", "tp_sp",
           "split_everything"]
