"""Inspect generated code: what each rank holds and sends, the IR after a pass, how two plans
differ, and a picture of the op graph. Every function returns text (or the picture's path),
reads only the files parallelize wrote, and raises ConfigError saying what is missing.

    show(path)                      per-rank parameters, collectives, gradient reduction, plan;
                                    a pipelined plan: its stages (layers, ranks, parameters,
                                    predicted time and memory, collectives per stage)
    ir_after(path, pass_name=None)  graphs/NN_<pass>.py, or the list of passes
    diff(a, b, code=False, rank=0)  what differs between two plans (and one rank's code)
    plot(path, output)              the op graph by module, coloured by placement, repeated
                                    blocks drawn once, as an image

`path` is an instance directory (holding manifest.json) or a gen_savedir holding exactly one.
"""
from __future__ import annotations

import collections
import contextlib
import difflib
import json
import math
from pathlib import Path
from typing import Any, Iterator

from ..comm_stats import align, count_by_kind, fmt_bytes, format_rows
from ..edits import edited_files
from ..errors import ConfigError, NNCompileError
from ..ir.placement import Replicate, Shard, parse_placement
from ..mesh import DP, PLAN, Mesh, grad_reduction

MANIFEST_KEYS = ("model", "policy", "config", "fingerprint", "ranks")
PLAN_KEYS = ("policy", "plan_ngpus", "params", "collectives", "collective_ops", "ops")
HOW_TO_GENERATE = ("generate it with nncompile.parallelize(model, dummy_args, config, "
                   "gen_savedir=DIR) (load_module=False only compiles)")


