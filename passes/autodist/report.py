"""What autodist decided and why: the data kept in plan.json, `explain`, the report table.

For every choice the plan keeps each option's compute, communication and memory, and what the
whole step would cost had that option been taken with the rest of the plan fixed; `explain`
prints those for one op, `report_table` lists the chosen options. Both show the memory options
(ZeRO stage, offload, recompute) from `autodist["memory"]` (memory_search.memory_report):
`report_table` after the decisions, `explain(target, "memory")` with why the choice won.
A pipelined plan's cut (plan.json "pipeline", pipeline_stages.pipeline_json) closes the report;
`explain(target, "pipeline")` prints it for any policy.
"""
from __future__ import annotations

import fnmatch
import io
import json
from pathlib import Path
from typing import Any

from nncompile.errors import ConfigError

from .ilp import Solution, memory_of, objective_of
from .problem import Problem

MS, MB = 1e3, 1e6


def _comm(prob: Problem, picks: list[int], c: int, k: int) -> float:
    """Communication of choice c's option k: its own, resharding its inputs, gradient syncs
    its split readers cause."""
    t = prob.choices[c].comm[k]
    t += sum(table[picks[a]][k] for (a, b), table in prob.pairs.items() if b == c)
    t += sum(sec for sec, readers in prob.syncs if any(b == c and k in opts
                                                       for b, opts in readers))
    return t


def explanation_data(prob: Problem, sol: Solution, g, device: str) -> dict[str, Any]:
    choices = []
    for c, ch in enumerate(prob.choices):
        options = []
        for k in range(len(ch.options)):
            picks = list(sol.picks)
            picks[c] = k
            options.append({"label": ch.label(k),
                            "compute_ms": ch.compute[k] * MS,
                            "comm_ms": _comm(prob, picks, c, k) * MS,
                            "memory_mb": ch.memory[k] / MB,
                            "step_ms": objective_of(prob, picks) * MS,
                            "step_memory_mb": memory_of(prob, picks) / MB})
        choices.append({"name": ch.name, "kind": "value" if ch.value is not None else "ops",
                        "ops": [op.name for op in ch.ops], "count": ch.count,
                        "chosen": sol.picks[c], "options": options})
    where = {}
    for op in g.ops:
        c = prob.canon[id(op)]
        where[op.name] = prob.choice_of[id(c)]
    for v in g.params + g.buffers + g.consts:
        cv = prob.vcanon[id(v)]
        if id(cv) in prob.choice_of:
            where[v.fqn or v.name] = prob.choice_of[id(cv)]
    return {"device": device, "objective_ms": sol.objective * MS,
            "solver_objective_ms": sol.solver_objective * MS,
            "memory_gb": sol.memory / 1e9, "solver": sol.solver, "solve_s": sol.seconds,
            "variables": sol.variables, "constraints": sol.constraints,
            "shared_layers": prob.layers, "choices": choices, "where": where}


def _load(target: Any) -> dict:
    """plan.json's contents from a gen_savedir instance dir, a ParallelModule or a dict."""
    if isinstance(target, dict):
        return target
    path = getattr(target, "gencode_path", None)
    path = Path(path).parent if path else Path(target)
    if path.is_dir():
        path = path / "plan.json"
    if not path.exists():
        raise ConfigError(f"no plan.json at {path}; pass the directory parallelize generated "
                          "into (gen_savedir/instance_name) or its ParallelModule")
    return json.loads(path.read_text())


