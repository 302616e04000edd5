"""Pipelined plans: a rank's file with its stages (cut by passes/split_stages.py).

A stage's inputs are the values it needs from earlier stages (stage 0: every input of the
model); its outputs are the values later stages need, the last stage's the loss. A value that
skips a stage is relayed through it (`targets = targets.clone()`), since a stage only talks to
its neighbours. Parameters, buffers and constants stay attributes of the rank's module.

A rank's file holds, besides the usual tables (only the parameters its stages use):

    PIPELINE = {...}     # stages, schedule, micro-batches, this rank's pipeline position, ties
    ACTIONS = {...}      # per pipeline rank: its actions in order ("0F0 0SEND_F0 ... 0B3")
    STAGES = [...]       # per stage on this rank: index, input and output names and metas
    def stage_1(self, add_7, targets):
        '''Stage 1 of 2 (pipeline rank 1): layers transformer.h.2 ... transformer.h.3, ...
        receives add_7, targets from stage 0 (rank 0); sends loss (last stage).'''
        ...
"""
from __future__ import annotations

import torch

from nncompile import rank_file
from nncompile.ir import Graph, Stage, fmt_literal
from nncompile.modes import resolve
from nncompile.passes.split_stages import loss_value  # noqa: F401 (the pipeline's loss)
from nncompile.pipeline_config import PipelineConfig


def rank_position(g: Graph, rank: int) -> tuple[int, int, list[int]]:
    """(plan unit, pipeline rank, stage indices) of a global rank (its coordinates on
    `g.mesh`)."""
    pp = g.plan_state.pipeline
    mesh = g.mesh
    pipe_rank = mesh.pipe_of(rank)
    cfg = PipelineConfig(pp.ranks, pp.schedule, pp.microbatches, pp.stages_per_rank)
    return mesh.unit_of(rank), pipe_rank, cfg.stage_ids(pipe_rank, pp.ranks)


def stage_rank(g: Graph, rank: int, stage: int) -> int:
    """The global rank that runs `stage` with the same unit and tensor-parallel shard."""
    pp = g.plan_state.pipeline
    cfg = PipelineConfig(pp.ranks, pp.schedule, pp.microbatches, pp.stages_per_rank)
    pipe = next(p for p in range(pp.ranks) if stage in cfg.stage_ids(p, pp.ranks))
    return g.mesh.moved(rank, pp=pipe)


def rank_graph(g: Graph, stages: list[Graph]) -> Graph:
    """The whole graph restricted to the parameters and buffers a rank's stages use (and the
    buffers its constants are computed from), with the stages' ops in order."""
    params = {id(v) for sg in stages for v in sg.params}
    const_in = {id(v) for op in g.const_ops for v in op.inputs()}
    buffers = {id(v) for sg in stages for v in sg.buffers} | const_in
    ops = [op for sg in stages for op in sg.ops]
    return Graph(g.inputs, [v for v in g.params if id(v) in params],
                 [v for v in g.buffers if id(v) in buffers], ops, g.outputs, g.const_ops,
                 g.out_spec, g.plan_ngpus, {}, g.stages, g.trace_info, g.plan_state,
                 g.runtime_ngpus, g.axes, config=g.config)


def _metas(values, n: int, axes: dict | None = None) -> tuple:
    """(local shape, dtype, carries a gradient) per value, what PipelineStage is told."""
    return tuple((tuple(v.local_shape(n, axes)), str(v.meta.dtype).replace("torch.", ""),
                  bool(v.requires_grad and v.meta.dtype.is_floating_point)) for v in values)


def tied_params(g: Graph, stages: list[Graph]) -> dict[str, list[int]]:
    """Parameters used by more than one stage: {FQN: stage indices}."""
    where: dict[str, list[int]] = {}
    for s, sg in enumerate(stages):
        for v in sg.params:
            where.setdefault(v.fqn, []).append(s)
    return {fqn: ss for fqn, ss in where.items() if len(ss) > 1}


_DROPOUT = ("aten.dropout.default", "aten.native_dropout.default")
_SDPA = "aten.scaled_dot_product_attention.default"


def _meta(v) -> tuple[list[int], str]:
    return list(v.meta.shape), str(v.meta.dtype).replace("torch.", "")


def _arg(op, i: int, name: str, default):
    """An argument's value in training mode (a mode argument, modes.ModeArg, read as such)."""
    return resolve(op.args[i] if len(op.args) > i else op.kwargs.get(name, default))


def stage_draws(sg: Graph) -> list[tuple]:
    """The random draws one micro-batch's forward of this stage makes in training mode, in
    order, each as runtime/program/rng.py's `replay` takes it: (kind, full noise shape, dtype, p)
    and, for an unsplit attention, its operands' shapes. Shapes are static, so every
    micro-batch draws the same. Random ops of other kinds are not replayed (a warning)."""
    import warnings
    out = []
    for op in sg.ops:
        name = op.target_name
        if name in _DROPOUT or name in ("rng.dropout", "rng.native_dropout"):
            p, train = _arg(op, 1, "p", 0.5), _arg(op, 2, "train", True)
            if train is False or not p or not op.args[0].is_tensor:
                continue
            if name.startswith("rng.") and p >= 1:
                continue                        # rng.py returns zeros without drawing
            shape, dtype = _meta(op.args[0])
            out.append((name.split(".")[1] if name.startswith("aten.") else "noise",
                        shape, dtype, float(p)))
        elif name in (_SDPA, "rng.scaled_dot_product_attention"):
            p = _arg(op, 4, "dropout_p", 0.0)
            if not p:
                continue
            q, k, v = op.args[:3]
            shape, dtype = list(q.meta.shape[:-1]) + [k.meta.shape[-2]], _meta(q)[1]
            if name.startswith("rng."):
                out.append(("noise", shape, dtype, float(p)))
                continue
            mask = _arg(op, 3, "attn_mask", None)
            out.append(("sdpa", shape, dtype, float(p), _meta(q)[0], _meta(k)[0], _meta(v)[0],
                        _meta(mask) if getattr(mask, "is_tensor", False) else None,
                        bool(_arg(op, 5, "is_causal", False)), _arg(op, 6, "scale", None),
                        bool(_arg(op, 7, "enable_gqa", False))))
        elif torch.Tag.nondeterministic_seeded in getattr(op.target, "tags", ()):
            warnings.warn(f"pipeline stage runs {name} ({op.module_path or 'top level'}), a "
                          "random op whose draws the pipeline does not replay: its random "
                          "numbers will differ from one device's (dropout and attention "
                          "dropout are exact)", stacklevel=2)
    return out