# ---- locating and reading ------------------------------------------------------------------
def find_instance(path: str | Path) -> Path:
    """The instance directory (the one holding manifest.json) that `path` names or holds."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{path} does not exist; pass the gen_savedir given to parallelize "
                          f"(default ./.nncompile) or one of its instance directories; "
                          f"{HOW_TO_GENERATE}")
    path = path.resolve()
    if path.is_file():
        path = path.parent
    if (path / "manifest.json").is_file():
        return path
    found = [d for d in sorted(path.iterdir()) if d.is_dir() and not d.name.startswith(".")
             and (d / "manifest.json").is_file()]
    if len(found) == 1:
        return found[0]
    if not found:
        raise ConfigError(f"{path} holds no generated code: expected manifest.json in it or in "
                          f"one instance subdirectory (gen_savedir/<instance_name>); "
                          f"{HOW_TO_GENERATE}")
    raise ConfigError(f"{path} holds {len(found)} instances; pass one of: "
                      + ", ".join(str(d) for d in found))


def _read_json(inst: Path, name: str, keys: tuple[str, ...]) -> dict[str, Any]:
    path = inst / name
    fix = f"regenerate with parallelize(..., gen_savedir={str(inst.parent)!r}, reuse='override')"
    if not path.is_file():
        raise ConfigError(f"{path} is missing: an instance directory holds manifest.json, "
                          f"plan.json, gencode<rank>.py and graphs/; {fix}")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path} is not readable JSON ({e}); {fix}") from None
    missing = [k for k in keys if k not in data] if isinstance(data, dict) else list(keys)
    if missing:
        raise ConfigError(f"{path} lacks {', '.join(missing)} (damaged, or written by another "
                          f"nncompile version); {fix}")
    return data


@contextlib.contextmanager
def _garbled(*dirs: Path) -> Iterator[None]:
    """Turn a malformed entry in manifest.json / plan.json into a ConfigError."""
    try:
        yield
    except NNCompileError:
        raise
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
        raise ConfigError(f"manifest.json or plan.json in {' or '.join(map(str, dirs))} has "
                          f"unexpected contents "
                          f"({type(e).__name__}: {e}); regenerate with parallelize(..., "
                          f"reuse='override')") from None


def _itemsize(dtype: str) -> int:
    import torch
    t = getattr(torch, str(dtype).replace("torch.", ""), None)
    if not isinstance(t, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}")
    return t.itemsize


class Instance:
    """An instance directory's manifest.json and plan.json, with the sums show and diff need."""

    def __init__(self, path: str | Path):
        self.dir = find_instance(path)
        self.manifest = _read_json(self.dir, "manifest.json", MANIFEST_KEYS)
        self.plan = _read_json(self.dir, "plan.json", PLAN_KEYS)
        with _garbled(self.dir):
            cfg = self.manifest["config"]
            self.config: dict[str, Any] = cfg
            self.plan_ngpus = int(cfg["plan_ngpus"])
            self.runtime_ngpus = int(cfg["runtime_ngpus"])
            # a pipelined plan unit: pipe ranks (stages) of tp tensor-parallel ranks each
            self.pipeline = self.plan.get("pipeline") or None
            if self.pipeline is not None and not self.pipeline.get("stages"):
                self.pipeline = None                # "auto" chose no pipeline
            self.pipe = int(self.pipeline["ranks"]) if self.pipeline else 1
            self.tp = self.plan_ngpus // self.pipe
            self.mesh = Mesh.of(self.tp, self.runtime_ngpus, self.pipe)
            self.dp = self.mesh.size(DP)
            self.training = not cfg.get("inference_only", False)
            self.ranks = {int(r): e for r, e in self.manifest["ranks"].items()}
            self.edited_names = set(edited_files(self.dir, self.manifest))
            self.rank_stats = {r: self._rank_stats(e) for r, e in sorted(self.ranks.items())}

    def _rank_stats(self, entry: dict) -> dict[str, int]:
        """Local parameter tensors, elements and bytes, and gradient bytes the reducer sends."""
        fp32 = self.config.get("reduce_in_fp32", False)
        stats = dict(params=0, elements=0, bytes=0, grad_partial=0, grad_dp=0, n_partial=0,
                     n_frozen=0)
        for p in entry["params"]:
            numel = math.prod(b - a for a, b in p["slices"])
            size = _itemsize(p["dtype"])
            stats["params"] += 1
            stats["elements"] += numel
            stats["bytes"] += numel * size
            if not self.training:
                continue
            grad = numel * (4 if fp32 and size < 4 else size)
            reduction = grad_reduction(self.mesh, p.get("partial_sum_count", 1) > 1,
                                       trainable=p.get("trainable", True))
            if reduction is not None and PLAN in reduction.dims:
                stats["grad_partial"] += grad
                stats["n_partial"] += 1
            elif reduction is not None:
                stats["grad_dp"] += grad
            stats["n_frozen"] += not p.get("trainable", True)
        return stats

    def full_model(self) -> tuple[int, int, int]:
        """(tensors, elements, bytes) of the unsplit model."""
        seen = {p["fqn"]: p for e in self.ranks.values() for p in e["params"]}  # all stages
        numels = {f: math.prod(p["full_shape"]) for f, p in seen.items()}
        return (len(seen), sum(numels.values()),
                sum(n * _itemsize(seen[f]["dtype"]) for f, n in numels.items()))

    def kind_counts(self) -> collections.Counter:
        """Every comm op of the program by kind (local ones included), counted from the rows
        the collectives table lists (`collective_ops`): the total and the kinds agree."""
        return collections.Counter(count_by_kind(self.plan["collective_ops"]))

    def comm_bytes(self) -> tuple[int, int]:
        rows = self.plan["collective_ops"]
        return (sum(r["forward_bytes"] for r in rows), sum(r["backward_bytes"] for r in rows))

    # ---- pipelined plans ----
    def stage_rows(self) -> dict[int, list[dict]]:
        """The collective rows of each stage (plan.json ops carry their stage)."""
        stage = {o["name"]: o.get("stage") for o in self.plan.get("ops", [])}
        out: dict[int, list[dict]] = {st["stage"]: [] for st in self.pipeline["stages"]}
        for r in self.plan["collective_ops"]:
            out.setdefault(stage.get(r["name"]) or 0, []).append(r)
        return out

    def rank_stages(self, rank: int) -> list[int]:
        """The stages a global rank runs."""
        pipe = self.mesh.pipe_of(rank)
        return [st["stage"] for st in self.pipeline["stages"] if st["pipe_rank"] == pipe]

    def rank_comm_bytes(self, rank: int) -> int:
        """Collective payload per step of one rank: its stages' collectives, M micro-batches
        (the whole program's collectives without a pipeline)."""
        if self.pipeline is None:
            return sum(self.comm_bytes())
        rows = self.stage_rows()
        m = int(self.pipeline.get("microbatches", 1))
        return m * sum(r["forward_bytes"] + r["backward_bytes"]
                       for s in self.rank_stages(rank) for r in rows.get(s, []))

    def file(self, rank: int) -> str:
        return self.ranks[rank].get("file", f"gencode{rank}.py")

    def edited(self, rank: int) -> str:
        """'' when gencode{rank}.py is as generated (or unrecorded), else why not."""
        if not (self.dir / self.file(rank)).is_file():
            return " (missing)"
        return " (edited)" if self.file(rank) in self.edited_names else ""


