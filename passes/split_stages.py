"""split_stages: the pipelined forward cut into stage programs, in the IR.

pipeline_stages chose the cut (which layers each stage runs, `op.stage`); this pass makes it
the program: each stage's ops between a `pipeline.stage` op (what the stage receives) and a
`pipeline.send` op (what it sends on; `relay=`: values it only passes through, since a stage
talks to its neighbours only). Codegen prints each run as the rank's `stage_<k>` method.

Before (op.stage set, one forward):              After:
    add_7 = aten.add.Tensor(x, h)                    pipeline.stage(0, [idx, targets])
    ...                                              add_7 = aten.add.Tensor(x, h)
    loss = aten.nll_loss...(logits, targets)         pipeline.send(0, [add_7, targets])
                                                     pipeline.stage(1, [add_7, targets])
                                                     ...
                                                     loss = aten.nll_loss...(logits, targets)
                                                     pipeline.send(1, [loss])

A stage's inputs are the values it needs from earlier stages (stage 0: every input of the
model); its outputs are what later stages need, the last stage's the loss. Collectives
inserted after the cut run in the stage of their first consumer. A stage that reads a value
computed by a later one (layers that do not run in order) is a GraphError naming both.
Precondition: localize (the program each rank runs). Idempotent: yes.
"""
from __future__ import annotations

from nncompile.errors import ConfigError, GraphError
from nncompile.ir import Graph, Op, Stage, Value

STAGE, SEND = "pipeline.stage", "pipeline.send"


def loss_value(g: Graph) -> Value:
    """The loss the pipeline trains on: the first scalar floating-point output of forward."""
    for v in g.outputs:
        if isinstance(v, Value) and v.is_tensor and v.meta.dtype.is_floating_point and \
                len(v.meta.shape) == 0:
            return v
    outs = [f"{v.name}: {v.meta.dtype}{list(v.meta.shape)}" for v in g.outputs
            if isinstance(v, Value) and v.is_tensor]
    raise ConfigError(
        f"a pipelined plan trains on forward's loss, but {g.trace_info.model}.forward returns "
        f"no scalar floating-point tensor ({', '.join(outs) or 'no tensors'}); return the loss "
        "(alone or first among the outputs), e.g. pass labels/targets to forward")


def fill_stages(g: Graph) -> None:
    """Ops added after the cut (collectives) run in the stage of their first consumer."""
    users = g.users()
    for op in reversed(g.ops):
        if op.stage is None:
            cons = [u.stage for v in op.outputs for u in users.get(v, []) if u.stage is not None]
            prods = [v.producer.stage for v in op.inputs()
                     if getattr(v, "producer", None) is not None and v.producer.stage is not None]
            op.stage = min(cons) if cons else max(prods, default=0)


def stage_graphs(g: Graph) -> list[Graph]:
    """One graph per stage of a graph that is cut (op.stage) but not yet split, sharing g's
    Values: inputs from earlier stages, outputs for later ones (relays included, in
    `relayed`), the last stage's output the loss."""
    pp = g.plan_state.pipeline
    fill_stages(g)
    k = pp.nstages
    loss = loss_value(g)
    defined: dict[int, int] = {id(v): -1 for v in g.inputs}
    order: dict[int, Value] = {id(v): v for v in g.inputs}
    last_use: dict[int, int] = {}
    for op in g.ops:
        for v in op.inputs():
            if id(v) in defined:
                last_use[id(v)] = max(last_use.get(id(v), -1), op.stage)
        for v in op.outputs:
            defined[id(v)] = op.stage
            order[id(v)] = v
    last_use[id(loss)] = k
    for op in g.ops:         # a stage may only read what it or an earlier stage computed
        for v in op.inputs():
            if defined.get(id(v), -1) > op.stage:
                raise GraphError(
                    f"pipeline stage {op.stage} runs {op.name} ({op.module_path or 'top level'})"
                    f" but its input {v.name} is computed later, in stage {defined[id(v)]} "
                    f"({v.producer.module_path or 'top level'}): the layers do not run in "
                    "order (a block called twice, or blocks interleaved); use fewer "
                    "pipeline stages (parallel.pp) or no pipeline for this model")
    out = []
    for s in range(k):
        ops = [op for op in g.ops if op.stage == s]
        if s == 0:
            inputs = list(g.inputs)
        else:
            inputs = [v for i, v in order.items() if defined[i] < s and last_use.get(i, -2) >= s]
        outputs = [loss] if s == k - 1 else \
            [v for i, v in order.items() if defined[i] <= s and last_use.get(i, -2) > s]
        out.append(_stage_graph(g, inputs, ops, outputs))
    return out


def _stage_graph(g: Graph, inputs: list[Value], ops: list[Op], outputs: list[Value]) -> Graph:
    """A stage as a Graph sharing g's Values: the parameters and buffers its ops read."""
    used = {id(v) for op in ops if not op.is_structural for v in op.inputs()}
    sg = Graph(inputs, [v for v in g.params if id(v) in used],
               [v for v in g.buffers if id(v) in used], ops, outputs, [], g.out_spec,
               g.plan_ngpus, {}, g.stages, g.trace_info, g.plan_state, g.runtime_ngpus, g.axes,
               config=g.config)
    ins = {id(x) for x in inputs}
    sg.relayed = [v for v in outputs if id(v) in ins]
    return sg


class SplitStages:
    """The pass (see the module docstring)."""
    name = "split_stages"
    requires = (Stage.STAGED, Stage.LOCALIZED)
    produces = (Stage.SPLIT,)

    def __call__(self, graph: Graph) -> Graph:
        if Stage.SPLIT in graph.stages:
            return graph
        g = graph.clone()
        ops: list[Op] = []
        for s, sg in enumerate(stage_graphs(g)):
            relay = sg.relayed
            begin = Op(STAGE, (s, list(sg.inputs)), {}, [])
            end = Op(SEND, (s, list(sg.outputs)), {"relay": list(relay)} if relay else {}, [])
            begin.stage = end.stage = s
            ops += [begin, *sg.ops, end]
        g.ops = ops
        g.stages = g.stages | {Stage.SPLIT}
        return g


split_stages = SplitStages()


def stage_views(g: Graph) -> list[Graph]:
    """The stage programs of a split graph (Stage.SPLIT), each a Graph sharing g's Values:
    its inputs (`pipeline.stage`), ops (lowering markers included), outputs
    (`pipeline.send`) and relays (`relayed`). What codegen prints per stage."""
    if Stage.SPLIT not in g.stages:
        raise GraphError("the graph is not split into pipeline stages (run split_stages)")
    out, begin, body = [], None, []
    for op in g.ops:
        t = op.target if isinstance(op.target, str) else ""
        if t == STAGE:
            begin, body = op, []
        elif t == SEND:
            out.append(_stage_graph(g, list(begin.args[1]), body, list(op.args[1])))
        else:
            body.append(op)
    return out
