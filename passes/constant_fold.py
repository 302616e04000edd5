"""constant_fold: ops whose inputs are all compile-time constants run once, at load time.

Before:                                        After:
    def forward(idx, *, wpe_weight):               def forward(idx, *, wpe_weight):
        arange = aten.arange.start(0, 16)              # ---- constants ----
        pos = aten.embedding(wpe_weight, arange)       arange = aten.arange.start(0, 16)
                                                       # ---- forward ----
                                                       pos = aten.embedding(wpe_weight, arange)

Constants are literals, buffers that forward does not update (BatchNorm's running statistics
are read fresh on every call) and results of
deterministic ops on constants: `arange`, causal masks, rotary tables. Shape arithmetic is
already folded to literals by tracing with static shapes; ops whose arguments are dynamic sizes
(nncompile/symbolic.py) stay in the forward. The constant section is computed in
full on every rank when the generated module loads and the values the forward reads are kept
as non-persistent buffers, sliced like parameters when a policy shards them.
Precondition: none. Idempotent: yes.
"""
from __future__ import annotations

from torch.utils import _pytree as pytree

from nncompile.ir import BUFFER, CONST, Graph, Stage, Value
from nncompile.symbolic import Sym

from .contract import contract

_RANDOM = {"rand", "randn", "randint", "rand_like", "randn_like", "randint_like", "bernoulli",
           "dropout", "native_dropout", "multinomial", "normal", "uniform", "empty",
           "empty_like", "empty_strided", "randperm"}


@contract(produces=(Stage.FOLDED,))
def constant_fold(graph: Graph) -> Graph:
    g = graph.clone()
    g.stages = g.stages | {Stage.FOLDED}
    updated = set(g.trace_info.buffer_updates)
    const: set[int] = {id(v) for v in g.buffers if v.fqn not in updated}
    const |= {id(v) for op in g.const_ops for v in op.outputs}
    moved, kept = [], []
    for op in g.ops:
        name = getattr(op.target, "_opname", str(op.target))
        if name not in _RANDOM and not op.is_inplace and op.outputs \
                and all(id(v) in const for v in op.inputs()) \
                and not any(isinstance(a, Sym) for a in pytree.tree_leaves((op.args, op.kwargs))):
            # (an op on a dynamic size, `arange(s_seq)`, runs every call)
            moved.append(op)
            const |= {id(v) for v in op.outputs}
        else:
            kept.append(op)
    if not moved:
        return graph if Stage.FOLDED in graph.stages else g
    g.const_ops = g.const_ops + moved
    g.ops = kept
    used = {id(v) for op in kept for v in op.inputs()}
    used |= {id(v) for v in g.outputs if isinstance(v, Value)}
    for op in g.const_ops:
        for v in op.outputs:
            v.requires_grad = False
            v.kind = CONST if id(v) in used else "op"
    return g