def _placement_name(text: str) -> str:
    p = parse_placement(text)
    if isinstance(p, Replicate):
        return "replicated (R)"
    if isinstance(p, Shard):
        return f"sharded on dim {p.dim} ({text})"
    return text


def _nbytes(b: int) -> str:
    return f"{b:,} B" if b < 1024 else f"{b:,} B ({fmt_bytes(b)})"


# ---- show ------------------------------------------------------------------------------------
def show(path: str | Path) -> str:
    """Per rank: parameters, collectives and gradient reduction per step; the plan summary."""
    p = Instance(path)
    with _garbled(p.dir):
        attention = _attention(p)
        return "\n".join(_summary(p) + [""] + (_stages(p) + [""] if p.pipeline else [])
                         + (attention + [""] if attention else [])
                         + _ranks(p) + [""] + _collectives(p) + [""] + _reduction(p))


def _summary(p: Instance) -> list[str]:
    m = p.manifest
    n, elements, nbytes = p.full_model()
    lines = [f"generated code in {p.dir}",
             f"  model {m['model']}   policy {m['policy']}   plan_ngpus {p.plan_ngpus}   "
             f"runtime_ngpus {p.runtime_ngpus}   data-parallel units {p.dp}"
             + ("   inference only" if not p.training else ""),
             "  inputs: " + ", ".join(f"{i['name']} {i['dtype'].replace('torch.', '')}"
                                      f"{i['shape']}" for i in m.get("inputs", [])),
             f"  full model: {n} parameters, {elements:,} elements, {_nbytes(nbytes)}"]
    places = collections.Counter(p.plan["params"].values())
    for place in sorted(places, key=lambda s: (s != "R", s)):
        lines.append(f"    {_placement_name(place)}: {places[place]}")
    partial = p.plan.get("partial_grad_params") or []
    if partial:
        lines.append(f"    with partial-sum gradients: {len(partial)}")
    auto = p.plan.get("autodist")
    if auto:
        per = "ms per micro-batch, all stages" if p.pipeline else "ms/step"
        lines.append(f"  autodist estimate on {auto.get('device', '?')}: "
                     f"{auto.get('objective_ms', float('nan')):.3f} {per}, "
                     f"{auto.get('memory_gb', float('nan')):.3f} GB/rank "
                     f"(solver {auto.get('solver', '?')}, {auto.get('solve_s', 0):.2f} s, "
                     f"{auto.get('variables', '?')} variables, "
                     f"{auto.get('constraints', '?')} constraints)")
    pp = p.pipeline
    searched = p.plan.get("pipeline") or {}
    if not pp and searched.get("auto"):
        lines.append(f"  parallel.pp='auto' chose one stage ({searched.get('chosen_by')});"
                     " nncompile.explain(DIR, 'pipeline') lists the stage counts tried")
    if pp:
        step = pp.get("predicted_step_ms")
        lines.append(f"  pipeline: {pp['nstages']} stages on {pp['ranks']} pipeline ranks x tp "
                     f"{pp['tp']}, {pp['schedule']}, {pp['microbatches']} micro-batches"
                     + (f", predicted {step:.3f} ms/step" if step is not None else ""))
    lines.append(f"  nncompile {m.get('nncompile_version', '?')}   fingerprint "
                 f"{str(m['fingerprint'])[:16]}")
    return lines


