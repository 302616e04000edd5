"""Codegen: the lowered graph -> `gencode{rank}.py` per rank, `manifest.json`, `plan.json` and
the IR after every pass (`graphs/NN_<pass>.py`). `render(graph, rank)` is a printer: the
passes made every decision, down to where ZeRO-3 gathers and where a checkpoint region or a
pipeline stage begins (passes/split_stages.py, lower_zero3.py, lower_recompute.py).

Generated code is straight-line torch calls, one per IR op, each under a comment with the
user's `file:line` and source text (an inserted collective under the line of the op it
serves). What the lines do not show is in comments too (codegen/notes.py): above each
collective, what its backward runs; in the class body, the gradient reductions the runtime
does after backward (groups, tensors, bytes, buckets). A rank's file differs from its peers'
only in which slices of the full parameters it holds.
"""
from __future__ import annotations

import collections
import json
from typing import Any, Iterator

from ..version import __version__
from ..comm_stats import collective_rows
from ..custom_ops import REGISTRY, is_custom_op
from ..ir import (Graph, MemoryChoice, RecomputeMark, Stage, Value, fmt_literal, part_slices,
                 print_graph, shard_slices)
from .notes import comm_note, reduction_header
from ..passes.split_stages import stage_views
from ..mesh import DP, PLAN, PP, Mesh
from .lifetimes import del_lines, last_uses
from ..ir.printer import axis_sizes, fmt_body, op_notes, value_names
from .body import render_body
from ..symbolic import Sym
from .. import rank_file
from ..rows import BufferRow, ConstRow, ParamRow

HEADER = '''"""nncompile generated code: rank {rank} of {runtime} ({position}).

model: {model}   policy: {policy}   fingerprint: {fingerprint}
`del` lines free each intermediate at its last use, as the model's own frames do (what
autograd saved for backward stays saved).
Readable and editable: an edited file runs (with one EditedCodeWarning per process);
parallelize(..., reuse="override") regenerates it and keeps your version in edited/.
"""
import torch
from torch.utils.checkpoint import checkpoint

from nncompile.runtime.program import {runtime_modules}
from nncompile.runtime.program.module import ParallelModule
{custom_imports}
aten = torch.ops.aten


class GenModel(ParallelModule):
{declarations}    INPUTS = [  # name, traced shape, dtype
{inputs}
    ]
    ARGS = [  # forward's arguments as traced: name, structure, leaves (input or constant)
{args}
    ]
{call_declarations}    PARAMS = [  # ParamRow: local name, FQN, full shape, placement, this rank's slices, partial grad
    # and, for a part "w[i/k]" of a fused parameter, (source FQN, source shape, view): its slices
    # are then this rank's box of the source viewed as view (passes/unfuse_projections.py)
{params}
    ]
{frozen}    BUFFERS = [  # BufferRow: local name, FQN, full shape, placement, this rank's slices
{buffers}
    ]
    CONSTS = [  # ConstRow: local name, full shape, placement, this rank's slices
{consts}
    ]
    # the original module's parameters() order and state_dict() keys (key, canonical FQN)
{state_declarations}'''

MEMORY_HEADER = '''    # the ZeRO stage and offload this code was generated for (runtime/store/zero.py)
{memory}    ZERO_UNITS = [  # ZeRO-3: flat parameter, its module, the local parameters it holds
{units}
    ]
'''


def _rows(rows: list[tuple]) -> str:
    return "\n".join(f"        {fmt_literal(r)}," for r in rows)


def rank_mesh(g: Graph, runtime_ngpus: int | None = None) -> Mesh:
    """The mesh a rank's file is written for: `g.mesh`, over `runtime_ngpus` ranks when
    given. Every rank coordinate codegen prints comes from it (Mesh.coords)."""
    return g.mesh_over(runtime_ngpus or g.runtime_ngpus)


