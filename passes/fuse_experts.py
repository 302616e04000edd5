"""fuse_experts: a mixture-of-experts layer's experts become one op, so a rule can split
them (nncompile/experts.py, nncompile/rules/experts.py).

FuseMoELayers: each experts module of Hugging Face's interface (nncompile.experts
.experts_forms, confirmed against its own forward at compile time) traces as one region of
ops, whatever its implementation (grouped products, a loop over experts, masked rows); the
region becomes moe_experts, which a rule can split by tokens and by experts:

Before (the ops of module model.layers.0.mlp.experts):   After:
    v = aten.view.default(top_k_index, [-1])                 y = nncompile.moe_experts(
    s, order = aten.sort.default(v)                              x, top_k_index,
    ... grouped_mm, split, silu, mul, grouped_mm, ...            top_k_weights, gate_up_proj,
    y = aten.sum.dim_IntList(..., [1])                           down_proj, 'silu', False)

The region's inputs must be the interface's three tensors and the two weights, its output
one tensor [tokens, hidden]; otherwise it runs as traced.

fuse_experts (below): a custom MoE's gated expert MLP as grouped products.

Hugging Face's batched experts (Mixtral, Qwen3-MoE, DeepSeek-V3 under the default
"grouped_mm" implementation) trace as two grouped matrix products around a gated
activation:

Before:                                              After:
    h = grouped_mm(x, w_in, offs)  # [S, 2I]             y = nncompile.experts_mlp(
    a, b = aten.split.Tensor(h, I, -1)                       x, w_in, w_out, offs,
    c = aten.silu.default(a)                                 'transformers::grouped_mm_fallback',
    d = aten.mul.Tensor(c, b)                                'silu')
    y = grouped_mm(d, w_out, offs)  # [S, H]

The match needs each intermediate read only by the next op of the chain, the same `offs`
for both products, an even split of the last dim and an activation experts_mlp knows
(silu, gelu, relu). A custom MoE that computes its experts the same way (grouped_mm, or
torch._grouped_mm in bfloat16) is fused too; any other form runs as traced, its experts
replicated along the plan. Precondition: none (before the plan). Idempotent: yes.
"""
from __future__ import annotations

from nncompile.experts import EXPERTS_MLP, MOE_EXPERTS, ExpertsForm
from nncompile.ir import PARAM, Graph, Op, Shard, Value
from nncompile.log import log

from .contract import contract

GROUPED_MM = ("transformers::grouped_mm_fallback", "aten::_grouped_mm")
_ACT = {"silu": "silu", "gelu": "gelu", "relu": "relu"}


def _qualname(op: Op) -> str:
    t = op.target
    return f"{getattr(t, 'namespace', '')}::{getattr(t, '_opname', '')}"


def _only_user(v: Value, users: dict) -> Op | None:
    us = users.get(v, [])
    return us[0] if len(us) == 1 else None


def _match(op: Op, users: dict, outputs: set[int]) -> tuple[list[Op], tuple, str] | None:
    """(the five ops, experts_mlp's tensor args, activation) of a chain starting at `op`."""
    if _qualname(op) not in GROUPED_MM or len(op.args) < 3 or op.kwargs:
        return None
    x, w_in, offs = op.args[:3]
    h = op.outputs[0]
    split = _only_user(h, users)
    if split is None or getattr(split.target, "_opname", "") != "split" or \
            len(split.outputs) != 2 or split.args[1] * 2 != h.meta.shape[-1] or \
            (len(split.args) > 2 and split.args[2] not in (-1, len(h.meta.shape) - 1)):
        return None
    a, b = split.outputs
    act = _only_user(a, users)
    if act is None or _ACT.get(getattr(act.target, "_opname", "")) is None or \
            len(act.args) != 1 or act.kwargs:
        return None
    mul = _only_user(act.outputs[0], users)
    if mul is None or getattr(mul.target, "_opname", "") != "mul" or \
            list(mul.args) != [act.outputs[0], b] or _only_user(b, users) is not mul:
        return None
    down = _only_user(mul.outputs[0], users)
    if down is None or _qualname(down) != _qualname(op) or down.args[0] is not mul.outputs[0] \
            or down.args[2] is not offs or down.kwargs:
        return None
    chain = [op, split, act, mul, down]
    if any(id(v) in outputs for o in chain[:-1] for v in o.outputs):
        return None
    return chain, (x, w_in, down.args[1], offs), _ACT[act.target._opname]