def pipeline_tables(g: Graph, rank: int, stages: list[Graph], units=()
                    ) -> tuple[dict, list[tuple]]:
    """This rank's PIPELINE dict and STAGES rows (`units`: ZeRO-3's flat parameters, which
    are then the stages' parameters)."""
    pp = g.plan_state.pipeline
    unit, pipe_rank, ids = rank_position(g, rank)
    n = g.plan_ngpus
    info = {
        "ranks": pp.ranks, "stages": pp.nstages, "stages_per_rank": pp.stages_per_rank,
        "schedule": pp.schedule, "microbatches": pp.microbatches, "tp": pp.tp,
        "pipe_rank": pipe_rank, "stage_ids": ids,
        "batched": list(g.trace_info.batched),
        "tied": tied_params(g, stages),      # FQN: the stages using it (every rank's file)
    }
    draws = {s: stage_draws(sg) for s, sg in enumerate(stages)}
    if any(draws.values()):                  # every stage's, so each rank can replay them
        info["draws"] = draws
    if g.plan_state.eval_differs:           # the stages hold the training-mode forward only
        info["eval_differs"] = True             # (modes.eval_program keeps no eval program)
    def params(sg: Graph) -> tuple[str, ...]:
        if not units:
            return tuple(v.name for v in sg.params)
        used = {v.name for v in sg.params}
        return tuple(attr for attr, _, names in units if any(n in used for n in names))
    rows = [(s, tuple(v.name for v in stages[s].inputs), tuple(v.name for v in stages[s].outputs),
             _metas(stages[s].inputs, n, g.axes), _metas(stages[s].outputs, n, g.axes),
             params(stages[s]))
            for s in ids]
    return info, rows


def actions_declaration(g: Graph) -> str:
    """`ACTIONS = {pipe rank: 'action action ...'}`: the step every pipeline rank runs, sends
    and receives included (passes/pipeline_schedule.py), in every rank's file."""
    acts = g.plan_state.pipeline.actions
    table = {p: acts.text(p) for p in range(acts.ranks)}
    return ("    # the schedule: each pipeline rank's actions in order (nncompile/ir/schedule.py:"
            "\n    # 1F0 forward of stage 1 on micro-batch 0, B full backward, I/W its input/"
            "weight halves)\n" + rank_file.declare("ACTIONS", table))


def stage_methods(g: Graph, rank: int, stages: list[Graph], indent: str = "    ") -> list[str]:
    """`def stage_k(self, ...)` for each stage on this rank, straight-line code."""
    from . import body_header, uses_float8
    from ..ir.printer import value_names
    from .body import render_body
    pp = g.plan_state.pipeline
    _, pipe_rank, ids = rank_position(g, rank)
    n = g.plan_ngpus
    zero = Stage.ZERO3_LOWERED in g.stages
    lines: list[str] = []
    for s in ids:
        sg = stages[s]
        layers = pp.layers[s]
        span = f"{layers[0]} ... {layers[-1]}" if len(layers) > 1 else layers[0]
        extra = (" + the ops before the first layer" if s == 0 else "") + \
            (" + the ops after the last layer" if s == pp.nstages - 1 else "")
        src = "the model's inputs (micro-batch)" if s == 0 else \
            f"stage {s - 1} (rank {stage_rank(g, rank, s - 1)})"
        dst = "the loss (last stage)" if s == pp.nstages - 1 else \
            f"stage {s + 1} (rank {stage_rank(g, rank, s + 1)})"
        names = ", ".join(v.name for v in sg.inputs)
        attrs = sg.buffers + [v for v in g.consts] + ([] if zero else sg.params)
        lines += ["", f"{indent}def stage_{s}(self{', ' + names if names else ''}):",
                  f'{indent}    """Stage {s} of {pp.nstages} on pipeline rank {pipe_rank} of '
                  f'{pp.ranks}: layers {span}{extra}',
                  f"{indent}    ({pp.predicted_ms[s]:.3g} ms predicted per micro-batch).",
                  f"{indent}    receives {names or 'nothing'} from {src};",
                  f"{indent}    sends {', '.join(v.name for v in sg.outputs)} to {dst}."
                  f'"""']
        with value_names({v: f"self.{v.name}" for v in attrs}):
            lines.append(body_header(zero, indent + "    ", g.axes, uses_float8(sg)))
            lines += render_body(sg, indent=indent + "    ", local_n=n)
            for v in sg.relayed:
                lines.append(f"{indent}    {v.name} = {v.name}.clone()  # relayed: a later "
                             "stage needs it")
            lines.append(f"{indent}    return {fmt_literal(tuple(sg.outputs))}")
    return lines
