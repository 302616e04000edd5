"""Pass contracts: the graph stages (nncompile.ir.Stage) a pass needs and establishes.

    @contract(requires=(Stage.PLANNED,), produces=(Stage.COMM_INSERTED,))
    def insert_comm(graph): ...

run_pipeline refuses to run a pass whose `requires` no earlier pass produced, naming the pass
and the missing stage, and checks that the graph a pass returns has what it `produces`.

What a pass reads besides the graph's structure is in the graph too: the request
(`graph.config`, the user's ComputeConfig, recorded once by run_pipeline) and what earlier
passes decided (`graph.plan_state`). A pass holds no config of its own; `config_of` is how it
reads the request.
"""
from __future__ import annotations

from typing import Any, Callable

from nncompile.errors import ConfigError
from nncompile.ir import Graph, Stage


def contract(requires: tuple[Stage, ...] = (), produces: tuple[Stage, ...] = ()) -> Callable:
    def deco(fn):
        fn.requires, fn.produces = tuple(requires), tuple(produces)
        return fn
    return deco


def requires_of(p) -> tuple[Stage, ...]:
    return tuple(getattr(p, "requires", ()))


def produces_of(p) -> tuple[Stage, ...]:
    return tuple(getattr(p, "produces", ()))


def tensor_ranks(graph: Graph, config: Any) -> int:
    """The ranks a policy splits `graph` over: what the planner chose for the tensor axis
    (plan_state.tensor_ranks), or for a graph it did not see the config's plan_ngpus."""
    n = graph.plan_state.tensor_ranks
    return config.plan_ngpus if n is None else n


def experts_split(graph: Graph, config: Any):
    """The experts' split being planned: the planner's (plan_state.experts), else the
    config's parallel.ep."""
    e = graph.plan_state.experts
    return config.expert_parallel if e is None else e


def config_of(graph: Graph, pass_name: str) -> Any:
    """The ComputeConfig `graph` was compiled for (graph.config), or a ConfigError naming the
    pass that needs it."""
    if graph.config is None:
        raise ConfigError(f"pass {pass_name!r} reads the compile's ComputeConfig from "
                          "graph.config, which this graph does not carry; run the passes "
                          "with run_pipeline(graph, build_pipeline(config, policy)) or "
                          "run_pipeline(graph, passes, config=ComputeConfig(...))")
    return graph.config