@contract()
def fuse_experts(graph: Graph) -> Graph:
    if not any(_qualname(op) in GROUPED_MM for op in graph.ops):
        return graph
    g = graph.clone()
    users = g.users()
    outputs = {id(v) for v in g.outputs if isinstance(v, Value)}
    fused: dict[int, Op] = {}                   # id(last op of a chain) -> the new op
    gone: set[int] = set()
    for op in g.ops:
        if id(op) in gone:
            continue
        found = _match(op, users, outputs)
        if found is None:
            continue
        chain, args, act = found
        out = chain[-1].outputs[0]
        prefix = op.name.rsplit("_grouped_mm", 1)[0]
        out.name = g.fresh_name(prefix + ("_mlp" if prefix.endswith("_experts") else
                                          "_experts_mlp"))
        new = Op(EXPERTS_MLP, (*args, _qualname(op), act), {}, [out], op.source,
                 op.module_path)
        new.module_stack, new.stage, new.recompute = op.module_stack, op.stage, op.recompute
        fused[id(chain[-1])] = new              # where all its inputs exist
        gone |= {id(o) for o in chain}
    if not fused:
        return graph
    g.ops = [fused.get(id(op), op) for op in g.ops
             if id(op) in fused or id(op) not in gone]
    return g


def _region(g: Graph, fqn: str) -> list[Op]:
    """The ops run inside module `fqn`, under any path that reached it (a shared module)."""
    aliases = g.trace_info.module_aliases
    return [op for op in g.ops
            if any(aliases.get(path, path) == fqn
                   for path, _ in (getattr(op, "module_stack", None) or ()))]


