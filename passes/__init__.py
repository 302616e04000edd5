"""The compiler's pipeline, as a literal list, and the driver that keeps its history.

    trace -> constant_fold -> dce -> fuse_attention -> [float8_linears] -> [unfuse_projections]
          -> [fuse_moe_layers] -> [fuse_experts]
          -> [pipeline_stages] -> plan(policy) -> [context_parallel] -> [expert_parallel]
          -> sink_gathers
          -> insert_comm -> [recompute]
          -> localize -> [lower_float8] -> overlap_grad_sync
          -> [split_stages] -> [pipeline_schedule] -> [lower_zero3] -> [lower_recompute]
          -> codegen (a renderer)

float8_linears (ComputeConfig.float8) marks the linears of the nn.Linear layers torchao's
float8 recipe converts, so the plan never casts a partial sum, and lower_float8 makes them the
runtime's float8 linear, told how the plan split each operand (passes/float8.py).
fuse_attention turns a constant causal mask into SDPA's `is_causal=True` and repeat_kv copies
into `enable_gqa=True` (passes/fuse_attention.py). unfuse_projections (plan_ngpus > 1) cuts a
fused projection whose output is only split into pieces (nanoGPT's `c_attn` then `.split`)
into one projection per piece over parts of the fused parameter, so the plan splits q, k and
v by heads (passes/unfuse_projections.py); it is in the history (and graphs/) only when it
cut one. fuse_moe_layers (plan_ngpus > 1) makes each mixture-of-experts layer's experts module
one op whose tokens and experts the plan may split, fuse_experts a custom MoE's grouped expert
products (passes/fuse_experts.py).

Every pass is `Graph -> Graph`: what it reads is in the graph, the compile's request in
`graph.config` (the user's ComputeConfig, recorded once by run_pipeline and never rewritten)
and what earlier passes decided in `graph.plan_state`; a pass object holds no config (a few
take a small option of the request, the policy or the model's experts modules). Each has a
stable `__name__` and a contract (passes/contract.py):
the graph stages it `requires` and `produces`. `run_pipeline` checks the contract before and
after each pass, records `(name, graph, ms)`, runs `verify` between passes when asked, and
names the failing pass and the ones before it. Under dynamic_dims it ends with `verify_sizes`
(nncompile/ir/verify_sizes.py): no op of the final graph holds a dynamic size's traced value
as a literal, else a GraphError naming the op and the pass that built it.

"auto" memory options (use_zero, offload_optimizer, parallel.recompute_modules) are chosen
by autodist in the plan pass (graph.plan_state.memory; recompute reads its choice); under any
other policy build_pipeline refuses them with a ConfigError.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

from nncompile.errors import ConfigError, NNCompileError
from nncompile.ir import Graph, Stage, verify
from nncompile.ir.verify_sizes import verify_sizes

from .constant_fold import constant_fold
from .contract import config_of, contract, experts_split, produces_of, requires_of, \
    tensor_ranks
from .dce import dce
from .fuse_attention import FuseAttention, fuse_attention
from .float8 import Float8Linears, lower_float8
from .unfuse_projections import UnfuseProjections, unfuse_projections
from .insert_comm import insert_comm
from .localize import localize
from .overlap_grad_sync import overlap_grad_sync
from .pipeline_stages import PartitionStages
from .plan import Plan
from .context_parallel import ContextParallel
from .expert_parallel import ExpertParallel
from .fuse_experts import FuseExperts, FuseMoELayers, fuse_experts, fuse_moe_layers
from .recompute import AUTO, Recompute
from .sink_gathers import sink_gathers
from .split_stages import split_stages
from .pipeline_schedule import pipeline_schedule
from .lower_zero3 import LowerZero3
from .lower_recompute import lower_recompute
from .policies import POLICIES, get_policy
from .autodist import auto_fields

Pass = Callable[[Graph], Graph]


def check_auto_memory(config: Any, policy: Callable) -> None:
    """"auto" memory options (use_zero, offload_optimizer, recompute_modules) and
    context_parallel are chosen by autodist with the plan: ConfigError under any other
    policy."""
    if config.context_parallel == AUTO and policy is not POLICIES["autodist"]:
        raise ConfigError(f"parallel.cp='auto' is chosen by autodist, but "
                          f"the policy is {getattr(policy, '__name__', repr(policy))!r}; pass "
                          "pas_policy='autodist' or the number of context-parallel ranks")
    if config.expert_parallel == AUTO and policy is not POLICIES["autodist"]:
        raise ConfigError(f"parallel.ep='auto' is chosen by autodist, but "
                          f"the policy is {getattr(policy, '__name__', repr(policy))!r}; pass "
                          "pas_policy='autodist' or the number of expert-parallel ranks")
    auto = auto_fields(config)
    if auto and policy is not POLICIES["autodist"]:
        name = getattr(policy, "__name__", repr(policy))
        raise ConfigError(
            f"{', '.join(f'{a}={AUTO!r}' for a in auto)}: 'auto' memory options are chosen by "
            f"autodist together with the plan, but the policy is {name!r}; pass "
            "pas_policy='autodist' or a concrete value (use_zero 0-3, offload_optimizer "
            "True/False, parallel.recompute_modules a list of module names or globs)")


class Pipeline(list):
    """The passes build_pipeline chose for a request, in order; `config`, that request, is
    what run_pipeline records in graph.config (the passes read it there)."""

    def __init__(self, passes, config: Any):
        super().__init__(passes)
        self.config = config


def build_pipeline(config: Any, policy: Callable, experts: dict | None = None,
                   float8: dict | None = None) -> Pipeline:
    """The passes, in order, one per line. `experts`: the model's experts modules
    ({FQN: nncompile.experts.ExpertsForm}, experts_forms); `float8`: its nn.Linear layers
    ({FQN: None (converts) or why not}, nncompile.float8_spec.float8_layers)."""
    check_auto_memory(config, policy)
    spec = config.parallel
    f8 = config.float8
    return Pipeline([p for p in [
        constant_fold if config.constant_folding else None,
        dce,
        FuseAttention(config.plan_ngpus),
        Float8Linears(f8.recipe, f8.scales, float8 or {}, f8.all_gather)
        if f8 is not None else None,
        UnfuseProjections(config.plan_ngpus) if config.plan_ngpus > 1 else None,
        FuseMoELayers(experts) if experts and config.plan_ngpus > 1 else None,
        FuseExperts() if config.plan_ngpus > 1 else None,
        PartitionStages(autodist=policy is POLICIES["autodist"])
        if config.pipeline.enabled else None,
        Plan(policy),
        ContextParallel(config.context_parallel,
                        spec.cp_attention, spec.cp_order)
        if config.context_parallel != 1 else None,
        ExpertParallel() if config.expert_parallel != 1 else None,
        sink_gathers,
        insert_comm,
        Recompute(spec.recompute_modules) if spec.recompute_modules else None,
        localize,
        lower_float8 if f8 is not None else None,
        overlap_grad_sync if spec.overlap_grad_sync else None,
        # lowering: what each rank runs, made explicit for codegen to print as it stands
        split_stages if config.pipeline.enabled else None,
        pipeline_schedule if config.pipeline.enabled else None,
        LowerZero3() if config.code_fields else None,
        lower_recompute if spec.recompute_modules else None,
    ] if p is not None], config)


# passes that change when communication runs or how the program is laid out, not what the
# plan is: plan.json describes the graph before them (every op's own strategy), the
# generated code the graph after them
SCHEDULE_ONLY = frozenset({"lower_float8", "overlap_grad_sync", "split_stages", "pipeline_schedule",
                           "lower_zero3", "lower_recompute"})


def plan_graph(history: list[tuple[str, Graph, float]]) -> Graph:
    """The last graph of `history` that a schedule-only pass did not produce."""
    return next(g for name, g, _ in reversed(history) if name not in SCHEDULE_ONLY)


def pass_name(p: Pass) -> str:
    return getattr(p, "name", None) or getattr(p, "__name__", type(p).__name__)


class PassError(NNCompileError):
    """A pass raised; the message names it and the passes that ran before it."""


@dataclass
class PipelineResult:
    graph: Graph
    history: list[tuple[str, Graph, float]] = field(default_factory=list)
    eval_history: list[tuple[str, Graph, float]] = field(default_factory=list)


def run_pipeline(graph: Graph, passes: list[Pass], check: bool = False,
                 config: Any = None) -> PipelineResult:
    """The passes over `graph` and, where the forward differs in eval mode (graph.
    eval_program), over its eval program too, pinned to the training placements
    (eval_program below); one result with both histories. `config` (default: the one
    build_pipeline made `passes` for): the ComputeConfig the passes read, recorded once in
    graph.config (and its eval program's) before they run."""
    config = config if config is not None else getattr(passes, "config", None)
    if config is not None:
        for g in (graph, graph.eval_program):
            if g is not None:
                g.config = config
    result = run_passes(graph, passes, check)
    result.graph, result.eval_history = eval_program(result.graph, passes, check)
    return result


def run_passes(graph: Graph, passes: list[Pass], check: bool = False) -> PipelineResult:
    result = PipelineResult(graph, [("trace", graph, 0.0)])
    if check:
        verify(graph)
    for p in passes:
        start = time.perf_counter()
        done = [name for name, _, _ in result.history]
        missing = [s for s in requires_of(p) if s not in result.graph.stages]
        if missing:
            raise PassError(f"pass {pass_name(p)!r} requires {_stages(missing)}, which no pass "
                            f"before it produced (ran: {done}); put the pass that produces it "
                            "earlier in the pipeline")
        before = result.graph
        try:
            result.graph = p(result.graph)
            if check:
                verify(result.graph)
        except NNCompileError as e:
            if isinstance(e, PassError):
                raise
            done = [name for name, _, _ in result.history]
            raise type(e)(f"{e}\n  (in pass {pass_name(p)!r}, after {done})") from e
        except Exception as e:
            done = [name for name, _, _ in result.history]
            raise PassError(f"pass {pass_name(p)!r} failed after {done}: "
                            f"{type(e).__name__}: {e}") from e
        if getattr(p, "quiet_when_unchanged", False) and result.graph is before:
            continue        # nothing to do on this graph: not in the history (nor graphs/)
        unmet = [s for s in produces_of(p) if s not in result.graph.stages]
        if unmet:
            raise PassError(f"pass {pass_name(p)!r} declares it produces {_stages(unmet)}, but "
                            "the graph it returned does not have it")
        result.history.append((pass_name(p), result.graph, (time.perf_counter() - start) * 1e3))
    verify_sizes(result.graph, result.history)     # dynamic dims: no traced size baked in
    return result


def eval_program(final: Graph, passes: list[Pass], check: bool = False
                 ) -> tuple[Graph, list]:
    """The training program `final` with its eval program (`final.eval_program`, as traced)
    run through the same passes, its parameters and buffers pinned to the training program's
    placements (plan_state.pinned: it reads the same shards) and left in
    `final.eval_program` for codegen; and the eval run's pass history (graphs/eval/), empty
    without one. A pipelined plan keeps no eval program (its schedule runs training steps).

        before: final.eval_program = the traced eval graph (BatchNorm on running statistics)
        after:  final.eval_program = that graph planned, localized, lowered like `final`
    """
    from nncompile.log import log
    from nncompile.modes import check_eval_plan
    ev = final.eval_program
    if ev is None or Stage.PLANNED in ev.stages:
        return final, []
    if final.plan_state.pipeline is not None:
        log("the forward differs in eval mode; a pipelined plan's stages hold the training "
            "forward only, so pm(...) in eval mode is refused (runtime/program/pipeline.py)")
        final.eval_program = None
        final.plan_state.eval_differs = True
        return final, []
    if final.trace_info.inference_only:
        for v in ev.values():
            v.requires_grad = False
    log("the forward differs in eval mode (BatchNorm, or a branch on self.training): "
        "planning its eval program with the training program's parameter placements ...")
    ev.plan_state.zero_units = final.plan_state.zero_units   # ZeRO-3: the same flat shards
    ev.plan_state.pinned = {v.fqn: v.placement for v in final.params + final.buffers}
    result = run_passes(ev, passes, check)
    check_eval_plan(final, result.graph)
    result.graph.eval_program = None
    final.eval_program = result.graph
    return final, result.history


def _stages(stages) -> str:
    return ", ".join(f"{s.name} ({s.value})" for s in stages)


__all__ = ["build_pipeline", "check_auto_memory", "run_pipeline", "constant_fold", "dce",
           "fuse_attention", "FuseAttention", "unfuse_projections", "UnfuseProjections",
           "fuse_experts", "FuseExperts", "fuse_moe_layers", "FuseMoELayers",
           "Plan", "ContextParallel", "ExpertParallel", "sink_gathers", "insert_comm", "localize",
           "overlap_grad_sync", "split_stages", "pipeline_schedule", "LowerZero3", "lower_recompute", "plan_graph",
           "SCHEDULE_ONLY", "Recompute", "PartitionStages", "get_policy", "PassError",
           "PipelineResult", "Pipeline", "contract", "config_of", "tensor_ranks",
           "experts_split"]
