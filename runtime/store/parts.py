"""Parts of a fused parameter, assembled back into the original parameter across a plan unit.

The compiler may hold one original parameter as several parameters (*parts*, rows with
`part` set, nncompile/rows.py): nanoGPT's `c_attn.weight` [3C, C] as q, k, v rows [C, C] each,
split by heads. Every boundary with the original module shows the original tensor:

    rank 0: c_attn.weight[0/3] rows 0:C/2, [1/3] rows C:C+C/2, [2/3] rows 2C:2C+C/2
    rank 1: the other halves
    assemble_sources -> {"c_attn.weight": [3C, C]} on every rank of the plan unit

Each rank writes its parts into a zero tensor of the source's shape (a replicated part only
on the plan unit's first rank) and the plan group sums them: one all-reduce per source.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from nncompile.rows import ParamRow, put


def plan_index(pm) -> int:
    """This rank's index inside its plan unit (0 without a plan group)."""
    return dist.get_rank(pm.plan_group) if pm.plan_group is not None else 0


def sources_of(rows: list[ParamRow]) -> dict[str, list[ParamRow]]:
    """{source FQN: its part rows} of the rows that are parts, in row order."""
    out: dict[str, list[ParamRow]] = {}
    for row in rows:
        if row.part is not None:
            out.setdefault(row.source, []).append(row)
    return out


def assemble_sources(pm, rows: list[ParamRow], local: dict[str, torch.Tensor | None]
                     ) -> dict[str, torch.Tensor | None]:
    """{source FQN: full original tensor} from this rank's part tensors by local name (a
    collective over the plan group: every rank of the unit calls it; None where a part's
    tensor is None, as a frozen parameter's gradient)."""
    out: dict[str, torch.Tensor | None] = {}
    first = plan_index(pm) == 0
    for source, parts in sources_of(rows).items():
        tensors = [local.get(r.name) for r in parts]
        if any(t is None for t in tensors):
            out[source] = None
            continue
        full = tensors[0].new_zeros(parts[0].source_shape)
        for r, t in zip(parts, tensors):
            if r.sharded or first:
                put(r, full, t.detach())
        if pm.plan_group is not None:
            dist.all_reduce(full, group=pm.plan_group)
        out[source] = full
    return out
