"""Built-in policies: `dp` (replicate), `data` (split the batch), and `split_everything`
(split every op on some dim; not a plan to train with, but one that exercises every
collective of insert_comm's table, used by the tests). `tp` and `tp_sp` are in megatron.py.

A policy is `policy(graph, config) -> graph`: it sets `op.strategy` (one of
`nncompile.rules.strategies(op, graph.mesh)`) and the placements of parameters, buffers and
constants, splitting over `tensor_ranks(graph, config)` tensor-parallel ranks
(passes/contract.py: the mesh's "plan" axis the planner chose, the plan unit's ranks less a
pipeline's stages and the cp and ep axes in `graph.axes`; called on a traced graph, the
config's plan_ngpus); `config` is the user's ComputeConfig, unchanged. Ops it leaves without a strategy run
replicated.
"""
from __future__ import annotations

from nncompile.errors import PolicyError
from nncompile.ir import Graph, Partial, PARAM, Replicate

from ..contract import tensor_ranks
from .greedy import Walk, greedy


def dp(graph: Graph, config) -> Graph:
    """Replicate everything; data parallelism comes from runtime_ngpus // plan_ngpus units."""
    if tensor_ranks(graph, config) != 1:
        raise PolicyError(f"policy 'dp' replicates the model inside a plan unit, so it needs "
                          f"plan_ngpus=1 (got {tensor_ranks(graph, config)}); use 'data' or 'tp' to split "
                          "work inside a unit")
    return greedy(graph, 1, lambda walk, op, s: 0)


def _data_rank(walk: Walk, op, s) -> int | None:
    if any(v.kind == PARAM and not isinstance(p, Replicate)
           for v, p in zip(op.tensor_inputs(), s.inputs)):
        return None
    if walk.is_batch_split(op, s):
        return 0
    if all(isinstance(p, Partial) for p in s.outputs):
        return 0                                  # keep a partial sum (e.g. the loss)
    return 1 if not s.is_split else None


def data(graph: Graph, config) -> Graph:
    """Split the batch dim (dim 0 of every input) across the plan unit; replicate weights."""
    return greedy(graph, tensor_ranks(graph, config), _data_rank)


def _tp_rank(walk: Walk, op, s) -> int:
    if walk.shards_param(op, s):
        return 0                                  # tensor parallel proper: a weight is split
    if not s.is_split:
        return 3
    if walk.is_batch_split(op, s):
        return 2
    return 1                                      # another non-batch dim, or keep partial


def split_everything(graph: Graph, config) -> Graph:
    """Split every op on a non-batch dim: weights first, then any other dim. Deterministic;
    exercises every transition of the collective table (21 collectives on a 2-block GPT)."""
    return greedy(graph, tensor_ranks(graph, config), _tp_rank)