def _attention(p: Instance) -> list[str]:
    """What attention each scaled_dot_product_attention call runs (plan.json "attention",
    passes/fuse_attention.py), layers with the same form on one line."""
    rows = p.plan.get("attention") or []
    forms: dict[str, list[str]] = {}
    for r in rows:
        forms.setdefault(r["form"], []).append(r["module"] or "top level")
    lines = ["Attention (scaled_dot_product_attention calls)"] if rows else []
    for form, modules in forms.items():
        where = ", ".join(modules) if len(modules) <= 3 else \
            f"{modules[0]}, ..., {modules[-1]}"
        lines.append(f"  {len(modules)} x {form}: {where}")
    return lines


def _stages(p: Instance) -> list[str]:
    """A pipelined plan's stages: the cut, why, and per stage its layers, ranks, parameters,
    predicted time and memory and collectives."""
    from nncompile.passes.autodist.report import explain_pipeline
    pp = p.pipeline
    units = f"; data-parallel unit u adds {p.plan_ngpus} x u to the ranks" if p.dp > 1 else ""
    return ([f"Pipeline stages (ranks of plan unit 0{units}; mesh "
             + " x ".join(f"{name} {size}" for name, size in p.mesh.dims) + ")"]
            + ["  " + ln for ln in explain_pipeline(pp).splitlines()])


def _ranks(p: Instance) -> list[str]:
    staged = p.pipeline is not None
    rows = [("rank", "file") + (("stages",) if staged else ()) +
            ("params", "elements", "param bytes", "collectives/step", "grad reduction/step")]
    for r, s in p.rank_stats.items():
        where = (",".join(map(str, p.rank_stages(r))),) if staged else ()
        rows.append((r, p.file(r) + p.edited(r), *where, s["params"],
                     f"{s['elements']:,}", _nbytes(s["bytes"]), fmt_bytes(p.rank_comm_bytes(r)),
                     fmt_bytes(s["grad_partial"] + s["grad_dp"])))
    lines = ["Ranks (collectives and gradient reduction: payload bytes per rank per step)"]
    lines += align(rows)
    full = p.full_model()[2]
    for unit in range(p.dp):
        members = [r for r in p.rank_stats if p.mesh.unit_of(r) == unit]
        total = sum(p.rank_stats[r]["bytes"] for r in members)
        lines.append(f"  plan unit {unit} (ranks {members[0]}-{members[-1]}): parameters "
                     f"{_nbytes(total)} = {total / full if full else 0:.2f} x the full model")
    return lines


def _collectives(p: Instance) -> list[str]:
    step = "training step" if p.training else "step (inference only: forward)"
    rows = p.plan["collective_ops"]
    if p.pipeline is not None:
        lines = [f"Collectives per micro-batch, by stage (the ranks of a stage run the same; "
                 f"{p.pipeline.get('microbatches', 1)} micro-batches per {step}; payload bytes "
                 "per rank)"]
        for s, mine in sorted(p.stage_rows().items()):
            st = p.pipeline["stages"][s]
            ranks = st["ranks"]
            lines.append(f"  stage {s} (pipeline rank {st['pipe_rank']}, ranks {ranks[0]}-"
                         f"{ranks[-1]}): {len(mine)} collective(s)" if len(ranks) > 1 else
                         f"  stage {s} (pipeline rank {st['pipe_rank']}, rank {ranks[0]}): "
                         f"{len(mine)} collective(s)")
            lines += ["    " + ln for ln in format_rows(mine).splitlines()] if mine else []
        counts = p.kind_counts()
        if counts:
            lines.append("  by kind, all stages: " + ", ".join(f"{k} {v}"
                                                              for k, v in counts.most_common()))
        return lines
    lines = [f"Collectives per {step}, the same on every rank (payload bytes per rank)"]
    lines += ["  " + ln for ln in format_rows(rows).splitlines()] if rows else ["  none"]
    counts = p.kind_counts()
    if counts:
        lines.append("  by kind: " + ", ".join(f"{k} {v}" for k, v in counts.most_common()))
    return lines