def rank_position_text(mesh: Mesh, rank: int) -> str:
    """Where a rank sits, as its file's first line says it: "plan unit 1, shard 0 of 2", or
    under a pipeline "plan unit 1: pipeline rank 0 of 2, tensor-parallel shard 0 of 2"."""
    c, n = mesh.coords(rank), mesh.size(PLAN)
    if PP in c:
        return (f"plan unit {c[DP]}: pipeline rank {c[PP]} of {mesh.size(PP)}, "
                f"tensor-parallel shard {c[PLAN]} of {n}")
    return f"plan unit {c[DP]}, shard {c[PLAN]} of {n}"


def rank_tables(g: Graph, rank: int, runtime_ngpus: int | None = None
                ) -> dict[str, list[tuple]]:
    """A rank's PARAMS, BUFFERS and CONSTS rows (nncompile/rows.py), as the plain tuples its
    file prints (placements as text)."""
    n = g.plan_ngpus
    mesh = rank_mesh(g, runtime_ngpus)
    shard = mesh.shard_of(rank)
    partial = set(g.plan_state.partial_grad_params)

    def sl(v: Value):
        if v.part is not None:          # a part: this rank's box of the source's view
            return part_slices(v.part, v.meta.shape, v.placement, shard, n)
        box = [[0, d] for d in v.meta.shape]    # split along the outer axes first (an expert
        for axis, p in [*v.axes.items(), (PLAN, v.placement)]:      # weight's "ep"), then plan
            size = n if axis == PLAN else mesh.size(axis)
            inner = shard_slices(tuple(b - a for a, b in box), p, mesh.coord(rank, axis), size)
            box = [[a + i, a + j] for (a, _), (i, j) in zip(box, inner)]
        return tuple(tuple(s) for s in box)

    def part(v: Value):
        p = v.part
        return None if p is None else (p.source, tuple(p.source_shape), tuple(p.view))

    return {
        "params": [_param_row(ParamRow(v.name, v.fqn, tuple(v.meta.shape), v.placement, sl(v),
                                       v.name in partial, part(v))) for v in g.params],
        "buffers": [BufferRow(v.name, v.fqn, tuple(v.meta.shape), v.placement, sl(v)).plain()
                    for v in g.buffers],
        "consts": [ConstRow(v.name, tuple(v.meta.shape), v.placement, sl(v)).plain()
                   for v in g.consts],
    }


def _param_row(row: ParamRow) -> tuple:
    """As the file prints it: 6 fields for an ordinary parameter, 7 for a part."""
    plain = row.plain()
    return plain if row.part is not None else plain[:6]


PIPELINE_HEADER = '''    # pipeline parallelism (runtime/program/pipeline.py runs the stages on torch.distributed.pipelining)
{declarations}    STAGES = [  # this rank's stages: index, inputs, outputs, their (local shape, dtype, grad), parameters
{rows}
    ]
'''


