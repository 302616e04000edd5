"""ZeRO-3 in the generated forward: per-unit gathers, prefetches and frees as ordinary lines.

Before (use_zero=1: parameters are attributes of the module):

    h_0_ln_w = ...                       # (nothing: self.h_0_ln_w is always there)
    layer_norm = aten.layer_norm.default(x, [32], self.h_0_ln_w, self.h_0_ln_b)

After (use_zero=3: one flat shard per unit, gathered right before its first use):

    comm.zero_prefetch(self.zero_h_0, group=ZERO)
    ...
    h_0_ln_w, h_0_ln_b, h_0_fc_w = comm.zero_gather(self.zero_h_0, group=ZERO)
    comm.zero_prefetch(self.zero_h_1, group=ZERO)      # the next unit's gather starts now
    layer_norm = aten.layer_norm.default(x, [32], h_0_ln_w, h_0_ln_b)
    ...
    del h_0_ln_w, h_0_ln_b, h_0_fc_w                   # after the unit's last use

Activations are deleted at their last use as in any forward (lifetimes.py), on their own
`del` line before the unit's.

A unit is a block of a ModuleList (the path up to its first numeric component, like
`transformer.h.3`), else the module owning the parameter; its parameters are split further by
dtype, trainability and placement so that one flat tensor has one reduction. A unit used only
inside one recomputed region is gathered inside the checkpointed closure, so backward's
recompute gathers it again; prefetches are issued outside closures only.
"""
from __future__ import annotations

from nncompile.ir import Graph, Value
from nncompile.ir.printer import fmt_body


def unit_path(fqn: str) -> str:
    """`transformer.h.3.attn.c_attn.weight` -> `transformer.h.3`; `lm_head.weight` ->
    `lm_head`; a root parameter `scale` -> `root`."""
    parts = fqn.split(".")
    for i, p in enumerate(parts[:-1]):
        if p.isdigit():
            return ".".join(parts[:i + 1])
    return ".".join(parts[:-1]) or "root"


def zero_units(g: Graph) -> list[tuple[str, str, list[Value]]]:
    """(flat attribute, unit path, parameters) in order of first use in the forward;
    parameters no op uses come last."""
    first: dict[int, int] = {}
    for i, op in enumerate(g.ops):
        for v in op.inputs():
            first.setdefault(id(v), i)
    partial = set(g.plan_state.partial_grad_params)
    groups: dict[tuple, list[Value]] = {}
    for v in sorted(g.params, key=lambda v: first.get(id(v), len(g.ops))):
        key = (unit_path(v.fqn), str(v.meta.dtype), v.requires_grad,
               type(v.placement).__name__, v.name in partial)
        groups.setdefault(key, []).append(v)
    out, taken = [], set()
    for key, values in groups.items():
        base = "zero_" + "".join(c if c.isalnum() else "_" for c in key[0])
        attr, k = base, 1
        while attr in taken:
            attr, k = f"{base}_{k}", k + 1
        taken.add(attr)
        out.append((attr, key[0], values))
    return out


def zero_forward_body(g: Graph, units, indent: str, local_n: int) -> list[str]:
    """The forward with each unit gathered before its first use, the next unit prefetched,
    and the unit's names deleted after its last use (see the module docstring)."""
    from .codegen import closure, runs_of
    from .lifetimes import body_frees, closure_io, del_lines, statement_frees
    runs = runs_of(g)
    frees = statement_frees(g, runs, param_attrs=False)    # activations (lifetimes.py)
    k = 0                                                   # top-level statement index
    run_of: dict[int, int] = {}
    index = 0
    for r, (_, ops) in enumerate(runs):
        for _ in ops:
            run_of[index] = r
            index += 1
    unit_of = {id(v): u for u, (_, _, vs) in enumerate(units) for v in vs}
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for i, op in enumerate(g.ops):
        for v in op.inputs():
            if id(v) in unit_of:
                u = unit_of[id(v)]
                first.setdefault(u, i)
                last[u] = i
    for v in g.outputs:
        if isinstance(v, Value) and id(v) in unit_of:
            last[unit_of[id(v)]] = len(g.ops)          # returned: never freed here
    order = sorted(first, key=first.get)
    nxt = {u: order[k + 1] for k, u in enumerate(order[:-1])}
    inside = {u for u in order if runs[run_of[first[u]]][0] is not None and
              last[u] < len(g.ops) and run_of[first[u]] == run_of[last[u]]}

    def gather(u: int, ind: str) -> list[str]:
        attr, path, values = units[u]
        names = ", ".join(v.name for v in values) + ("," if len(values) == 1 else "")
        return [f"{ind}# ZeRO-3 unit {path}: gather its {len(values)} parameter(s) over the "
                f"data-parallel ranks",
                f"{ind}{names} = comm.zero_gather(self.{attr}, group=ZERO)"]

    def prefetch(u: int | None, why: str = "its gather runs while this one computes"
                 ) -> list[str]:
        if u is None:
            return []
        return [f"{indent}comm.zero_prefetch(self.{units[u][0]}, group=ZERO)  # next unit "
                f"{units[u][1]}: {why}"]

    def free(u: int) -> list[str]:
        return [f"{indent}del {', '.join(v.name for v in units[u][2])}  # ZeRO-3: unit "
                f"{units[u][1]} is freed (gathered again in backward)"]

    lines = prefetch(order[0], "the first gather starts now") if order else []
    starts = {}
    for u in order:
        starts.setdefault(first[u], []).append(u)
    ends = {}
    for u in order:
        if last[u] < len(g.ops):
            ends.setdefault(last[u], []).append(u)
    index = 0
    for r, (mark, ops) in enumerate(runs):
        lo, hi = index, index + len(ops)
        index = hi
        if mark is None:
            for i, op in zip(range(lo, hi), ops):
                for u in starts.get(i, []):
                    lines += gather(u, indent) + prefetch(nxt.get(u))
                lines += fmt_body([op], indent=indent, local_n=local_n,
                                  source=op.source != (g.ops[i - 1].source if i else None))
                lines += del_lines(frees[k], indent)
                k += 1
                for u in ends.get(i, []):
                    lines += free(u)
            continue
        args, outs = closure_io(g, runs, r, param_attrs=False)
        inner = body_frees(g, ops, args, outs)
        body, defined = [], set()
        for i, op in zip(range(lo, hi), ops):
            for u in starts.get(i, []):
                if u in inside:
                    lines += prefetch(nxt.get(u))
                    body += gather(u, indent + "    ")
                    defined |= {id(v) for v in units[u][2]}
                else:
                    lines += gather(u, indent) + prefetch(nxt.get(u))
            body += fmt_body([op], indent=indent + "    ", local_n=local_n,
                             source=op.source != (g.ops[i - 1].source if i else None))
            body += del_lines(inner[i - lo], indent + "    ")
        lines += closure(g, runs, r, indent, body, defined_inside=defined, param_attrs=False)
        lines += del_lines(frees[k], indent)
        k += 1
        for i in range(lo, hi):
            for u in ends.get(i, []):
                if u not in inside:
                    lines += free(u)
    return lines

