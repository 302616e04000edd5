"""Run a graph in one process on full tensors: the global meaning of a plan.

Collectives are identities here (they change where data lives, not what it is), so every pass
up to insert_comm can be checked against eager PyTorch with this interpreter.
"""
from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree

from .graph import Graph, Value
from .printer import DEVICE, Symbol


def run_graph(graph: Graph, state: dict[str, torch.Tensor], inputs: list[Any]) -> list[Any]:
    """Evaluate `graph` with full parameters/buffers `state` (by FQN) on `inputs`."""
    if graph.meta.get("localized") and graph.plan_ngpus > 1:
        raise ValueError("a localized graph runs per rank; interpret the graph before localize")
    env: dict[int, Any] = {}
    for v, x in zip(graph.inputs, inputs):
        env[id(v)] = x
    for v in graph.params + graph.buffers:
        env[id(v)] = state[v.fqn]

    def get(x: Any) -> Any:
        if isinstance(x, Value):
            return env[id(x)]
        if isinstance(x, Symbol):
            return torch.device("cpu") if x == DEVICE else None
        if isinstance(x, torch.device):
            return torch.device("cpu")
        return x

    for op in graph.const_ops + graph.ops:
        args, kwargs = pytree.tree_map(get, (op.args, op.kwargs))
        if isinstance(op.target, str):                 # a collective: identity on full tensors
            out = args[0]
        else:
            out = op.target(*args, **kwargs)
        if op.multi_output:
            for v, o in zip(op.outputs, out):
                env[id(v)] = o
        elif op.outputs:
            env[id(op.outputs[0])] = out
    return [get(v) for v in graph.outputs]
