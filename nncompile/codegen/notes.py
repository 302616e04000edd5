"""The comments generated code carries about what is not in its lines: what each
collective's backward runs, the gradient reduction the runtime does after backward, and what
attention each SDPA call runs (passes/fuse_attention.py).

    # all_reduce P -> R: sum the partial results (backward: identity)
    h0_mlp_proj_linear_all_reduce = comm.all_reduce(h0_mlp_proj_linear, group=PLAN_GROUP)

    # Gradient reduction after backward (runtime/program/reducer.py, not a line of forward_impl):
    #   partial-sum gradients: summed over PLAN_GROUP (the plan unit, 2 ranks): 8 tensors, ...

Both are deterministic functions of the plan, so two compiles write identical files.
"""
from __future__ import annotations

import math
from typing import Any

from ..collectives import axis_of, of_target
from ..comm_stats import fmt_bytes
from ..ir import Graph, Op
from ..mesh import DP, PLAN, PP, Mesh, grad_reduction

DEFAULT_BUCKET_CAP_MB = 25.0       # ComputeConfig.reducer_bucket_cap_mb's default

# what the forward does, per kind (the backward comes from the collective table)
FORWARD = {
    "all_reduce": "sum the partial results",
    "chunk": "keep this rank's slice, no communication",
    "all_gather": "gather the slices",
    "reduce_scatter": "sum the partial results, keep this rank's slice",
    "all_to_all": "exchange slices",
    "to_partial": "rank 0 keeps the value, the others zeros; no communication",
    "sync_grad": "identity in forward",
}
# local implementations of split ops (a strategy's local_target), what they do
LOCAL = {
    "cross_entropy_rows": "this rank's rows, the count of targets all-reduced over {group}",
    "attention_rows": "this rank's query rows against every key and value, a causal mask "
                      "shifted by the rows before them",
    "local_moe": "the picks of this rank's experts, zeros for the rest",
    "dispatch_moe": "each pick sent to the rank of its expert and back: all-to-all over "
                    "{group}, counts first",
}
# the backward of a local implementation where it communicates
LOCAL_BACKWARD = {"dispatch_moe": "the same all-to-alls reversed"}
BACKWARD = {
    "identity": "identity",
    "all_reduce": "all_reduce of the gradient",
    "all_gather": "all_gather of the gradient",
    "chunk": "chunk of the gradient, no communication",
    "reduce_scatter": "reduce_scatter of the gradient",
    "all_to_all": "all_to_all of the gradient",
}


def comm_note(op: Op) -> list[str]:
    """One comment line above a comm op: its kind, placements, what it does and its backward
    dual; above an attention op, what attention it runs (passes/fuse_attention.py); [] for
    any other op."""
    target = op.target_name
    if not target.startswith("comm."):
        form = op.attrs.get("attention")
        part = op.attrs.get("unfused")             # passes/unfuse_projections.py
        return [f"attention: {form}"] if form else [part] if part else []
    kind = target[len("comm."):]
    axis = axis_of(op)
    ins, outs = op.tensor_inputs(), [v for v in op.outputs if v.is_tensor]
    move = f" {ins[0].placement_on(axis)!r} -> {outs[0].placement_on(axis)!r}" \
        if ins and outs else ""
    if axis != PLAN:
        move += f" along {axis}"
    grad = bool(outs) and outs[0].requires_grad
    c = of_target(target)
    if c is None:              # a local implementation that communicates
        group = str(op.kwargs.get("group", "PLAN_GROUP"))
        what = LOCAL.get(kind, "a local implementation").format(group=group)
        back = LOCAL_BACKWARD.get(kind, "local, no communication")
        return [f"{kind}{move}: {what} ({f'backward: {back}' if grad else 'no backward'})"]
    back = c.backward_kind(bool(op.kwargs.get("reduce_grad")))
    what = FORWARD.get(kind, c.forward or "no forward work")
    linears = op.kwargs.get("linears")
    if linears:                # passes/overlap_grad_sync.py
        move = f" {ins[0].placement!r} -> R"
        what += f", then the {len(linears)} column-split linear(s) it feeds"
        parts: dict[str, list[str]] = {}      # passes/unfuse_projections.py: per piece
        for w, *_ in linears:
            if getattr(w, "part", None) is not None:
                parts.setdefault(w.part.source, []).append(w.fqn[len(w.part.source):])
        for source, idx in parts.items():
            what += f"; parts {', '.join(idx)} of the fused {source}"
        back = f"{back} of the input gradient, overlapped with the weight gradients"
    if not grad:
        return [f"{kind}{move}: {what} (no backward: no gradient flows here)"]
    return [f"{kind}{move}: {what} (backward: {BACKWARD.get(back, back)})"]


