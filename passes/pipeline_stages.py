"""pipeline_stages: cut the forward into S x V pipeline stages at layer boundaries.

Before (pas_config pipeline_stages=2, a 4-block GPT):       After:
    wte = aten.embedding(...)          # transformer.wte        stage 0
    ... transformer.h.0 ... h.1 ...                              stage 0
    ... transformer.h.2 ... h.3 ...                              stage 1
    logits = aten.linear(...); loss = ...  # lm_head             stage 1

A layer is a block of a ModuleList (the module path up to its first numeric component, e.g.
`transformer.h.3`). Ops before the first layer join stage 0, ops after the last one the last
stage, ops between layers the stage of the layer before them. The cuts split the layers into
S * V contiguous runs minimizing the slowest stage's time (linear partition, dynamic
programming) from the cost model: each op's forward+backward time on the stage's
plan_ngpus // S tensor-parallel ranks (ideal split), under a memory bound per pipeline rank:
the stage's parameters, gradients and optimizer state plus the activations of the
micro-batches the schedule keeps in flight there (GPipe: all M; 1F1B-style: S - p on pipeline
rank p). With pipeline_stages="auto" (autodist only) every S dividing plan_ngpus is tried and
the fastest predicted step, (M + S - 1) / M x the slowest stage plus tensor-parallel traffic,
wins. The plan pass then places each stage's ops on its tensor-parallel ranks as usual.

Precondition: none (runs before plan). Records graph.plan_state.pipeline (PipelinePlan) and
op.stage for every op; codegen cuts the final graph into stage modules (pipeline_codegen.py).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, ClassVar

from nncompile.errors import ConfigError
from nncompile.ir import Graph, PipelinePlan, Replicate, Stage
from nncompile.pipeline_config import AUTO, PIPELINE_KEYS

_INF = float("inf")


def layer_of(module_path: str) -> str | None:
    """`transformer.h.3.attn.c_attn` -> `transformer.h.3`; None outside numbered blocks."""
    parts = module_path.split(".") if module_path else []
    for i, p in enumerate(parts):
        if p.isdigit():
            return ".".join(parts[:i + 1])
    return None


def stage_config(config: Any, tp: int, pipeline_ranks: int) -> Any:
    """The ComputeConfig one stage is planned with: its tensor-parallel ranks form the plan
    unit; data-parallel units stay as many as before."""
    pas = {k: v for k, v in config.pas_config.items() if k not in PIPELINE_KEYS}
    runtime = (config.runtime_ngpus or config.plan_ngpus) // pipeline_ranks
    return dataclasses.replace(config, plan_ngpus=tp, runtime_ngpus=runtime, pas_config=pas)


@dataclass
class Layer:
    name: str
    ops: list                      # op indices
    time: float = 0.0              # seconds, forward + backward
    state: float = 0.0             # bytes of parameters + gradients + optimizer state
    activations: float = 0.0       # bytes saved for backward, one micro-batch


def layers_of(g: Graph) -> tuple[list[Layer], list[int], list[int]]:
    """(the layers in order, op indices before the first layer, op indices after the last
    layer); an op between layers joins the layer before it."""
    layers: list[Layer] = []
    index: dict[str, Layer] = {}
    head: list[int] = []
    for i, op in enumerate(g.ops):
        name = layer_of(op.module_path)
        if name is not None and name not in index:
            index[name] = Layer(name, [])
            layers.append(index[name])
        if name is not None:
            index[name].ops.append(i)
        elif layers:
            layers[-1].ops.append(i)
        else:
            head.append(i)
    tail: list[int] = []
    if layers:         # ops after the last layer's last own op are the tail, not the layer
        last = layers[-1]
        own = [i for i in last.ops if layer_of(g.ops[i].module_path) == last.name]
        cut = own[-1] if own else -1
        tail = [i for i in last.ops if i > cut]
        last.ops = [i for i in last.ops if i <= cut]
    return layers, head, tail


def inflight(schedule: str, microbatches: int, ranks: int, pipe_rank: int) -> int:
    """Micro-batches whose activations a pipeline rank holds at the schedule's peak."""
    if schedule == "gpipe":
        return microbatches
    return min(microbatches, ranks - pipe_rank)