def render(g: Graph, rank: int, fingerprint: str = "", memory: MemoryChoice | None = None,
           shared: dict | None = None) -> str:
    """A rank's file, printed from the lowered graph `g` (the last graph the passes made,
    graphs/NN_<last pass>.py) as it stands: no transforms. `memory`: the ZeRO stage and
    offload choice to record in it (given when it shapes the code: ZeRO-3, or a choice
    autodist made). A pipelined plan's file holds this rank's stages (codegen/pipeline.py)
    instead of one forward. `shared`: a dict kept across the calls for one graph
    (render_all): what every rank's file has in common (all but the tables of its own
    shards) is made once."""
    runtime_ngpus = g.mesh.world
    from . import pipeline as pc
    if shared is None:
        shared = {}
    n = g.plan_ngpus
    pp = g.plan_state.pipeline
    mesh = rank_mesh(g, runtime_ngpus)
    tg, stages = g, None
    if pp is not None:
        if "stages" not in shared:
            shared["stages"] = stage_views(g)
        stages = shared["stages"]
        tg = table_graph(g, rank, stages)
    t = rank_tables(tg, rank, runtime_ngpus)
    if "imports" not in shared:
        shared["imports"] = (_custom_imports(g), "comm, rng" if any(
            op.target_name.startswith("rng.") for op in g.ops) else "comm")
    custom_imports, runtime_modules = shared["imports"]
    text = HEADER.format(
        custom_imports=custom_imports, runtime_modules=runtime_modules,
        rank=rank, runtime=runtime_ngpus, position=rank_position_text(mesh, rank),
        model=g.trace_info.model, policy=g.plan_state.policy, fingerprint=fingerprint[:16],
        declarations=rank_file.schema_line() + "".join(rank_file.declare(k, v) for k, v in (
            ("RANK", rank), ("FINGERPRINT", fingerprint), ("POLICY", g.plan_state.policy),
            ("PLAN_NGPUS", n), ("RUNTIME_NGPUS", runtime_ngpus),
            ("INFERENCE_ONLY", g.trace_info.inference_only), ("OUT_SPEC", g.out_spec))),
        call_declarations=rank_file.declare("SIGNATURE", g.trace_info.signature,
                                            "forward's positional parameters")
        + rank_file.declare("DEFAULTS", g.trace_info.defaults,
                            "untraced arguments' defaults"),
        state_declarations=rank_file.declare("PARAM_ORDER", g.trace_info.param_order)
        + rank_file.declare("STATE_KEYS", [tuple(k) for k in g.trace_info.state_keys]),
        inputs=_rows([(v.name, tuple(d.code() if isinstance(d, Sym) else d for d in v.meta.shape),
                       str(v.meta.dtype)) for v in g.inputs]),
        args=_rows([tuple(r) for r in g.trace_info.args]),
        signature=g.trace_info.signature, defaults=g.trace_info.defaults,
        params=_rows(t["params"]),
        frozen=rank_file.declare("FROZEN", [v.name for v in tg.params if not v.requires_grad],
                                 "parameters with requires_grad=False: no gradient, no "
                                 "optimizer state"),
        buffers=_rows(t["buffers"]), consts=_rows(t["consts"]))
    if g.trace_info.sizes:
        text += rank_file.declare("SIZES", g.trace_info.sizes, "dynamic_dims: allowed (min, "
                                  "max, multiple of); checked on every call")
    if g.trace_info.buffer_updates:
        text += buffer_updates_line(g)
    text += mode_lines(g)
    if g.axes:
        text += rank_file.declare("MESH_AXES", g.axes, "mesh axes beyond dp, pp and plan: "
                                  "<AXIS>_GROUP in the code")
    if uses_float8(g):
        f8, gathered = g.plan_state.float8, float8_gathered(g)
        text += rank_file.declare("FLOAT8", {
            "recipe": f8["recipe"], "scales": f8["scales"],
            **({"gathered": gathered} if gathered else {})},
            "FLOAT8.linear: torchao's float8 recipe (runtime/program/float8.py)" + (
                "; gathered: weights ZeRO-3 gathers in float8 (runtime/store/zero_float8.py)"
                if gathered else ""))
    param_axes = {v.name: {a: repr(p) for a, p in v.axes.items()} for v in tg.params if v.axes}
    if param_axes:
        text += rank_file.declare("PARAM_AXES", param_axes, "parameters split along those "
                                  "axes too (PARAMS' slices include it)")
    if any(g.plan_state.axis_partial_grad.values()):
        text += rank_file.declare("PARTIAL_GRAD_AXES", g.plan_state.axis_partial_grad,
                                  "gradients summed over these axes too")
    grad_inputs = [v.name for v in g.inputs if v.requires_grad]
    if grad_inputs:
        text += rank_file.declare("GRAD_INPUTS", grad_inputs, "inputs traced requiring grad: "
                                  "their gradient is summed over the plan unit")
    text += reduction_header(tg, t["params"], runtime_ngpus, pp.ranks if pp else 1,
                             memory.zero if memory is not None else 0)
    if g.trace_info.microbatches > 1:
        text += rank_file.declare("MICROBATCHES", g.trace_info.microbatches, "train_step "
                                  "splits the batch into this many; the code runs one") \
            + rank_file.declare("BATCHED", g.trace_info.batched, "inputs split (the others "
                                "are passed whole to each micro-batch)")
    if pp is None and "tail" in shared:
        return text.rstrip("\n") + shared["tail"]
    units = rank_units(g, mesh.pipe_of(rank))
    head = len(text.rstrip("\n"))
    if pp is not None:
        info, rows = pc.pipeline_tables(g, rank, stages, units)
        text += PIPELINE_HEADER.format(rows=_rows(rows), declarations=rank_file.declare(
            "PIPE_RANKS", pp.ranks, "pipeline ranks in the plan unit; PLAN_NGPUS is one "
            "stage's tensor-parallel ranks") + rank_file.declare("PIPELINE", info)
            + pc.actions_declaration(g))
    if memory is not None:
        text += MEMORY_HEADER.format(
            memory=rank_file.declare("MEMORY", {
                "zero": memory.zero, "offload_optimizer": memory.offload_optimizer,
                "offload_params": memory.offload_params}),
            units=_rows([tuple(u) for u in units]))
    lines = [text.rstrip("\n")]
    if g.const_ops:
        args = ", ".join(v.name for v in tg.buffers)
        lines.append("")
        lines.append(f"    def compute_constants(self{', ' + args if args else ''}):")
        lines.append('        """Evaluated once at load time, on full buffers."""')
        lines.append("        DEVICE = self.device")
        frees = last_uses([(op.inputs(), op.outputs) for op in g.const_ops], g.consts, ())
        lines += fmt_body(g.const_ops, indent="        ", local_n=n,
                          after=[del_lines(f, "        ") for f in frees])
        lines.append("        return {" + ", ".join(f"{v.name!r}: {v.name}"
                                                    for v in g.consts) + "}")
    if pp is not None:
        with op_notes(comm_note), axis_sizes(g.axes):
            lines += pc.stage_methods(g, rank, stages)
        return "\n".join(lines) + "\n"
    lines += forward_method(g, "forward_impl", n)
    ev = g.eval_program
    if ev is not None:      # the forward differs in eval mode beyond mode flags (modes.py)
        lines += forward_method(ev, "forward_eval_impl", n,
                                "the forward in eval mode (model.eval()): the module runs it "
                                "instead of forward_impl while not self.training")
    out = "\n".join(lines) + "\n"
    shared["tail"] = out[head:]
    return out