def _group(dims: tuple[str, ...], mesh: Mesh) -> str:
    size = math.prod(mesh.size(d) for d in dims)
    if dims == (PLAN,):
        return f"PLAN_GROUP ({'one stage' if PP in dict(mesh.dims) else 'the plan unit'}, " \
               f"{size} ranks)"
    if dims == (DP,):
        return f"the data-parallel group ({size} ranks)"
    if PLAN not in dims:
        return f"the {' x '.join(dims)} ranks ({size} ranks)"
    return f"the plan unit's ranks across the data-parallel units ({size} ranks)"


def reduction_header(g: Graph, params: list[tuple], runtime_ngpus: int, pipe_ranks: int = 1,
                     zero: int = 0, indent: str = "    ") -> str:
    """Class-body comment lines: which gradients the runtime reduces over which group, how
    many tensors and bytes this rank sends into each, in how many buckets at the default cap.
    `params`: the rank's PARAMS rows (local name, FQN, full shape, placement, slices,
    partial grad)."""
    head = f"{indent}# Gradient reduction after backward (runtime/program/reducer.py, not a line of " \
           "forward_impl):"
    if g.trace_info.inference_only:
        return f"{head}\n{indent}#   none: inference only\n"
    if zero == 3:
        return (f"{head}\n{indent}#   ZeRO-3: each unit's gradient is reduce-scattered in "
                "the backward of its gather (runtime/store/zero.py), no bucketed reducer\n")
    mesh = Mesh.of(g.plan_ngpus, runtime_ngpus, pipe_ranks, g.axes)
    axis_partial = g.plan_state.axis_partial_grad
    dtypes = {v.name: v.meta.dtype for v in g.params}
    trainable = {v.name for v in g.params if v.requires_grad}
    groups: dict[tuple, dict[str, Any]] = {}
    cap = DEFAULT_BUCKET_CAP_MB * 2 ** 20
    for name, _fqn, _shape, _place, slices, partial, *_ in reversed(params):
        red = grad_reduction(mesh, bool(partial), name in trainable,
                             tuple(a for a, names in axis_partial.items() if name in names))
        if red is None:
            continue
        dtype = dtypes[name]
        nbytes = math.prod(b - a for a, b in slices) * dtype.itemsize
        e = groups.setdefault((bool(partial), red.dims, red.scale), {
            "tensors": 0, "bytes": 0, "buckets": {}})
        e["tensors"] += 1
        e["bytes"] += nbytes
        filled = e["buckets"].setdefault(dtype, [0])      # bytes of each bucket of a dtype
        if filled[-1] >= cap:
            filled.append(0)
        filled[-1] += nbytes
    lines = [head]
    for (partial, dims, scale), e in sorted(groups.items(), key=lambda kv: not kv[0][0]):
        what = "partial-sum gradients" if partial else "the other trainable gradients"
        how = "summed" if scale == 1 else f"averaged (x {scale:g})"
        buckets = sum(len(b) for b in e["buckets"].values())
        lines.append(f"#   {what}: {how} over {_group(dims, mesh)}: {e['tensors']} tensors, "
                     f"{e['bytes']:,} B ({fmt_bytes(e['bytes'])}) from this rank, "
                     f"{buckets} bucket(s) at the default cap")
    if len(lines) == 1:
        lines.append("#   none: one data-parallel unit and no partial-sum gradients")
    else:
        lines.append("#   each group's gradients go in reverse parameter order into flat "
                     "buckets of reducer_bucket_cap_mb")
        lines.append(f"#   ({DEFAULT_BUCKET_CAP_MB:g} MiB by default), one all_reduce per "
                     "bucket; use_async_reducer overlaps them with backward")
    return "\n".join(lines[:1] + [indent + ln for ln in lines[1:]]) + "\n"