def _reduction(p: Instance) -> list[str]:
    lines = ["Gradient reduction per step (runtime reducer, during backward)"]
    if not p.training:
        return lines + ["  none: inference only"]
    stats = p.rank_stats[min(p.rank_stats)]
    dims = grad_reduction(p.mesh, partial_sum=True).dims if p.tp > 1 else ()
    if p.pipeline is not None:
        where = (f"each stage's tensor-parallel ranks across the data-parallel units "
                 f"({p.tp * p.dp} ranks)" if dims == (DP, PLAN)
                 else f"each stage's tensor-parallel ranks ({p.tp})")
    else:
        where = (f"the world ({p.runtime_ngpus} ranks)" if dims == (DP, PLAN)
                 else f"the plan unit ({p.plan_ngpus} ranks)")
    if stats["n_partial"]:
        lines.append(f"  {stats['n_partial']} partial-sum gradients all-reduced (summed) over "
                     f"{where}: {fmt_bytes(stats['grad_partial'])} per rank")
    if stats["n_frozen"]:
        lines.append(f"  {stats['n_frozen']} frozen parameters: no gradient")
    if p.dp > 1:
        lines.append(f"  {stats['params'] - stats['n_partial'] - stats['n_frozen']} other "
                     "local gradients "
                     f"all-reduced (averaged) over the data-parallel group ({p.dp} ranks): "
                     f"{fmt_bytes(stats['grad_dp'])} per rank")
    else:
        lines.append("  other gradients: not reduced (one data-parallel unit)")
    total = sum(s["grad_partial"] + s["grad_dp"] for s in p.rank_stats.values())
    lines.append(f"  total over {len(p.rank_stats)} ranks: {fmt_bytes(total)}"
                 + ("; bf16/fp16 gradients reduced in float32" if
                    p.config.get("reduce_in_fp32") else ""))
    return lines


# ---- ir --------------------------------------------------------------------------------------
def _passes(inst: Path) -> list[tuple[str, str, Path]]:
    """(number, pass name, file) for every graphs/NN_<pass>.py, in pipeline order."""
    graphs = inst / "graphs"
    found = []
    for f in sorted(graphs.glob("[0-9][0-9]_*.py")) if graphs.is_dir() else []:
        number, _, name = f.stem.partition("_")
        found.append((number, name, f))
    if not found:
        raise ConfigError(f"no IR dumps in {graphs} (expected graphs/NN_<pass>.py); regenerate "
                          f"with parallelize(..., gen_savedir={str(inst.parent)!r}, "
                          "reuse='override')")
    return found


def ir_after(path: str | Path, pass_name: str | None = None) -> str:
    """The IR after `pass_name` (a name such as 'constant_fold', or its number); without one,
    the passes with their line counts."""
    inst = find_instance(path)
    passes = _passes(inst)
    if pass_name is None:
        rows = [(number, name, f"{len(f.read_text().splitlines())} lines")
                for number, name, f in passes]
        return "\n".join([f"IR after each pass in {inst / 'graphs'} "
                          "(nncompile ir DIR --after NAME|NUMBER):"] + align(rows))
    want = str(pass_name).strip()
    for number, name, f in passes:
        if want == name or (want.isdigit() and int(want) == int(number)):
            return f.read_text()
    raise ConfigError(f"no pass {want!r} in {inst / 'graphs'}; available: "
                      + ", ".join(f"{name} ({int(number)})" for number, name, _ in passes))


# ---- diff ------------------------------------------------------------------------------------
def diff(a: str | Path, b: str | Path, code: bool = False, rank: int = 0) -> str:
    """What differs between two plans; with code=True also gencode{rank}.py as a unified diff."""
    pa, pb = Instance(a), Instance(b)
    with _garbled(pa.dir, pb.dir):
        lines = [f"A: {pa.dir}", f"B: {pb.dir}"]
        changes = _plan_changes(pa, pb)
        same_fp = pa.manifest["fingerprint"] == pb.manifest["fingerprint"]
        if not changes:
            lines.append("identical plans: same config, policy, placements, collectives and "
                         "per-rank parameters" + ("" if same_fp else
                                                  " (fingerprints differ: the traced graph or "
                                                  "the nncompile version changed)"))
        lines += changes
        if code:
            lines += [""] + _code_diff(pa, pb, rank)
        return "\n".join(lines)