def mode_lines(g: Graph) -> str:
    """What the class says about train and eval modes (nncompile/modes.py), where it is not
    the default: the mode it starts in, the eval program's output structure, why eval mode
    cannot run."""
    text = ""
    if not g.trace_info.training:
        text += rank_file.declare("TRAINING", False, "the module was in eval mode when "
                                  "traced: it starts so (pm.train() switches)")
    ev = g.eval_program
    if ev is not None and ev.out_spec != g.out_spec:
        text += rank_file.declare("EVAL_OUT_SPEC", ev.out_spec, "forward_eval_impl's outputs")
    if g.trace_info.eval_error:
        text += rank_file.declare("EVAL_ERROR", g.trace_info.eval_error, "the forward could "
                                  "not be traced in eval mode")
    if g.trace_info.train_error:
        text += rank_file.declare("TRAIN_ERROR", g.trace_info.train_error, "the forward "
                                  "could not be traced in training mode")
    return text


def forward_method(g: Graph, name: str, n: int, doc: str = "") -> list[str]:
    """`def forward_impl(self, inputs...)`: the program's ops; parameters, buffers and
    constants are attributes of the module (ZeRO-3: parameters gathered per unit)."""
    lines = [""]
    zero = Stage.ZERO3_LOWERED in g.stages
    attrs = g.buffers + g.consts + ([] if zero else g.params)
    with value_names({v: f"self.{v.name}" for v in attrs}), axis_sizes(g.axes):
        args = ", ".join(v.name for v in g.inputs)
        lines.append(f"    def {name}(self{', ' + args if args else ''}):")
        if doc:
            lines.append(f'        """{doc[0].upper() + doc[1:]}."""')
        lines.append(body_header(zero, "        ", g.axes, uses_float8(g)))
        lines += size_lines(g, "        ")
        with op_notes(comm_note):       # each collective's backward as a comment above it
            lines += render_body(g, indent="        ", local_n=n)
        lines.append(f"        return {fmt_literal(tuple(g.outputs))}")
    return lines