def partition(costs: list[float], k: int, fits=lambda lo, hi, s: True) -> list[int]:
    """Cut points b_0=0 < b_1 < ... < b_k=len(costs) minimizing the largest sum of a part;
    `fits(lo, hi, s)` says whether costs[lo:hi] may form part s."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    best = [[_INF] * (n + 1) for _ in range(k + 1)]
    cut = [[0] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0.0
    for s in range(1, k + 1):
        for hi in range(s, n - (k - s) + 1):
            for lo in range(s - 1, hi):
                if best[s - 1][lo] == _INF or not fits(lo, hi, s - 1):
                    continue
                v = max(best[s - 1][lo], prefix[hi] - prefix[lo])
                if v < best[s][hi]:
                    best[s][hi], cut[s][hi] = v, lo
    if best[k][n] == _INF:
        return []
    bounds, hi = [n], n
    for s in range(k, 0, -1):
        hi = cut[s][hi]
        bounds.append(hi)
    return bounds[::-1]


@dataclass
class PartitionStages:
    """The pass (see the module docstring)."""
    config: Any
    autodist: bool = False
    name: str = "pipeline_stages"
    requires: ClassVar[tuple] = ()
    produces: ClassVar[tuple] = (Stage.STAGED,)

    def __call__(self, graph: Graph) -> Graph:
        pc = self.config.pipeline
        if pc.stages == AUTO and not self.autodist:
            raise ConfigError("pas_config['pipeline_stages']='auto' is chosen by autodist; use "
                              "pas_policy='autodist' or give the number of stages")
        g = graph.clone()
        layers, head, tail = layers_of(g)
        if not layers:
            raise ConfigError(
                "pipeline stages are cut at layer boundaries (blocks of an nn.ModuleList, "
                f"module paths like 'layers.3'), but {g.trace_info.model} has none; drop "
                "pas_config['pipeline_stages'] or keep the repeated blocks in a ModuleList")
        plan_ngpus = self.config.plan_ngpus
        candidates = [s for s in range(1, plan_ngpus + 1) if plan_ngpus % s == 0
                      and s * pc.stages_per_rank <= len(layers)] if pc.stages == AUTO \
            else [pc.stages]
        if pc.stages != AUTO and pc.stages * pc.stages_per_rank > len(layers):
            raise ConfigError(
                f"pipeline_stages={pc.stages} x stages_per_rank={pc.stages_per_rank} = "
                f"{pc.stages * pc.stages_per_rank} stages, but {g.trace_info.model} has only "
                f"{len(layers)} layers ({layers[0].name} ... {layers[-1].name}) to cut "
                f"between; use pipeline_stages <= {len(layers) // pc.stages_per_rank}"
                + (f" with stages_per_rank={pc.stages_per_rank}" if pc.stages_per_rank > 1
                   else ""))
        best = None
        for s in candidates:
            plan = self._plan(g, layers, head, tail, s)
            if plan is not None and (best is None or plan[0] < best[0]):
                best = plan
        if best is None:
            raise ConfigError(
                f"no cut of {len(layers)} layers into pipeline stages fits "
                f"mem_limit_gb={self.config.pas_config.get('mem_limit_gb')} per rank (in-flight "
                "micro-batch activations counted); raise mem_limit_gb, use more stages or "
                "more micro-batches of a smaller batch, or add recompute_modules")
        _, pipeline, stage_of_layer = best
        for layer, stage in zip(layers, stage_of_layer):
            for i in layer.ops:
                g.ops[i].stage = stage
        for i in head:
            g.ops[i].stage = 0
        for i in tail:
            g.ops[i].stage = pipeline.nstages - 1
        g.plan_state.pipeline = pipeline if pipeline.nstages > 1 else None   # "auto" chose 1
        g.stages = g.stages | {Stage.STAGED}
        return g

    def _plan(self, g: Graph, layers: list[Layer], head, tail, ranks: int):
        """(predicted step seconds, PipelinePlan, stage per layer) for S = ranks, or None
        when no cut fits the memory limit."""
        from nncompile.passes.autodist import cost_model
        pc = self.config.pipeline
        tp = self.config.plan_ngpus // ranks
        cm = cost_model(stage_config(self.config, 1, 1))
        k = ranks * pc.stages_per_rank

        def measure(indices) -> tuple[float, float, float]:
            t = state = act = 0.0
            seen: set[int] = set()
            for i in indices:
                op = g.ops[i]
                outs = [Replicate()] * len(op.outputs)
                t += cm.compute(op, [None] * len(op.tensor_inputs()), outs)
                act += cm.activation_memory(op, outs)
                for v in op.inputs():
                    if v.kind == "param" and id(v) not in seen:
                        seen.add(id(v))
                        state += cm.param_memory(v, Replicate())
            return t / tp, state / tp, act / tp

        for layer in layers:
            layer.time, layer.state, layer.activations = measure(layer.ops)
        h, t = measure(head), measure(tail)
        costs = [layer.time for layer in layers]
        costs[0] += h[0]
        costs[-1] += t[0]
        limit = self.config.pas_config.get("mem_limit_gb")
        limit = _INF if limit is None else float(limit) * 2 ** 30 / pc.stages_per_rank

        def memory(lo: int, hi: int, s: int) -> float:
            part = layers[lo:hi]
            pipe_rank = s % ranks if pc.torch_schedule() != "ScheduleZBVZeroBubble" else \
                min(s, k - 1 - s)
            act = sum(x.activations for x in part) + (h[2] if lo == 0 else 0.0) + \
                (t[2] if hi == len(layers) else 0.0)
            state = sum(x.state for x in part) + (h[1] if lo == 0 else 0.0) + \
                (t[1] if hi == len(layers) else 0.0)
            return state + act * inflight(pc.schedule, pc.microbatches, ranks, pipe_rank)

        bounds = partition(costs, k, lambda lo, hi, s: memory(lo, hi, s) <= limit)
        if not bounds:
            return None
        stage_of_layer = [s for s in range(k) for _ in range(bounds[s], bounds[s + 1])]
        times = [sum(costs[bounds[s]:bounds[s + 1]]) for s in range(k)]
        mem = [memory(bounds[s], bounds[s + 1], s) for s in range(k)]
        # tensor-parallel traffic per layer (two all-reduces of the layer's output forward,
        # two backward), the same for every stage count's comparison
        hidden = _layer_output_bytes(g, layers[0])
        tp_comm = 4 * cm.collective("all_reduce", hidden, group=tp) * len(layers) / ranks
        per_rank = [sum(times[s::ranks]) for s in range(ranks)] if \
            pc.torch_schedule() != "ScheduleZBVZeroBubble" else \
            [times[s] + times[k - 1 - s] for s in range(ranks)]
        m = pc.microbatches
        step = (m + ranks - 1) / m * (max(per_rank) + tp_comm) * m
        plan = PipelinePlan(ranks=ranks, stages_per_rank=pc.stages_per_rank,
                            schedule=pc.schedule, microbatches=m, tp=tp,
                            layers=[[x.name for x in layers[bounds[s]:bounds[s + 1]]]
                                    for s in range(k)],
                            predicted_ms=[x * 1e3 for x in times], memory_bytes=mem,
                            chosen_by="autodist (stages and cuts)" if pc.stages == AUTO
                            else "layer cost")
        return step, plan, stage_of_layer


def _layer_output_bytes(g: Graph, layer: Layer) -> float:
    op = g.ops[layer.ops[-1]]
    return float(sum(math.prod(v.meta.shape) * v.meta.dtype.itemsize
                     for v in op.outputs if v.is_tensor))