def _plan_changes(pa: Instance, pb: Instance) -> list[str]:
    """One block of lines per kind of difference; empty when the plans agree."""
    out = [f"{key}: {pa.manifest[key]} -> {pb.manifest[key]}" for key in ("model", "policy")
           if pa.manifest[key] != pb.manifest[key]]
    ca, cb = pa.config, pb.config
    out += [f"config.{k}: {ca.get(k)!r} -> {cb.get(k)!r}" for k in sorted(set(ca) | set(cb))
            if ca.get(k) != cb.get(k)]
    qa, qb = pa.plan["params"], pb.plan["params"]
    moved = [f"  {f}: {qa.get(f, 'absent')} -> {qb.get(f, 'absent')}"
             for f in list(qa) + [f for f in qb if f not in qa] if qa.get(f) != qb.get(f)]
    if moved:
        out += ["", f"parameter placements, A -> B ({len(moved)} of {len(set(qa) | set(qb))} "
                    "differ):"] + moved
    ka, kb = pa.kind_counts(), pb.kind_counts()
    (fa, ba), (fb, bb) = pa.comm_bytes(), pb.comm_bytes()
    if ka != kb or (fa, ba) != (fb, bb):
        rows = [("", "A", "B")]
        rows += [(k, ka.get(k, 0), kb.get(k, 0)) for k in sorted(set(ka) | set(kb))]
        rows += [("forward bytes/rank", fmt_bytes(fa), fmt_bytes(fb)),
                 ("backward bytes/rank", fmt_bytes(ba), fmt_bytes(bb))]
        out += ["", "collectives per step (count by kind, payload bytes):"] + align(rows)

    def per_rank(s):
        return s and (s["params"], s["bytes"], s["grad_partial"] + s["grad_dp"])
    sa, sb = pa.rank_stats, pb.rank_stats
    if any(per_rank(sa.get(r)) != per_rank(sb.get(r)) for r in set(sa) | set(sb)):
        rows = [("", "params A", "params B", "param bytes A", "param bytes B",
                 "grad reduction A", "grad reduction B")]
        for r in sorted(set(sa) | set(sb)):
            pair = (sa.get(r), sb.get(r))
            rows.append((f"rank {r}", *(s["params"] if s else "-" for s in pair),
                         *(_nbytes(s["bytes"]) if s else "-" for s in pair),
                         *(fmt_bytes(s["grad_partial"] + s["grad_dp"]) if s else "-"
                           for s in pair)))
        out += ["", "per rank: local parameters, gradient reduction per step:"] + align(rows)
    return out


def _code_diff(pa: Instance, pb: Instance, rank: int) -> list[str]:
    files = []
    for p in (pa, pb):
        if rank not in p.ranks:
            raise ConfigError(f"{p.dir} has no rank {rank}; its ranks are "
                              f"0..{max(p.ranks)}")
        f = p.dir / p.file(rank)
        if not f.is_file():
            raise ConfigError(f"{f} is missing; regenerate with parallelize(..., "
                              "reuse='override')")
        files.append(f)
    text = list(difflib.unified_diff(files[0].read_text().splitlines(),
                                     files[1].read_text().splitlines(),
                                     str(files[0]), str(files[1]), lineterm=""))
    return text or [f"{files[0].name}: identical"]


# ---- plot ------------------------------------------------------------------------------------
def plot(path: str | Path, output: str | Path) -> Path:
    """Draw the op graph into `output` (png, svg, pdf...): nncompile/tools/plot.py."""
    from .plot import plot_plan
    p = Instance(path)
    with _garbled(p.dir):
        return plot_plan(p.plan, p.manifest, Path(output))