def float8_gathered(g: Graph) -> dict[str, list[str]]:
    """The weights ZeRO-3 gathers in float8 (passes/float8.py zero3_float8_gathers): those
    of the training program that its eval program, where it has one, reads the same way."""
    got = dict(g.plan_state.zero_float8 or {})
    ev = g.eval_program
    if ev is not None and Stage.ZERO3_LOWERED in ev.stages:
        keep = ev.plan_state.zero_float8 or {}
        got = {name: axes for name, axes in got.items() if keep.get(name) == axes}
    return got


def uses_float8(g: Graph) -> bool:
    """Whether the program runs float8 linears (passes/float8.py)."""
    return any(op.target_name == "FLOAT8.linear" for op in g.ops)


def body_header(zero: bool, indent: str, axes: dict | None = None,
                float8: bool = False) -> str:
    """The names a body reads from the module: the device, the plan unit's group, under
    ZeRO-3 the data-parallel group it gathers over, the group along each other mesh axis
    (CP_GROUP) and, with float8 linears, their runner (runtime/program/float8.py)."""
    head = f"{indent}DEVICE, PLAN_GROUP, ZERO = self.device, self.plan_group, self.zero" \
        if zero else f"{indent}DEVICE, PLAN_GROUP = self.device, self.plan_group"
    return head + "".join(f"\n{indent}{axis.upper()}_GROUP = self.axis_group({axis!r})"
                          for axis in axes or {}) \
        + (f"\n{indent}FLOAT8 = self.float8" if float8 else "")


def rank_units(g: Graph, pipe_rank: int = 0) -> list[tuple[str, str, tuple[str, ...]]]:
    """ZeRO-3's flat parameters on a rank (passes/lower_zero3.py): [(attribute, unit path,
    local parameter names)]; none without ZeRO-3."""
    if Stage.ZERO3_LOWERED not in g.stages:
        return []
    return list(g.plan_state.zero_units.get(pipe_rank, []))


def buffer_updates_line(g: Graph) -> str:
    """BUFFER_UPDATES: the buffers whose new values forward returns after its outputs (in
    training mode the runtime copies them into the buffers, as BatchNorm updates its running
    statistics)."""
    names = {v.fqn: v.name for v in g.buffers}
    local = [names[fqn] for fqn in g.trace_info.buffer_updates]
    return rank_file.declare("BUFFER_UPDATES", local, "buffers forward updates: their new "
                             "values follow the outputs; written back in training mode")


def size_lines(g: Graph, indent: str) -> list[str]:
    """The dynamic sizes (s_batch, s_seq, ...) read off the first input that has each."""
    lines, done = [], set()
    for v in g.inputs:
        for d, size in enumerate(v.meta.shape):
            if isinstance(size, Sym) and size.code() in g.trace_info.sizes \
                    and size.code() not in done:
                done.add(size.code())
                lines.append(f"{indent}{size.code()} = {v.name}.shape[{d}]  "
                             f"# dynamic_dims: {v.name} dim {d}")
    return lines


def render_all(g: Graph, fingerprint: str, memory: MemoryChoice | None = None
               ) -> Iterator[str]:
    """render for every rank of the job, in order, making their common part once."""
    shared: dict = {}
    for r in range(g.mesh.world):
        yield render(g, r, fingerprint, memory, shared)


def _custom_imports(g: Graph) -> str:
    """The import of register_op's namespace, with what each custom op the code calls runs."""
    names = sorted({op.target._opname for op in g.ops if is_custom_op(op.target)})
    if not names:
        return ""
    lines = ["from nncompile.custom_ops import custom  # ops made with nncompile.register_op:"]
    for name in names:
        op = REGISTRY.get(name)
        rule = op.annotation if op and isinstance(op.annotation, str) else "custom rule"
        lines.append(f"#   custom.{name} = {op.origin if op else '?'}   [{rule}]")
    return "\n".join(lines) + "\n"


