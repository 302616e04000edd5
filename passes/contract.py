"""Pass contracts: the graph stages (nncompile.ir.Stage) a pass needs and establishes.

    @contract(requires=(Stage.PLANNED,), produces=(Stage.COMM_INSERTED,))
    def insert_comm(graph): ...

run_pipeline refuses to run a pass whose `requires` no earlier pass produced, naming the pass
and the missing stage, and checks that the graph a pass returns has what it `produces`.
"""
from __future__ import annotations

from typing import Callable

from nncompile.ir import Stage


def contract(requires: tuple[Stage, ...] = (), produces: tuple[Stage, ...] = ()) -> Callable:
    def deco(fn):
        fn.requires, fn.produces = tuple(requires), tuple(produces)
        return fn
    return deco


def requires_of(p) -> tuple[Stage, ...]:
    return tuple(getattr(p, "requires", ()))


def produces_of(p) -> tuple[Stage, ...]:
    return tuple(getattr(p, "produces", ()))
