"""Save a plan to JSON and apply a saved one (`save_plan_path` / `load_plan_path`).

The file names every op's strategy by its input and output placements and every parameter,
buffer and constant by its placement; op names are stable for a given model and shapes. It
also keeps the memory options the plan was made for (`memory`), which a load uses for the
options the config leaves to autodist ("auto").
"""
from __future__ import annotations

import json
from pathlib import Path

from nncompile.errors import ConfigError, PolicyError
from nncompile.fileio import write_json
from nncompile.ir import Graph, MemoryChoice, parse_placement
from nncompile.rules import strategies

FORMAT = "nncompile-plan"


def plan_dict(g: Graph) -> dict:
    out = {
        "format": FORMAT, "version": 1, "model": g.trace_info.model,
        "plan_ngpus": g.plan_ngpus,
        "ops": {op.name: {"op": op.target_name, "strategy": op.strategy.note,
                          "inputs": [repr(p) for p in op.strategy.inputs],
                          "outputs": [repr(p) for p in op.strategy.outputs]}
                for op in g.ops},
        "values": {v.name: repr(v.placement) for v in g.params + g.buffers + g.consts},
    }
    m = g.plan_state.memory
    if m is not None:
        out["memory"] = {"zero": m.zero, "offload_optimizer": m.offload_optimizer,
                         "offload_params": m.offload_params, "recompute": list(m.recompute)}
    return out


def save_plan(g: Graph, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, plan_dict(g))
    return path


def load_plan(graph: Graph, path: str | Path, n: int) -> Graph:
    """`graph` with the strategies and placements a saved plan names."""
    path = Path(path)
    try:
        saved = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"parallel.load_plan_path={str(path)!r} cannot be read ({e}); "
                          "give a file written with save_plan_path") from None
    if saved.get("format") != FORMAT:
        raise ConfigError(f"{path} is not an nncompile plan file (no format={FORMAT!r})")
    if saved.get("plan_ngpus") != n:
        raise PolicyError(f"the plan in {path} is for plan_ngpus={saved.get('plan_ngpus')}, "
                          f"this compile has plan_ngpus={n}; re-plan without load_plan_path")
    g = graph.clone()
    g.plan_ngpus = n
    stale = "the model or its shapes changed since it was saved; re-plan without load_plan_path"
    for op in g.ops:
        entry = saved["ops"].get(op.name)
        if entry is None:
            raise PolicyError(f"the plan in {path} has no op {op.name} ({op.target_name}): "
                              f"{stale}")
        want = ([parse_placement(p) for p in entry["inputs"]],
                [parse_placement(p) for p in entry["outputs"]])
        match = [s for s in strategies(op, n) if (list(s.inputs), list(s.outputs)) == want]
        if not match:
            raise PolicyError(f"the plan in {path} gives op {op.name} a strategy it does not "
                              f"have ({entry['strategy']}): {stale}")
        op.strategy = match[0]
    for v in g.params + g.buffers + g.consts:
        if v.name in saved["values"]:
            v.placement = parse_placement(saved["values"][v.name])
    m = saved.get("memory")
    g.plan_state.memory = None if m is None else MemoryChoice(
        int(m["zero"]), bool(m["offload_optimizer"]), bool(m["offload_params"]),
        tuple(m["recompute"]))
    return g


def loaded_memory(saved: MemoryChoice | None, config, path) -> MemoryChoice:
    """The memory options of a loaded plan: the config's explicit values, the saved plan's
    for those left to autodist ("auto")."""
    auto = "auto"
    rc = config.parallel.recompute_modules
    asked = [name for name, v in (("use_zero", config.zero_stage),
                                  ("offload_optimizer", config.offload_optimizer),
                                  ("recompute_modules", rc)) if v == auto]
    if asked and saved is None:
        raise PolicyError(f"the plan in {path} records no memory options, and {asked} are "
                          "'auto' (chosen with a plan); give them concrete values or re-plan "
                          "without load_plan_path")
    zero = saved.zero if config.zero_stage == auto else int(config.zero_stage)
    return MemoryChoice(
        zero,
        saved.offload_optimizer if config.offload_optimizer == auto
        else bool(config.offload_optimizer),
        bool(config.offload_params) and zero == 3,
        saved.recompute if rc == auto else tuple(rc or ()))
