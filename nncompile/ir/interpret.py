"""Run a graph in one process on full tensors: the global meaning of a plan.

Collectives are identities here (they change where data lives, not what it is), so every pass
up to insert_comm can be checked against eager PyTorch with this interpreter.
"""
from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree

from ..custom_ops import REGISTRY, is_custom_op
from .graph import Graph, Stage, Value
from .printer import DEVICE, Symbol


def run_graph(graph: Graph, state: dict[str, torch.Tensor], inputs: list[Any],
              record: dict[str, Any] | None = None) -> list[Any]:
    """Evaluate `graph` with full parameters/buffers `state` (by FQN) on `inputs`; `record`,
    when given, receives every value by name."""
    if Stage.LOCALIZED in graph.stages and graph.plan_ngpus > 1:
        raise ValueError("a localized graph runs per rank; interpret the graph before localize")
    env: dict[int, Any] = {}
    for v, x in zip(graph.inputs, inputs):
        env[id(v)] = x
    for v in graph.params + graph.buffers:
        env[id(v)] = state[v.fqn] if v.part is None else part_value(v, state)

    run_ops(graph.const_ops + graph.ops, env)
    if record is not None:
        names = {id(v): v.name for v in graph.values()}
        record.update({names[k]: x for k, x in env.items() if k in names})
    return [_get(env, v) for v in graph.outputs]


def part_value(v: Value, state: dict[str, torch.Tensor]) -> torch.Tensor:
    """A parameter part (Value.part) read from its original (fused) parameter in `state`."""
    p = v.part
    box = tuple(slice(a, b) for a, b in p.box)
    return state[p.source].reshape(p.view)[box].reshape(v.meta.shape)


def _get(env: dict[int, Any], x: Any) -> Any:
    if isinstance(x, Value):
        return env[id(x)]
    if isinstance(x, Symbol):
        if hasattr(x, "train"):        # a mode argument (nncompile/modes.py): training
            return x.train
        return torch.device("cpu") if x == DEVICE else None
    if isinstance(x, torch.device):
        return torch.device("cpu")
    return x


def run_ops(ops: list, env: dict[int, Any]) -> None:
    """Run `ops` in order on CPU, reading their inputs from and writing their outputs to
    `env` (id(Value) -> value); collectives are identities."""
    def get(x: Any) -> Any:
        return _get(env, x)

    for op in ops:
        args, kwargs = pytree.tree_map(get, (op.args, op.kwargs))
        if isinstance(op.target, str):                 # a collective: identity on full tensors
            out = args[0]
        elif is_custom_op(op.target):                   # the user's function, its autograd
            out = REGISTRY[op.target._opname].impl(*args, **kwargs)
        elif op.target is torch.ops.aten.view.default:  # same value; layout may differ
            out = torch.ops.aten.reshape.default(*args, **kwargs)
        else:
            out = op.target(*args, **kwargs)
        if op.multi_output:
            for v, o in zip(op.outputs, out):
                env[id(v)] = o
        elif op.outputs:
            env[id(op.outputs[0])] = out