def explain(target: Any, op: str) -> str:
    """Why `op` (an op name, a parameter FQN or a glob over either, first match) got its
    placement, and what each alternative would have cost with the rest of the plan fixed;
    `op="memory"`: the memory options chosen, the bytes per rank and the candidates;
    `op="pipeline"`: the pipeline cut, why, and each stage (any policy)."""
    plan = _load(target)
    if op == "pipeline":
        if not plan.get("pipeline"):
            raise ConfigError("this plan has no pipeline stages (parallel.pp)")
        return explain_pipeline(plan["pipeline"])
    data = plan.get("autodist")
    if not data:
        raise ConfigError(f"this plan was made by policy {plan.get('policy')!r}; explain needs "
                          "an autodist plan")
    names = [n for n in data["where"] if n == op] or \
        [n for n in data["where"] if fnmatch.fnmatchcase(n, op)]
    if not names and op == "memory" and data.get("memory"):
        return explain_memory(data["memory"])
    if not names:
        close = [n for n in data["where"] if op.lower() in n.lower()][:5]
        raise ConfigError(f"no op or parameter named {op!r} in this plan"
                          + (f"; did you mean {close}?" if close else ""))
    name = names[0]
    ch = data["choices"][data["where"][name]]
    ops = {o["name"]: o for o in plan.get("ops", [])}
    lines = [f"{name}" + (f" ({ops[name]['op']})  {ops[name]['source'] or ''}"
                          if name in ops else " (placement of a parameter/buffer)")]
    if ch["kind"] == "ops" and len(ch["ops"]) > 1:
        lines.append(f"  decided together with the ops that follow {ch['ops'][0]}: "
                     f"{', '.join(ch['ops'][1:])}")
    if ch["count"] > 1:
        lines.append(f"  one decision for {ch['count']} identical layer instances")
    chosen = ch["options"][ch["chosen"]]
    lines.append(f"  chosen  {chosen['label']}")
    lines.append(f"          compute {chosen['compute_ms']:.4f} ms  comm {chosen['comm_ms']:.4f} "
                 f"ms  memory {chosen['memory_mb']:.2f} MB  (step {chosen['step_ms']:.4f} ms)")
    lines.append("  alternatives, with the rest of the plan fixed:")
    for k, o in enumerate(ch["options"]):
        if k == ch["chosen"]:
            continue
        lines.append(f"    {o['label']}")
        lines.append(f"          compute {o['compute_ms']:.4f} ms  comm {o['comm_ms']:.4f} ms  "
                     f"memory {o['memory_mb']:.2f} MB  -> step "
                     f"{o['step_ms'] - chosen['step_ms']:+.4f} ms, memory "
                     f"{o['step_memory_mb'] - chosen['step_memory_mb']:+.2f} MB")
    if len(ch["options"]) == 1:
        lines.append("    none: no rule splits this op (it runs replicated)"
                     if chosen["label"] == "replicate" else
                     "    none: parallel.constraints leave this op only this option")
    return "\n".join(lines)


KINDS = ("parameters", "gradients", "optimizer_state", "activations", "communication_buffers",
         "total")


def choice_label(c: dict) -> str:
    """A memory choice (plan.json form) in words, e.g. 'ZeRO-3, optimizer offload, recompute
    h.*'."""
    parts = [f"ZeRO-{c['zero']}" if c["zero"] else "no ZeRO"]
    if c["offload_optimizer"]:
        parts.append("optimizer offload")
    if c["offload_params"]:
        parts.append("parameter offload")
    parts.append("recompute " + ", ".join(c["recompute"]) if c["recompute"] else "no recompute")
    return ", ".join(parts)


def _limit(mem: dict) -> str:
    lim = mem.get("mem_limit_bytes")
    return "no limit" if lim is None else f"limit {lim / MB:.3f} MB"


def explain_memory(mem: dict) -> str:
    """The memory options chosen, the bytes per rank by kind and why this combination won."""
    auto = mem.get("auto") or []
    how = f"chosen by autodist ({', '.join(auto)} 'auto')" if auto else "as configured"
    lines = [f"memory options: {choice_label(mem['choice'])}  {how}; ZeRO group "
             f"{mem.get('zero_group', 1)} rank(s)",
             f"  per rank ({_limit(mem)}):"]
    for kind in KINDS:
        size = mem["per_rank_bytes"][kind] / MB
        lines.append(f"    {kind.replace('_', ' '):<22} {size:12.3f} MB")
    lines.append(f"  in host memory (offloaded)  {mem.get('host_bytes', 0) / MB:10.3f} MB")
    cands = mem.get("candidates") or []
    if len(cands) > 1:
        chosen = next(c for c in cands if c["status"] == "chosen")
        lines.append(f"  {len(cands)} combinations considered, the fastest whose plan fits wins "
                     f"({mem.get('ilp_solves', '?')} ILPs solved):")
        for c in cands:
            why = {"chosen": "chosen",
                   "fits": f"fits, step {c['time_ms'] - chosen['time_ms']:+.4f} ms",
                   "too large": "does not fit even at its leanest",
                   "slower (bound)": "not solved: its step is at least "
                                     f"{c['time_ms'] - chosen['time_ms']:+.4f} ms slower"
                   }.get(c["status"], c["status"])
            lines.append(f"    {choice_label(c['choice']):<48} {c['total'] / MB:10.3f} MB "
                         f"{c['time_ms']:10.4f} ms  {why}")
    return "\n".join(lines)