def table_graph(g: Graph, rank: int, stages: list[Graph] | None = None) -> Graph:
    """The graph whose parameters a rank holds (a pipelined plan: its stages' only)."""
    if g.plan_state.pipeline is None:
        return g
    from . import pipeline as pc
    stages = stages if stages is not None else stage_views(g)
    return pc.rank_graph(g, [stages[s] for s in pc.rank_position(g, rank)[2]])


def manifest(g: Graph, config: Any, fingerprint: str, traced_text: str) -> dict[str, Any]:
    ranks = {}
    dtypes = {v.fqn: str(v.meta.dtype).replace("torch.", "") for v in g.params}
    frozen = {v.name for v in g.params if not v.requires_grad}
    stages = stage_views(g) if g.plan_state.pipeline is not None else None
    for r in range(config.runtime_ngpus):
        t = rank_tables(table_graph(g, r, stages), r, config.runtime_ngpus)
        ranks[str(r)] = {
            "file": f"gencode{r}.py",
            "params": [{"local": name, "fqn": fqn, "full_shape": list(shape),
                        "dtype": dtypes[fqn], "placement": repr(place),
                        "slices": [list(s) for s in slices],
                        "partial_sum_count": g.plan_ngpus if partial else 1,
                        "trainable": name not in frozen,
                        **({"part": {"source": part[0], "view": list(part[2])}} if part else {})}
                       for name, fqn, shape, place, slices, partial, part
                       in (ParamRow.of(r) for r in t["params"])],
        }
    return {
        "nncompile_version": __version__,
        "model": g.trace_info.model,
        "policy": g.plan_state.policy,
        "config": config.to_json(),
        "fingerprint": fingerprint,
        "traced_graph": traced_text,
        "inputs": [{"name": v.name, "shape": list(v.meta.shape), "dtype": str(v.meta.dtype)}
                   for v in g.inputs],
        "out_spec": g.out_spec,
        "ranks": ranks,
    }


def plan_json(g: Graph) -> dict[str, Any]:
    from ..passes.pipeline_stages import pipeline_json
    from ..passes.fuse_attention import attention_rows
    from ..passes.fuse_experts import experts_rows
    comm = collections.Counter(op.target_name for op in g.ops
                               if op.target_name.startswith("comm."))
    pipeline = pipeline_json(g)         # first: it gives the collectives their stage
    ops = []
    for op in g.ops:
        s = op.strategy
        ops.append({
            "name": op.name, "op": op.target_name, "module": op.module_path,
            "strategy": s.note if s else None,
            "inputs": [f"{v.name}: {v.placement!r}" for v in op.tensor_inputs()],
            "outputs": [f"{v.name}: {v.placement!r}" for v in op.outputs if v.is_tensor],
            "source": str(op.source) if op.source else None,
            **({"stage": op.stage} if g.plan_state.pipeline is not None else {}),
        })
    return {
        "policy": g.plan_state.policy,
        "plan_ngpus": g.plan_ngpus,
        "params": {v.fqn: repr(v.placement) for v in g.params},
        # parameters held as parts of a fused one (passes/unfuse_projections.py), by their key
        "param_parts": {v.fqn: {"source": v.part.source, "view": list(v.part.view),
                                "box": [list(b) for b in v.part.box]}
                        for v in g.params if v.part is not None},
        "partial_grad_params": list(g.plan_state.partial_grad_params),
        "collectives": dict(comm),
        "collective_ops": collective_rows(g),
        "ops": ops,
        "autodist": g.plan_state.autodist,
        "pipeline": pipeline,
        "attention": attention_rows(g),      # passes/fuse_attention.py: what each SDPA runs
        "experts": experts_rows(g),          # passes/fuse_experts.py: each MoE layer's split
        "dropped": list(g.plan_state.dropped),   # asked for, not planned (passes/dropped.py)
        **({"float8": g.plan_state.float8} if g.plan_state.float8 else {}),  # passes/float8.py
    }