def _calls(ops: list[Op]) -> list[list[Op]]:
    """A module's region split into its calls: the groups of its ops joined by the values
    they pass each other (one experts module applied twice, its weights shared, is two
    calls, each read from outside only through its inputs), in graph order."""
    made = {id(v): i for i, op in enumerate(ops) for v in op.outputs}
    parent = list(range(len(ops)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i
    for i, op in enumerate(ops):
        for v in op.tensor_inputs():
            if id(v) in made:
                parent[root(i)] = root(made[id(v)])
    calls: dict[int, list[Op]] = {}
    for i, op in enumerate(ops):
        calls.setdefault(root(i), []).append(op)
    return list(calls.values())


def _region_io(g: Graph, fqn: str, ops: list[Op], users: dict, outputs: set[int]):
    """(x, top_k_index, top_k_weights, w_in, w_out, output) of an experts module's region, or
    a reason it does not fit."""
    made = {id(v) for op in ops for v in op.outputs}
    inside = {id(op) for op in ops}
    external = []
    for op in ops:
        for v in op.tensor_inputs():
            if id(v) not in made and v.kind not in ("const",) and v not in external:
                external.append(v)
    weights = {v.fqn: v for v in external if v.kind == PARAM}
    w_in, w_out = weights.get(f"{fqn}.gate_up_proj"), weights.get(f"{fqn}.down_proj")
    rest = [v for v in external if v.kind != PARAM]
    if w_in is None or w_out is None or len(weights) != 2 or len(rest) != 3:
        return f"reads {[v.name for v in external]}, not 3 tensors and its 2 weights"
    index = [v for v in rest if not v.meta.dtype.is_floating_point]
    floats = [v for v in rest if v.meta.dtype.is_floating_point]
    if len(index) != 1 or len(floats) != 2:
        return "its inputs are not hidden states, integer picks and float weights"
    index = index[0]
    tokens, k = index.meta.shape[0], index.meta.shape[-1]
    xs = [v for v in floats if tuple(v.meta.shape[:1]) == (tokens,) and v.meta.shape[-1] != k]
    if len(xs) != 1:
        return "its hidden states and routing weights cannot be told apart"
    x = xs[0]
    weights_in = next(v for v in floats if v is not x)
    leaving = [v for op in ops for v in op.outputs
               if id(v) in outputs or any(id(u) not in inside for u in users.get(v, []))]
    if len(leaving) != 1 or tuple(leaving[0].meta.shape) != tuple(x.meta.shape):
        return f"{len(leaving)} values leave it, not one shaped like its input"
    return x, index, weights_in, w_in, w_out, leaving[0]


@contract()
def fuse_moe_layers(graph: Graph, forms: dict[str, ExpertsForm]) -> Graph:
    g = graph.clone()
    users = g.users()
    outputs = {id(v) for v in g.outputs if isinstance(v, Value)}
    fused: dict[int, Op] = {}                   # id(last op of a region) -> the new op
    gone: set[int] = set()
    for fqn, form in forms.items():
        for ops in _calls(_region(g, fqn)):     # a module called twice: two regions
            io = _region_io(g, fqn, ops, users, outputs)
            if isinstance(io, str):
                log(f"fuse_experts: {fqn} runs as traced: {io}")
                continue
            *args, out = io
            last = ops[-1]
            out.name = g.fresh_name(args[3].name.rsplit("_gate_up_proj", 1)[0] + "_out")
            new = Op(MOE_EXPERTS, (*args, form.act, form.transposed), {}, [out], last.source,
                     fqn)
            new.module_stack, new.stage, new.recompute = last.module_stack, last.stage, \
                last.recompute
            fused[id(last)] = new
            gone |= {id(o) for o in ops}
    if not fused:
        return graph
    g.ops = [fused.get(id(op), op) for op in g.ops if id(op) in fused or id(op) not in gone]
    return g


def experts_rows(g: Graph) -> list[dict]:
    """plan.json "experts": each mixture-of-experts layer, how it runs and the bytes one rank
    sends per all-to-all under dispatch (picks spread evenly; nncompile/rules/experts.py)."""
    from nncompile.rules.experts import DISPATCH, LOCAL, dispatch_bytes
    rows, ep = [], g.axes.get("ep", 1)
    for op in g.ops:
        if op.target is not MOE_EXPERTS and op.target_name not in (DISPATCH, LOCAL):
            continue
        experts = op.args[3].meta.shape[0]
        note = op.strategy.note if op.strategy else "replicate"
        if ep > 1:                  # along the ep axis (the tokens maybe split on the plan's)
            tokens_split = g.plan_ngpus if isinstance(op.args[0].placement, Shard) else 1
            rows.append({"module": op.module_path, "op": op.name,
                         "strategy": f"dispatch along ep ({experts // ep} per rank); {note}",
                         "experts": experts, "experts_per_rank": experts // ep,
                         "all_to_all_bytes_per_rank": dispatch_bytes(op, ep, ep * tokens_split)})
            continue
        split = op.target_name in (DISPATCH, LOCAL) or isinstance(op.args[3].placement, Shard)
        rows.append({"module": op.module_path, "op": op.name, "strategy": note,
                     "experts": experts,
                     "experts_per_rank": experts // g.plan_ngpus if split else experts,
                     "all_to_all_bytes_per_rank": dispatch_bytes(op, g.plan_ngpus)
                     if op.target_name == DISPATCH else 0})
    return rows


class FuseMoELayers:
    name = "fuse_moe_layers"
    requires = produces = ()
    quiet_when_unchanged = True

    def __init__(self, forms: dict[str, ExpertsForm]):
        self.forms = forms

    def __call__(self, graph: Graph) -> Graph:
        return fuse_moe_layers(graph, self.forms)


class FuseExperts:
    name = "fuse_experts"
    requires = produces = ()
    quiet_when_unchanged = True      # run_pipeline lists it only when it fused a layer

    def __call__(self, graph: Graph) -> Graph:
        return fuse_experts(graph)


__all__ = ["fuse_experts", "FuseExperts", "fuse_moe_layers", "FuseMoELayers",
           "experts_rows", "GROUPED_MM"]
