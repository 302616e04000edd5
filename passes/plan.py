"""plan: run the policy, then check and complete what it decided.

Before:                                         After (tp, plan_ngpus=2):
    y = aten.linear.default(x, w)  # f32[8, 64] R     y = aten.linear.default(x, w)  # f32[8, 64] S(1)  [split n]

Every op ends with a legal strategy (ops the policy left alone run replicated) and every op
output takes the placement its strategy names. Under a pipeline (plan_state.pipeline) the
policy plans for one stage's tensor-parallel ranks, under context parallelism for the
plan_ngpus // C tensor ranks of a unit, ... : the mesh is searched in passes/planner.py
(tensor_plan; "auto" cp and ep sizes are each planned and priced there). The eval program (nncompile/modes.py) keeps the training program's
parameter and buffer placements (plan_state.pinned): autodist prices them fixed, any other
policy's are overridden and insert_comm converts. Precondition: none. Idempotent: yes, for a
deterministic policy.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, ClassVar

from nncompile.errors import ConfigError, PolicyError
from nncompile.experts import MOE_EXPERTS
from nncompile.mesh import EP
from nncompile.ir import PARAM, Graph, MemoryChoice, Partial, Replicate, Shard, Stage
from nncompile.rules import replicated, strategies, strided_splits

from .contract import config_of
from .expert_parallel import dispatch_of, no_experts_error
from .planner import tensor_plan


@dataclass
class Plan:
    """The pass: `policy` plans the graph for the request in graph.config (the mesh it is
    cut into: passes/planner.py)."""
    policy: Callable
    name: ClassVar[str] = "plan"
    requires: ClassVar[tuple] = ()
    produces: ClassVar[tuple] = (Stage.PLANNED,)

    def __call__(self, graph: Graph) -> Graph:
        config = config_of(graph, self.name)
        g, experts = tensor_plan(graph, config, self.policy)
        if not isinstance(g, Graph):
            raise PolicyError(f"policy {getattr(self.policy, '__name__', self.policy)!r} "
                              f"returned {type(g).__name__}, not a Graph")
        if g is graph:
            g = graph.clone()
        mesh = g.mesh
        g.plan_state.policy = getattr(self.policy, "__name__", str(self.policy))
        for v in g.params + g.buffers:
            if isinstance(v.placement, Partial):
                raise PolicyError(f"{v.kind} {v.fqn!r} cannot be Partial; use Replicate "
                                  "or Shard")
        if experts != 1:
            if EP in g.axes:            # the experts whole on the tensor ranks: they split
                whole_experts(g, mesh)  # along ep (passes/expert_parallel.py)
            else:
                dispatch_experts(g, mesh)
        for op in g.ops:
            if op.strategy is None:
                op.strategy = replicated(op)
            with strided_splits():      # a policy may choose them; insert_comm converts
                legal = {(s.inputs, s.outputs): s for s in strategies(op, mesh)}
            chosen = legal.get((op.strategy.inputs, op.strategy.outputs))
            if chosen is None:
                raise PolicyError(f"policy chose an illegal strategy for {op.name} "
                                  f"({op.target_name}): inputs {op.strategy.inputs} -> "
                                  f"{op.strategy.outputs}; legal: {list(legal)}")
            if op.strategy.axis_inputs:     # what the policy asked along other mesh axes
                chosen = replace(chosen, axis_inputs=dict(op.strategy.axis_inputs))
            op.strategy = chosen
            for v, p in zip(op.outputs, chosen.outputs):
                v.placement = p if v.is_tensor else Replicate()
        g.plan_state.memory = g.plan_state.memory or decide_memory(g, config)
        for v in g.params + g.buffers:      # the eval program reads the training shards:
            if v.fqn in g.plan_state.pinned:    # insert_comm moves them where its ops want
                v.placement = g.plan_state.pinned[v.fqn]
        g.stages = g.stages | {Stage.PLANNED}
        return g


def decide_memory(g: Graph, config: Any) -> MemoryChoice:
    """The one place the plan's ZeRO stage and offload are decided: the policy's choice
    where it made one (autodist, for "auto" values: plan_state.memory), else the config's
    own values; "auto" left unchosen is a ConfigError. The plan pass records it in
    plan_state.memory, which lower_zero3, codegen and the runtime read."""
    if g.plan_state.memory is not None:
        return g.plan_state.memory
    if "auto" in (config.zero_stage, config.offload_optimizer):
        raise ConfigError(f"use_zero={config.use_zero!r} / offload_optimizer="
                          f"{config.offload_optimizer!r}: 'auto' is chosen by autodist; use "
                          f"pas_policy='autodist' or give a concrete value")
    return MemoryChoice(zero=config.zero_stage, offload_optimizer=config.offload_optimizer,
                        offload_params=config.offload_params)


def whole_experts(g: Graph, mesh) -> None:
    """Every MoE layer's experts whole on the tensor ranks, its tokens split between them
    where they divide (each tensor rank dispatches its share along ep), its weights whole:
    the ep axis splits the experts instead (passes/expert_parallel.py)."""
    _set_experts(g, lambda op: next((s for s in strategies(op, mesh)
                                     if s.note == "split tokens"), replicated(op)), Replicate())


def dispatch_experts(g: Graph, mesh) -> None:
    """parallel.ep = E: every mixture-of-experts layer (moe_experts) takes
    its dispatch strategy (its tokens and experts split over the E tensor ranks, all-to-all
    between them: nncompile/rules/experts.py), whatever the policy chose; insert_comm moves
    its inputs and output to and from the policy's placements."""
    if not any(op.target is MOE_EXPERTS for op in g.ops):
        raise no_experts_error(g, mesh.size("plan"))
    _set_experts(g, lambda op: dispatch_of(op, mesh.size("plan")), Shard(0))


def _set_experts(g: Graph, strategy_of, weights) -> None:
    """Each MoE layer takes `strategy_of(op)`; its expert weights, where only MoE layers read
    them (one layer, or one experts module applied several times), live as `weights` (not
    moved per step)."""
    users = g.users()
    for op in g.ops:
        if op.target is MOE_EXPERTS:
            op.strategy = strategy_of(op)
            for v in op.args[3:5]:
                if v.kind == PARAM and all(u.target is MOE_EXPERTS
                                           for u in users.get(v, [])):
                    v.placement = weights
