"""What the generated program communicates: one row per inserted collective, with its backward
dual and the bytes each rank moves, and the gradient reduction the runtime adds per step.

Bytes are payload bytes per rank, each kind's `payload` in nncompile/collectives.py: the size
of the tensor a collective reduces, gathers into, scatters from or exchanges (a ring all-reduce
puts about twice that on the wire). Local steps (chunk, to_partial, identity) move nothing.
A comm op with no table entry, a local implementation with a scalar reduction inside
(cross_entropy_rows: one all-reduced count of the targets, no gradient), is a row too, so
`plan.json`'s `collectives` (count by kind) and its `collective_ops` rows always agree.
"""
from __future__ import annotations

from typing import Any

from .ir import Graph
from nncompile.ir.placement import nbytes
from nncompile.collectives import axis_of, by_name, of_target


def collective_rows(g: Graph) -> list[dict[str, Any]]:
    """Every collective of a graph after insert_comm, in program order."""
    n = g.plan_ngpus
    training = not g.trace_info.inference_only
    rows = []
    for op in g.ops:
        if not op.target_name.startswith("comm."):
            continue
        c = of_target(op.target_name)
        x, out = op.tensor_inputs()[0], op.outputs[0]
        axis = axis_of(op)                               # the mesh axis it runs along
        size = n if axis == "plan" else g.axes.get(axis, 1)
        full, local = int(nbytes(x)), int(nbytes(x, x.placement_on(axis), size))
        if c is None:                     # cross_entropy_rows: all-reduces one scalar count
            kind, fwd, back, bwd = op.target_name[len("comm."):], out.meta.dtype.itemsize, \
                "identity", 0
        else:
            kind, fwd = c.name, c.payload(full, local, size)
            back = c.backward_kind(bool(op.kwargs.get("reduce_grad")))
            bwd = 0 if back == "-" else by_name(back).payload(full, local, size)
        if not (training and out.requires_grad):
            back, bwd = "-", 0
        # a collective fused with the linears it feeds (overlap_grad_sync) ends replicated
        to = "R" if op.kwargs.get("linears") else repr(out.placement_on(axis))
        rows.append({"name": out.name, "kind": kind, "input": x.name,
                     **({"axis": axis} if axis != "plan" else {}),
                     "from": repr(x.placement_on(axis)), "to": to,
                     "shape": list(x.meta.shape), "dtype": str(x.meta.dtype).replace("torch.", ""),
                     "forward_bytes": fwd, "backward": back, "backward_bytes": bwd,
                     "module": op.module_path,
                     "source": str(op.source) if op.source else None})
    return rows


def count_by_kind(rows: list[dict[str, Any]]) -> dict[str, int]:
    """{kind: count} of the rows, most frequent first (ties in program order): the one count
    `nncompile show` and `diff` print, so the totals and the kinds always agree."""
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["kind"]] = counts.get(r["kind"], 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def fmt_bytes(b: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(b) < 1024 or unit == "GiB":
            return f"{b:.0f} {unit}" if unit == "B" else f"{b:.1f} {unit}"
        b /= 1024
    return f"{b:.1f} GiB"


def format_rows(rows: list[dict[str, Any]]) -> str:
    """The collectives as an aligned text table with a total line."""
    head = ("collective", "value", "placement", "shape", "fwd bytes", "backward", "bwd bytes")
    body = [(r["kind"], r["input"], f"{r['from']} -> {r['to']}"
             + (f" @{r['axis']}" if r.get("axis") else ""), "x".join(map(str, r["shape"])),
             fmt_bytes(r["forward_bytes"]), r["backward"], fmt_bytes(r["backward_bytes"]))
            for r in rows]
    total = ("total", f"{len(rows)} collectives", "", "",
             fmt_bytes(sum(r["forward_bytes"] for r in rows)), "",
             fmt_bytes(sum(r["backward_bytes"] for r in rows)))
    return "\n".join(align([head] + body + [total], indent=""))


def align(rows: list[tuple], indent: str = "  ") -> list[str]:
    """Rows of cells as left-aligned text columns."""
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    return [indent + "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()
            for r in rows]