def graph_dumps(history: list[tuple[str, Graph, float]]) -> dict[str, str]:
    out = {}
    printed: dict[int, str] = {}        # a pass that returned its input graph: printed once
    plan_n = history[-1][1].plan_ngpus if history else 1
    for i, (name, graph, ms) in enumerate(history):
        text = printed.get(id(graph))
        if text is None:
            local = graph.plan_ngpus if Stage.LOCALIZED in graph.stages else None
            text = printed[id(graph)] = print_graph(graph, local_n=local)
        out[f"{i:02d}_{name}.py"] = dump_header(name, ms, graph, plan_n) + text
    return out


def dump_header(name: str, ms: float, graph: Graph, plan_n: int) -> str:
    """The first line of graphs/NN_<pass>.py: the pass, its time and the compile's plan size
    (before the plan pass the graph is the single-device program: its IR header, the next
    line, says plan_ngpus=1)."""
    head = f"# after {name!r} ({ms:.1f} ms) of a plan_ngpus={plan_n} compile"
    if Stage.PLANNED not in graph.stages:
        head += (f": not yet partitioned, the whole model on one device (plan_ngpus="
                 f"{graph.plan_ngpus} below) until the plan pass splits it")
    pp = graph.plan_state.pipeline
    if pp is not None and pp.actions is not None:   # passes/pipeline_schedule.py
        head += f"\n# the {pp.schedule!r} schedule, each pipeline rank's actions in order:"
        head += "".join(f"\n#   rank {p}: {pp.actions.text(p)}" for p in range(pp.ranks))
    return head + "\n"


_ESCAPE = json.encoder.encode_basestring_ascii


def _json_float(x: float) -> str:
    if x != x:
        return "NaN"
    if x == float("inf"):
        return "Infinity"
    if x == float("-inf"):
        return "-Infinity"
    return float.__repr__(x)


def _json_into(o: Any, out: list[str], nl: str) -> None:
    """json.encoder's indent-mode output for o (in its check order), appended to out; nl is
    the newline and indent of o's own level."""
    if isinstance(o, str):
        out.append(_ESCAPE(o))
    elif o is None:
        out.append("null")
    elif o is True:
        out.append("true")
    elif o is False:
        out.append("false")
    elif isinstance(o, int):
        out.append(int.__repr__(o))
    elif isinstance(o, float):
        out.append(_json_float(o))
    elif isinstance(o, (list, tuple)):
        if not o:
            out.append("[]")
            return
        inner = nl + " "
        sep = "," + inner
        out.append("[" + inner)
        first = True
        for v in o:
            if not first:
                out.append(sep)
            first = False
            t = type(v)
            if t is str:
                out.append(_ESCAPE(v))
            elif t is int:
                out.append(int.__repr__(v))
            else:
                _json_into(v, out, inner)
        out.append(nl + "]")
    elif isinstance(o, dict):
        if not o:
            out.append("{}")
            return
        inner = nl + " "
        sep = "," + inner
        out.append("{" + inner)
        first = True
        for k, v in o.items():
            if isinstance(k, str):
                pass
            elif isinstance(k, float):
                k = _json_float(k)
            elif k is True:
                k = "true"
            elif k is False:
                k = "false"
            elif k is None:
                k = "null"
            elif isinstance(k, int):
                k = int.__repr__(k)
            else:
                raise TypeError(f"key {k!r} is not a JSON key")
            if not first:
                out.append(sep)
            first = False
            out.append(_ESCAPE(k))
            out.append(": ")
            t = type(v)
            if t is str:
                out.append(_ESCAPE(v))
            elif t is int:
                out.append(int.__repr__(v))
            elif v is None:
                out.append("null")
            else:
                _json_into(v, out, inner)
        out.append(nl + "}")
    else:
        raise TypeError(f"{type(o).__name__} is not JSON")


def json_text(obj: Any) -> str:
    """`json.dumps(obj, indent=1) + "\n"` (what fileio.write_json writes), byte for byte,
    several times faster: with an indent json's encoder runs in Python, one generator per
    container. Anything unusual (a type json rejects, a cycle) goes to json.dumps itself."""
    out: list[str] = []
    try:
        _json_into(obj, out, "\n")
    except (TypeError, ValueError, RecursionError):
        return json.dumps(obj, indent=1, sort_keys=False) + "\n"
    out.append("\n")
    return "".join(out)