def _gb(b) -> str:
    """Bytes as GB (MB below 0.1 GB)."""
    if b is None:
        return "-"
    return f"{b / 1e9:.3f} GB" if b >= 1e8 else f"{b / 1e6:.3g} MB"


def _span(layers: list[str]) -> str:
    if not layers:
        return "-"
    return layers[0] if len(layers) == 1 else f"{layers[0]} ... {layers[-1]} ({len(layers)})"


def pipeline_rows(pipe: dict) -> list[tuple]:
    """One row per stage: stage, pipeline rank, ranks (plan unit 0), layers, ms, GB, micro-
    batches in flight, parameters, collectives per micro-batch."""
    rows = []
    for st in pipe["stages"]:
        ranks = st["ranks"]
        comm = ", ".join(f"{k} {v}" for k, v in sorted(st["collectives"].items())) or "none"
        rows.append((str(st["stage"]), str(st["pipe_rank"]),
                     f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 1 else str(ranks[0]),
                     _span(st["layers"]),
                     "-" if st["predicted_ms"] is None else f"{st['predicted_ms']:.3f}",
                     _gb(st["memory_bytes"]), f"{st.get('inflight_microbatches', 0):g}",
                     f"{st['params']} ({st['param_elements']:,})", comm))
    return rows


PIPELINE_HEAD = ("stage", "pipe rank", "ranks", "layers", "ms/micro-batch", "memory", "in flight",
                 "params (elements)", "collectives/micro-batch")


def explain_pipeline(pipe: dict) -> str:
    """The cut in words: the stages, what chose them and why, each stage, the candidates."""
    from nncompile.comm_stats import align
    lines = []
    if not pipe["stages"]:
        lines.append(f"no pipeline: {pipe.get('chosen_by', '')}")
    else:
        lines.append(f"pipeline: {pipe['nstages']} stages on {pipe['ranks']} pipeline ranks x "
                     f"tp {pipe['tp']} ({pipe['schedule']}, {pipe['microbatches']} "
                     f"micro-batches, {pipe['stages_per_rank']} stage(s) per rank)")
        lines.append(f"  chosen by {pipe['chosen_by']}")
        times = [st["predicted_ms"] for st in pipe["stages"] if st["predicted_ms"] is not None]
        if times:
            mean = sum(times) / len(times)
            lines.append(f"  why: the cut minimizes the slowest stage's forward+backward time "
                         f"per micro-batch, whole layers only: slowest {max(times):.3f} ms, "
                         f"mean {mean:.3f} ms ({max(times) / mean:.3f} x)")
        if pipe.get("memory_note"):
            lim = pipe.get("mem_limit_bytes")
            where = "no limit" if lim is None else f"limit {_gb(lim)} per rank"
            lines.append(f"  memory ({where}, in-flight micro-batch activations counted): "
                         f"{pipe['memory_note']}")
        if pipe.get("rank_memory_bytes"):
            lines.append("  memory per pipeline rank (final plan): "
                         + ", ".join(_gb(b) for b in pipe["rank_memory_bytes"]))
        if pipe.get("predicted_step_ms") is not None:
            lines.append(f"  predicted step {pipe['predicted_step_ms']:.3f} ms (M x slowest "
                         "rank + bubble + gradient reduction)")
        lines += align([PIPELINE_HEAD] + pipeline_rows(pipe))
    cands = pipe.get("candidates") or []
    if pipe.get("auto") and cands:
        lines.append("  stage counts considered (pipeline_stages='auto'):")
        rows = [("stages", "tp", "step ms", "lower bound ms", "slowest stage ms", "memory",
                 "status")]
        for c in cands:
            rows.append((c["stages"], c["tp"], _opt(c["step_ms"]), _opt(c["bound_ms"]),
                         _opt(c["max_stage_ms"]), _gb(c["memory_bytes"]), c["status"]))
        lines += align(rows, indent="    ")
    return "\n".join(lines)


