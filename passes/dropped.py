"""What a plan leaves out of what the user asked for: a warning, and plan.json's `dropped`.

A pass that cannot apply an asked-for parallelism everywhere (cp asked, but no attention layer
can take the sequence split) does not fail and does not stay silent: it calls

    drop(graph, asked="parallel.cp=2", what="attention attn (model.py:14) ...",
         reason="its sequence is 35 long ...", fix="pad ...")

which logs and warns once, and appends {"asked", "dropped", "reason", "fix"} to
`graph.plan_state.dropped` (a tuple: clones share it, nobody mutates it), written to plan.json.
"""
from __future__ import annotations

import warnings

from nncompile.ir import Graph
from nncompile.log import log


class PlanDroppedWarning(UserWarning):
    """The plan leaves out part of what the configuration asked for (plan.json: `dropped`)."""


def drop(graph: Graph, asked: str, what: str, reason: str, fix: str) -> None:
    entry = {"asked": asked, "dropped": what, "reason": reason, "fix": fix}
    graph.plan_state.dropped = (*graph.plan_state.dropped, entry)
    text = f"{asked}: {what} ({reason}); {fix}"
    log(f"plan: {text}")
    warnings.warn(text, PlanDroppedWarning, stacklevel=2)
