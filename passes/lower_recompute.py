"""lower_recompute: each checkpoint region as explicit begin / end ops of the IR.

The recompute pass marked the ops of `recompute_modules` (op.recompute); this pass makes each
maximal run of one mark a region with what goes in and what comes out, which codegen prints as
a closure run under `torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`: its
activations are recomputed in backward instead of kept.

Before (ops marked transformer.h.0):             After:
    ln = aten.layer_norm.default(x, ..., w, b)       checkpoint.begin('transformer.h.0', [x])
    y = aten.linear.default(ln, w2)                  ln = aten.layer_norm.default(x, ..., w, b)
    out = aten.add.Tensor(x, y)                      y = aten.linear.default(ln, w2)
                                                     checkpoint.end('transformer.h.0', [y])
                                                     out = aten.add.Tensor(x, y)

A region's arguments are the values its ops read from outside it, except parameters, buffers
and constants (attributes of the module) — under ZeRO-3 parameters are gathered locals, so
those gathered outside are arguments and those gathered inside (zero.gather in the region)
are not; it returns what later ops of its program (or the program's outputs, or its stage's
sends) read of what it computes. Precondition: recompute marks (and lower_zero3, which puts
gathers inside regions, before it). Idempotent: yes.
"""
from __future__ import annotations

from nncompile.ir import Graph, Op, Stage, Value
from .lower_zero3 import runs_of
from .split_stages import SEND

BEGIN, END = "checkpoint.begin", "checkpoint.end"


def region_io(g: Graph, ops: list[Op], later: list[Op], outputs: list) -> tuple[list, list]:
    """(arguments, returned values) of the region `ops`, followed in its program by `later`
    (up to and including its stage's pipeline.send) and returning `outputs`."""
    gathered = {id(v) for op in ops if op.target == "zero.gather" for v in op.args[2]}
    inside = {id(v) for op in ops for v in op.outputs} | gathered
    attrs = {id(v) for v in g.buffers + g.consts +
             ([] if Stage.ZERO3_LOWERED in g.stages else g.params)}
    args = list({id(v): v for op in ops if not op.is_structural for v in op.inputs()
                 if id(v) not in inside and id(v) not in attrs}.values())
    used: list[Value] = []
    for op in later:
        if op.target == SEND:
            used += op.args[1]
            break
        if not op.is_structural:
            used += op.inputs()
    else:
        used += [v for v in outputs if isinstance(v, Value)]
    outs = list({id(v): v for v in used if id(v) in inside and id(v) not in gathered}.values())
    return args, outs


def lower_recompute(graph: Graph) -> Graph:
    """The pass (see the module docstring)."""
    if Stage.RECOMPUTE_LOWERED in graph.stages:
        return graph
    g = graph.clone()
    runs = runs_of(g.ops)
    out: list[Op] = []
    at = 0
    for mark, ops in runs:
        at += len(ops)
        if mark is None:
            out += ops
            continue
        args, outs = region_io(g, ops, g.ops[at:], g.outputs)
        begin = Op(BEGIN, (mark.module_path, args), {}, [])
        end = Op(END, (mark.module_path, outs), {}, [])
        for m in (begin, end):
            m.recompute, m.stage = mark, ops[0].stage
        out += [begin, *ops, end]
    g.ops = out
    g.stages = g.stages | {Stage.RECOMPUTE_LOWERED}
    return g


lower_recompute.requires = (Stage.RECOMPUTE_MARKED,)
lower_recompute.produces = (Stage.RECOMPUTE_LOWERED,)