def _opt(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def _memory_tables(mem: dict):
    """Renderables for the report: a heading, the bytes per rank, the candidates."""
    from rich.table import Table
    from rich.text import Text
    auto = mem.get("auto") or []
    yield Text(f"\nmemory per rank: {choice_label(mem['choice'])} "
               + (f"(chosen by autodist: {', '.join(auto)} 'auto'; " if auto else "(")
               + f"{_limit(mem)}, ZeRO group {mem.get('zero_group', 1)})")
    t = Table()
    t.add_column("kind")
    t.add_column("MB", justify="right")
    for kind in KINDS:
        t.add_row(kind.replace("_", " "), f"{mem['per_rank_bytes'][kind] / MB:.3f}")
    t.add_row("host (offloaded)", f"{mem.get('host_bytes', 0) / MB:.3f}")
    yield t
    cands = mem.get("candidates") or []
    if len(cands) > 1:
        yield Text(f"memory options considered ({mem.get('ilp_solves', '?')} ILPs solved): the "
                   "fastest whose plan fits wins. ms/step of one not solved: a lower bound; "
                   "MB/rank of one that does not fit or was not solved: its leanest plan")
        c2 = Table()
        for col in ("combination", "MB/rank", "ms/step", "status"):
            c2.add_column(col, justify="right" if col[0] in "Mm" else "left")
        for c in cands:
            c2.add_row(choice_label(c["choice"]), f"{c['total'] / MB:.3f}",
                       f"{c['time_ms']:.4f}", c["status"])
        yield c2


def report_table(target: Any, width: int = 120) -> str:
    """The chosen plan as a table: one row per decision, with its cost."""
    from rich.console import Console
    from rich.table import Table
    plan = _load(target)
    data = plan.get("autodist")
    if not data:
        raise ConfigError("report_table needs an autodist plan")
    t = Table(title=f"autodist plan on {data['device']}: {data['objective_ms']:.3f} ms/step "
                    f"(model), {data['memory_gb']:.3f} GB/rank", show_lines=False)
    for col in ("decision", "x", "placement", "compute ms", "comm ms", "memory MB"):
        t.add_column(col, justify="right" if col[0] in "xcm" else "left")
    for ch in data["choices"]:
        o = ch["options"][ch["chosen"]]
        more = f" (+{len(ch['ops']) - 1})" if len(ch["ops"]) > 1 else ""
        t.add_row(ch["name"] + more, str(ch["count"]), o["label"], f"{o['compute_ms']:.4f}",
                  f"{o['comm_ms']:.4f}", f"{o['memory_mb']:.2f}")
    buf = io.StringIO()
    console = Console(file=buf, width=width, force_terminal=False, force_jupyter=False)
    console.print(t)
    if data.get("memory"):
        for extra in _memory_tables(data["memory"]):
            console.print(extra)
    if data.get("sizes"):
        console.print(_sizes_table(data["sizes"]))
    if plan.get("pipeline"):
        buf.write("\n" + explain_pipeline(plan["pipeline"]) + "\n")
    return buf.getvalue()


def _sizes_table(rows: list[dict]):
    """dynamic_dims: the plan's modelled cost at the dummy args and at the ranges' ends."""
    from rich.table import Table
    t = Table(title="dynamic sizes: the plan (made at the dummy args) at its ranges' ends")
    for col in ("at", "sizes", "ms/step (model)", "GB/rank"):
        t.add_column(col, justify="right" if col[0] in "mG" else "left")
    for r in rows:
        t.add_row(r["at"], ", ".join(f"{k}={v}" for k, v in r["sizes"].items()),
                  f"{r['ms']:.3f}", f"{r['memory_gb']:.4f}")
    return t
