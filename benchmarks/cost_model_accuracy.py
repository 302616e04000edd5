"""Cost-model accuracy: autodist's predicted step time against the measured one, per plan.

    torchrun --nproc_per_node=N benchmarks/cost_model_accuracy.py [--device cpu-gloo-2core]
             [--also-plan my.json] [--compare cpu] [--steps 8] [--mem-fractions 1,0.5,0]

Every rank builds the same GPT (examples/gpt.py, seed 0; default 4 blocks, d 256, 8 heads,
vocab 512, a batch of 8 x 128 tokens) once per plan:

    dp            plan_ngpus 1, N data-parallel units (each rank a 1/N share of the rows)
    data          plan_ngpus N: the batch split inside the unit, weights replicated
    tp            plan_ngpus N: Megatron tensor parallelism
    tp_sp         plan_ngpus N: Megatron + sequence parallelism
    autodist x3   plan_ngpus N, planned with the --device profile under three memory limits:
                  none, then leanest + f x (unlimited - leanest) bytes per rank for the other
                  --mem-fractions f (the modelled bytes of autodist's leanest and unlimited
                  plans)

Prediction. Each plan's graph, as the plan pass returns it, is costed by
`nncompile.passes.autodist.estimate_step` for its ComputeConfig and the profile: the same
terms the ILP sums (on autodist's own plans it is the ILP objective), split into compute,
collectives, gradient syncs, data-parallel reduction and optimizer step. --compare adds the
same plans' estimates under other profiles (the built-in 'cpu', a fresh `python -m nncompile
profile` file); --also-plan adds autodist's picks under other profiles (at their own three
limits) as more contenders, so one run measures the plans before and after calibration side
by side.

Measurement. A step is forward, backward (with the gradient reduction) and AdamW's step. All
plans train side by side: one repeat steps every plan once, the order rotating each repeat,
every step after a barrier, so load from other processes hits all plans alike. A step's time
is the slowest rank's; the median over --steps repeats after --warmup is reported. Plans that
compute the same losses (all of them: same weights, same global batches) are checked to agree
to --loss-rtol.

Statistics, over the distinct plans (autodist's picks that repeat another plan count once):
Spearman's rank correlation of predicted and measured step times, the median of
|predicted - measured| / measured, and for each memory limit whether autodist's pick is the
measured fastest of the plans whose modelled memory fits that limit, or within --tolerance.

CPU caveat. With more ranks than cores (4 ranks on a 2-core machine) ranks take turns on the
cores; a profile says so with `cores`, and the cost model stretches every rank's compute by
ranks / cores. The last line gives the 1-minute load average before and after the timed steps
and the share of the cores other processes used meanwhile: rerun when it is high.

The table is printed and appended to benchmarks/results/cost_model_cpu.txt (a '# command'
line, then the table); --json PATH writes every number.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
from gpt import GPT  # noqa: E402

import nncompile  # noqa: E402
from nncompile.runtime.program.loader import load_rank_module  # noqa: E402
from nncompile.frontend import trace  # noqa: E402
from nncompile.passes import build_pipeline, run_pipeline  # noqa: E402
from nncompile.passes.autodist import estimate_step, get_profile, leanest_memory, \
    plan_problem  # noqa: E402
from nncompile.passes.policies import get_policy  # noqa: E402
from pipeline import busy_cpu_s  # noqa: E402
from run_record import command, write_atomic  # noqa: E402

RESULTS = os.path.join(HERE, "results")


@dataclass
class Run:
    name: str
    policy: str
    plan: int                       # plan_ngpus
    pas_config: dict = field(default_factory=dict)
    limit_gb: float | None = None   # autodist's memory limit
    signature: str = ""             # the plan's placements (equal plans, equal signature)
    memory_gb: float = 0.0          # modelled bytes per rank
    predicted: dict = field(default_factory=dict)     # profile name -> estimate (ms by term)
    pm: object = None
    opt: object = None
    times: list = field(default_factory=list)         # (step, fwd+bwd, optimizer) per repeat
    losses: list = field(default_factory=list)

    def config(self, world: int) -> nncompile.ComputeConfig:
        return nncompile.ComputeConfig(self.plan, world, parallel=dict(self.pas_config))


def make_model(args) -> GPT:
    torch.manual_seed(0)
    return GPT(vocab_size=args.vocab, block_size=args.block, n_layer=args.n_layer,
               n_head=args.n_head, n_embd=args.n_embd)


def batch(args, step: int, part: slice | None = None) -> dict[str, torch.Tensor]:
    """Step `step`'s global batch (the same on every rank); `part`: this rank's rows (dp)."""
    g = torch.Generator().manual_seed(1000 + step)
    out = {k: torch.randint(0, args.vocab, (args.batch, args.block), generator=g)
           for k in ("idx", "targets")}
    return {k: v[part] for k, v in out.items()} if part is not None else out


def rows(run: Run, args, world: int, rank: int) -> slice | None:
    if run.plan == world:
        return None
    share = args.batch // (world // run.plan)
    return slice(rank * share, (rank + 1) * share)


# ---- predictions --------------------------------------------------------------------------
def planned(run: Run, args, world: int):
    """The graph the plan pass returns for this run."""
    config = run.config(world).resolved(world)
    graph = trace(make_model(args), batch(args, 0, rows(run, args, world, 0)))
    result = run_pipeline(graph, build_pipeline(config, get_policy(run.policy)))
    return next(g for name, g, _ in result.history if name == "plan"), config


def signature(g, est: dict) -> str:
    """Equal for plans that place every weight alike and cost the same under the profile
    (e.g. `data` and an autodist plan that chunks the targets after their view, not before)."""
    params = [(v.fqn, repr(v.placement)) for v in g.params]
    return repr((g.plan_ngpus, params, round(est["total"], 6), round(est["memory_gb"], 9)))


def predict(runs: list[Run], args, world: int, profiles: list[str]) -> list[Run]:
    """Plan every run (rank 0), cost it under each profile; autodist's limits between its
    leanest and its unlimited plan's bytes (per planning profile). Runs whose limit no plan
    fits are dropped."""
    out = []
    base_gb, lean_gb = {}, {}
    for run in runs:
        dev = run.pas_config.get("device")
        if run.policy == "autodist" and run.limit_gb is not None:
            run.limit_gb = lean_gb[dev] + run.limit_gb * (base_gb[dev] - lean_gb[dev])
            run.pas_config["mem_limit_gb"] = run.limit_gb
            run.name = f"{run.name.split(' ')[0]} <= {run.limit_gb * 1e3:.1f} MB"
        try:
            g, config = planned(run, args, world)
        except nncompile.PlanInfeasibleError as e:
            print(f"{run.name}: skipped, {str(e).splitlines()[0]}", flush=True)
            continue
        for prof in profiles:
            pc = {**run.pas_config, "device": prof}
            est = estimate_step(g, nncompile.ComputeConfig(
                run.plan, world, parallel=pc).resolved(world))
            run.predicted[get_profile(prof).name] = est.ms()
        run.memory_gb = run.predicted[get_profile(profiles[0]).name]["memory_gb"]
        run.signature = signature(g, run.predicted[get_profile(profiles[0]).name])
        if run.policy == "autodist":
            ilp = g.plan_state.autodist["objective_ms"]
            mine = run.predicted[get_profile(dev).name]["total"]
            assert abs(ilp - mine) <= 1e-6 * max(1.0, ilp), (run.name, ilp, mine)
            if run.limit_gb is None:
                base_gb[dev] = run.predicted[get_profile(dev).name]["memory_gb"]
                _, prob = plan_problem(g, config)
                lean_gb[dev] = leanest_memory(prob) / 1e9 * (1 + 1e-6)
        out.append(run)
    return out


# ---- build and train ----------------------------------------------------------------------
def instance(run: Run) -> str:
    return "".join(c if c.isalnum() else "_" for c in run.name)


def build(args, runs: list[Run], savedir: str, world: int) -> None:
    rank = dist.get_rank()
    error = None
    for i, run in enumerate(runs):
        if i % world != rank:
            continue
        try:
            nncompile.parallelize(make_model(args), batch(args, 0, rows(run, args, world, 0)),
                                  run.config(world), pas_policy=run.policy,
                                  gen_savedir=savedir, instance_name=instance(run),
                                  load_module=False)
        except nncompile.NNCompileError as e:
            error = f"{run.name}: {type(e).__name__}: {e}"
    errors = [None] * world
    dist.all_gather_object(errors, error)
    if any(errors):
        raise SystemExit("compilation failed: " + "; ".join(e for e in errors if e))
    for run in runs:
        plan = json.loads((Path(savedir) / instance(run) / "plan.json").read_text())
        if run.policy == "autodist" and plan.get("autodist"):
            ms = run.predicted[get_profile(run.pas_config["device"]).name]["total"]
            got = plan["autodist"]["objective_ms"]
            if abs(got - ms) > 1e-6 * max(1.0, ms):
                raise SystemExit(f"{run.name}: the compiled plan's objective {got} ms is not "
                                 f"the one predicted ({ms} ms): the plans differ")
        run.pm = load_rank_module(Path(savedir) / instance(run), rank, make_model(args),
                                  None, run.config(world).resolved(world))
        run.opt = torch.optim.AdamW(run.pm.parameters(), lr=args.lr)


def train(args, runs: list[Run], world: int) -> float:
    """Every repeat steps every plan once; per step and rank: (wall, wall of forward +
    backward, wall of the optimizer, process CPU seconds of the step, of the optimizer)."""
    rank = dist.get_rank()
    t0 = time.perf_counter()
    for i in range(args.warmup + args.steps):
        k = i % len(runs)
        for run in runs[k:] + runs[:k]:                     # rotate the order
            data = batch(args, i, rows(run, args, world, rank))
            dist.barrier()
            start, cpu = time.perf_counter(), time.process_time()
            loss = run.pm(**data)
            loss.backward()
            mid, cpu_mid = time.perf_counter(), time.process_time()
            run.opt.step()
            run.opt.zero_grad(set_to_none=True)
            end, cpu_end = time.perf_counter(), time.process_time()
            run.losses.append(loss.item())
            if i >= args.warmup:
                run.times.append((end - start, mid - start, end - mid, cpu_end - cpu,
                                  cpu_end - cpu_mid))
    return time.perf_counter() - t0


# ---- statistics ---------------------------------------------------------------------------
def ranks_of(xs: list[float]) -> list[float]:
    order = sorted(range(len(xs)), key=xs.__getitem__)
    out = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(a: list[float], b: list[float]) -> float:
    ra, rb = ranks_of(a), ranks_of(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    var = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return cov / var if var else float("nan")


def accuracy(pred: list[float], meas: list[float]) -> tuple[float, float]:
    return spearman(pred, meas), statistics.median(abs(p - m) / m for p, m in zip(pred, meas))


# ---- the report ---------------------------------------------------------------------------
def measured(args, world: int, group: list[Run], every: list[dict]) -> dict[str, float]:
    """Medians (ms) over the repeats of every run in `group` (runs of the same plan pool
    their steps): `wall`, the slowest rank's step; `cpu`, the step a machine without other
    processes would take by the ranks' CPU time: max(the busiest rank's, all ranks' /
    min(cores, ranks)) (ranks beyond the cores take turns); and the parts."""
    per = [[r[run.name]["times"][i] for r in every] for run in group
           for i in range(args.steps)]
    cores = min(os.cpu_count() or 1, world)

    def med(f):
        return statistics.median(f(ranks) for ranks in per) * 1e3
    return {"wall": med(lambda rs: max(t[0] for t in rs)),
            "fwd_bwd": med(lambda rs: max(t[1] for t in rs)),
            "optimizer": med(lambda rs: max(t[2] for t in rs)),
            "cpu": med(lambda rs: max(max(t[3] for t in rs), sum(t[3] for t in rs) / cores)),
            "cpu_optimizer": med(lambda rs: max(t[4] for t in rs))}


def report(args, world: int, runs: list[Run], every: list[dict], load: list[float],
           build_s: float, train_s: float, n_params: int) -> tuple[list[str], dict]:
    prof = args.profile_name
    first: dict[str, Run] = {}
    for run in runs:
        first.setdefault(run.signature, run)
    distinct = list(first.values())
    own = {run.name: measured(args, world, [run], every) for run in runs}
    pooled = {r.signature: measured(args, world, [x for x in runs if x.signature == r.signature],
                                    every) for r in distinct}
    meas = {run.name: pooled[run.signature] for run in runs}       # a plan's, pooled
    n = args.warmup + args.steps
    gloss = {run.name: [sum(r[run.name]["losses"][i] for r in every) / world
                        for i in range(n)] for run in runs}
    ref = gloss[runs[0].name]
    loss_err = max(abs(a - b) / max(1.0, abs(b)) for run in runs
                   for a, b in zip(gloss[run.name], ref))
    host = socket.gethostname()
    stamp = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    width = max(len(r.name) for r in runs) + 2
    lines = [
        f"nncompile cost-model accuracy -- {stamp} on {host} ({os.cpu_count()} cores)",
        f"GPT {args.n_layer}L d{args.n_embd} h{args.n_head} vocab {args.vocab} "
        f"({n_params / 1e6:.2f}M params), batch {args.batch}x{args.block} tokens per step, "
        f"{world} ranks (gloo, cpu), torch {torch.__version__}, {args.threads} thread(s)/rank",
        f"predicted with profile '{prof}'; {args.steps} timed repeats after {args.warmup} "
        f"warmup, all plans interleaved; medians; a step = forward + backward + AdamW step",
        "wall = the slowest rank's step; cpu = the step by CPU time, max(busiest rank, all "
        f"ranks / {min(os.cpu_count() or 1, world)} cores): what other processes' load "
        "does not inflate; runs of the same plan are listed apart, their steps pooled for "
        "the statistics",
        "",
        f"{'plan':{width}}{'model MB':>9}{'predicted':>10}{'wall':>8}{'cpu':>8}"
        f"{'pred/wall':>10}{'pred/cpu':>9}{'  model: compute':>16}{'comm':>6}{'sync':>6}"
        f"{'dp':>5}{'opt':>6}{'  meas: fwd+bwd':>15}{'opt':>6}{'opt cpu':>8}",
    ]
    for run in runs:
        p, m = run.predicted[prof], own[run.name]
        lines.append(f"{run.name:{width}}{run.memory_gb * 1e3:9.1f}{p['total']:10.1f}"
                     f"{m['wall']:8.1f}{m['cpu']:8.1f}{p['total'] / m['wall']:10.2f}"
                     f"{p['total'] / m['cpu']:9.2f}{p['compute']:16.1f}{p['comm']:6.1f}"
                     f"{p['grad_sync']:6.1f}{p['grad_reduce']:5.1f}{p['optimizer']:6.1f}"
                     f"{m['fwd_bwd']:15.1f}{m['optimizer']:6.1f}{m['cpu_optimizer']:8.1f}")
    same = [f"{r.name} = {first[r.signature].name}" for r in runs if first[r.signature] is not r]
    if same:
        lines.append("the same plan: " + "; ".join(same))
        for r in distinct:
            if any(x.signature == r.signature and x is not r for x in runs):
                lines.append(f"  {r.name}: pooled wall {meas[r.name]['wall']:.1f} ms, cpu "
                             f"{meas[r.name]['cpu']:.1f} ms")
    stats: dict[str, dict] = {}
    for basis in ("wall", "cpu"):
        for name in [prof] + [get_profile(c).name for c in args.compare]:
            rho, err = accuracy([r.predicted[name]["total"] for r in distinct],
                                [meas[r.name][basis] for r in distinct])
            stats.setdefault(basis, {})[name] = {"spearman": rho, "median_rel_error": err}
            lines.append(f"{basis:4} profile {name!r:30} {len(distinct)} distinct plans: "
                         f"Spearman {rho:+.2f}, median |pred - meas| / meas {err:.1%}")
    picks = []
    for run in runs:
        if run.policy != "autodist":
            continue
        by = get_profile(run.pas_config["device"]).name
        for basis in ("wall", "cpu"):
            fits = [r for r in distinct
                    if run.limit_gb is None or r.memory_gb <= run.limit_gb * (1 + 1e-9)]
            best = min(fits, key=lambda r: meas[r.name][basis])
            mine = [r for r in fits if r.plan == run.plan]
            best_mine = min(mine, key=lambda r: meas[r.name][basis])
            gap = meas[run.name][basis] / meas[best.name][basis] - 1
            gap_mine = meas[run.name][basis] / meas[best_mine.name][basis] - 1
            picks.append({"run": run.name, "planned_with": by, "basis": basis,
                          "plan": first[run.signature].name, "fastest": best.name, "gap": gap,
                          "fastest_same_plan_ngpus": best_mine.name, "gap_same": gap_mine})
            lines.append(
                f"{basis:4} {run.name} ({by}): {first[run.signature].name}, "
                f"{meas[run.name][basis]:.1f} ms; {gap:+.1%} vs the fastest of the "
                f"{len(fits)} plans that fit ({best.name}: "
                f"{'within' if gap <= args.tolerance else 'NOT within'} "
                f"{args.tolerance:.0%}); {gap_mine:+.1%} vs the fastest at plan_ngpus "
                f"{run.plan} ({best_mine.name})")
    lines.append(f"losses over {n} steps: max relative difference {loss_err:.1e} "
                 f"({'equal' if loss_err <= args.loss_rtol else 'MISMATCH'} within "
                 f"{args.loss_rtol:g})")
    others = f"; other processes used {load[2]:.0%} of the {os.cpu_count()} cores meanwhile" \
        if len(load) > 2 else ""
    lines.append(f"wall: plan + build {build_s:.1f} s, interleaved steps {train_s:.1f} s; "
                 f"1-minute load average {load[0]:.1f} before the steps, {load[1]:.1f} after"
                 f"{others}")
    names = [args.device] + list(args.compare)
    record = {
        "benchmark": "cost_model_accuracy", "time": stamp, "host": host,
        "cpus": os.cpu_count(), "command": command("benchmarks/cost_model_accuracy.py", world),
        "torch": torch.__version__, "world": world, "config": vars(args),
        "n_params": n_params, "loadavg": load, "profile": prof,
        "profiles": {get_profile(c).name: get_profile(c).to_json() for c in names},
        "stats": stats, "picks": picks, "loss_max_rel_diff": loss_err,
        "build_s": build_s, "train_s": train_s,
        "runs": {run.name: {"policy": run.policy, "plan_ngpus": run.plan,
                            "pas_config": run.pas_config, "limit_gb": run.limit_gb,
                            "same_as": first[run.signature].name, "memory_gb": run.memory_gb,
                            "predicted_ms": run.predicted, "measured_ms": meas[run.name],
                            "own_measured_ms": own[run.name],
                            "losses": [r[run.name]["losses"] for r in every],
                            "steps": [[list(r[run.name]["times"][i]) for r in every]
                                      for i in range(args.steps)]}
                 for run in runs}}
    return lines, record


def from_record(path: str) -> tuple[list[str], dict]:
    """The report of a --json record again (e.g. after the report changed)."""
    rec = json.loads(Path(path).read_text())
    args = argparse.Namespace(**rec["config"])
    world = rec["world"]
    runs, every = [], [{} for _ in range(world)]
    for name, r in rec["runs"].items():
        run = Run(name, r["policy"], r["plan_ngpus"], dict(r["pas_config"]), r["limit_gb"],
                  signature=r["same_as"], memory_gb=r["memory_gb"], predicted=r["predicted_ms"])
        runs.append(run)
        for k in range(world):
            every[k][name] = {"times": [step[k] for step in r["steps"]],
                              "losses": r["losses"][k]}
    real = sys.argv
    sys.argv = rec["command"].split()[2:]        # the recorded command line
    try:
        return report(args, world, runs, every, rec["loadavg"], rec["build_s"],
                      rec["train_s"], rec["n_params"])
    finally:
        sys.argv = real


# ---- calibration --------------------------------------------------------------------------
# profile fields the fit scales, each by a factor exp(x): FLOP/s (every dtype), the element-wise
# bandwidth, attention's efficiency, the call overhead of an op, a collective's fixed cost, the
# latency per ring step, the link bandwidth and AdamW's time per element
FIT_FIELDS = ("flops", "mem_bandwidth", "attention", "op_overhead", "collective_overhead",
              "intra_latency", "intra_bandwidth", "optimizer_element_s")
FLOORS = {"collective_overhead": 2e-5, "intra_latency": 5e-6}    # start values of clamped fits
ATTENTION = "scaled_dot_product_attention"


def scaled(base, x) -> "DeviceProfile":
    import dataclasses
    f = dict(zip(FIT_FIELDS, (float(v) for v in x)))
    import math
    k = {name: math.exp(v) for name, v in f.items()}
    eff = dict(base.op_efficiency or {})
    eff[ATTENTION] = min(1.0, eff.get(ATTENTION, 1.0) * k["attention"])
    return dataclasses.replace(
        base, flops={d: v * k["flops"] for d, v in base.flops.items()},
        mem_bandwidth=base.mem_bandwidth * k["mem_bandwidth"], op_efficiency=eff,
        op_overhead=(base.op_overhead or 0.0) * k["op_overhead"],
        collective_overhead=max(base.collective_overhead, FLOORS["collective_overhead"])
        * k["collective_overhead"],
        intra_latency=max(base.intra_latency, FLOORS["intra_latency"]) * k["intra_latency"],
        intra_bandwidth=base.intra_bandwidth * k["intra_bandwidth"],
        optimizer_element_s=(base.optimizer_element_s or 0.0) * k["optimizer_element_s"])


def fit_profile(paths: list[str], base_name: str, name: str, basis: str, prior: float):
    """Fit FIT_FIELDS of profile `base_name` to the step times of benchmark records (their
    --json files): least squares of log(predicted / measured) over every distinct plan of
    every record, plus `prior` x log(factor) per field (the micro-benchmarks are the prior).
    The plans are re-planned from each record (deterministic), so autodist's picks are the
    ones measured."""
    import dataclasses
    import math

    import numpy as np
    from scipy.optimize import least_squares
    base = dataclasses.replace(get_profile(base_name), name=name)
    cases = []
    for path in paths:
        rec = json.loads(Path(path).read_text())
        args = argparse.Namespace(**rec["config"])
        world = rec["world"]
        for rname, r in rec["runs"].items():
            if r["same_as"] != rname:
                continue
            run = Run(rname, r["policy"], r["plan_ngpus"], dict(r["pas_config"]))
            g, _ = planned(run, args, world)
            pc = {k: v for k, v in run.pas_config.items() if k != "device"}
            config = nncompile.ComputeConfig(run.plan, world, parallel=pc).resolved(world)
            cases.append((path, world, rname, g, config, r["measured_ms"][basis]))

    def predict_all(prof):
        return [estimate_step(g, c, prof).total * 1e3 for _, _, _, g, c, _ in cases]

    def residuals(x):
        pred = predict_all(scaled(base, x))
        return [math.log(p / c[-1]) for p, c in zip(pred, cases)] + list(prior * np.asarray(x))
    x0 = np.zeros(len(FIT_FIELDS))
    sol = least_squares(residuals, x0, method="trf", x_scale=1.0, max_nfev=400)
    fitted = scaled(base, sol.x)
    before, after = predict_all(scaled(base, x0)), predict_all(fitted)
    lines = [f"fit of {len(FIT_FIELDS)} factors of profile '{get_profile(base_name).name}' to "
             f"{len(cases)} plans ({basis} step times of {', '.join(paths)}), prior {prior:g}:"]
    lines += [f"  {f:22} x{math.exp(v):.3f}" for f, v in zip(FIT_FIELDS, sol.x)]
    for path in paths:
        rows = [(c[2], c[1], b, a, c[-1]) for c, b, a in zip(cases, before, after)
                if c[0] == path]
        meas = [r[4] for r in rows]
        for label, k in (("measured profile", 2), ("fitted profile", 3)):
            rho, err = accuracy([r[k] for r in rows], meas)
            lines.append(f"  {path} ({rows[0][1]} ranks), {label}: Spearman {rho:+.2f}, "
                         f"median relative error {err:.1%}")
        lines += [f"    {r[0]:42} measured {r[4]:8.1f}  before {r[2]:8.1f}  after {r[3]:8.1f}"
                  for r in rows]
    lines.append(f"-> {json.dumps(fitted.to_json())}")
    return fitted, lines


def save(args, lines: list[str], record: dict) -> None:
    os.makedirs(args.results_dir, exist_ok=True)
    path = os.path.join(args.results_dir, "cost_model_cpu.txt")
    old = open(path).read() if os.path.exists(path) else ""
    block = [f"# {record['command']}   (gloo, {record['world']} ranks)"] + \
        [ln for ln in lines if ln]
    write_atomic(path, old + "\n".join(block) + "\n")
    print(f"appended to {os.path.relpath(path)}")


def floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu-gloo-2core",
                    help="the profile autodist plans and predicts with (name or .json)")
    ap.add_argument("--compare", type=lambda s: [x for x in s.split(",") if x], default=[],
                    help="more profiles to predict the same plans with (comma-separated)")
    ap.add_argument("--also-plan", type=lambda s: [x for x in s.split(",") if x], default=[],
                    help="profiles autodist also plans with (their picks measured too, e.g. "
                         "an uncalibrated profile; comma-separated)")
    ap.add_argument("--mem-fractions", type=floats, default=[1.0, 0.5, 0.0],
                    help="autodist's memory limits: 1 = none, else f: leanest + f x "
                         "(unlimited - leanest) modelled bytes per rank")
    ap.add_argument("--steps", type=int, default=8, help="timed repeats of every plan")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=256)
    ap.add_argument("--n-head", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--tolerance", type=float, default=0.05,
                    help="autodist's pick may be this much slower than the fastest plan")
    ap.add_argument("--loss-rtol", type=float, default=1e-3)
    ap.add_argument("--results-dir", default=RESULTS)
    ap.add_argument("--json", help="also write every number to this file")
    ap.add_argument("--no-save", action="store_true", help="do not write a results file")
    ap.add_argument("--fit", type=lambda s: [x for x in s.split(",") if x], default=[],
                    help="calibrate instead (no torchrun): fit --device's profile to these "
                         "--json records, write it to --fit-output")
    ap.add_argument("--report-from", help="print (and append) the report of a --json record")
    ap.add_argument("--fit-basis", choices=("wall", "cpu"), default="wall")
    ap.add_argument("--fit-prior", type=float, default=0.1,
                    help="weight pulling each factor towards the measured profile's value")
    ap.add_argument("--fit-name", default="cpu-gloo-2core")
    ap.add_argument("--fit-output", default="calibrated.json")
    args = ap.parse_args()
    os.environ.setdefault("NNCOMPILE_QUIET", "1")
    if args.report_from:
        lines, record = from_record(args.report_from)
        print("\n".join(lines))
        if not args.no_save:
            save(args, lines, record)
        return
    if args.fit:
        from nncompile.passes.autodist import save_profile
        prof, lines = fit_profile(args.fit, args.device, args.fit_name, args.fit_basis,
                                  args.fit_prior)
        print("\n".join(lines))
        print(f"written to {save_profile(prof, args.fit_output)}")
        if not args.no_save:
            path = os.path.join(args.results_dir, "cost_model_calibration.txt")
            old = open(path).read() if os.path.exists(path) else ""
            cmd = "python benchmarks/cost_model_accuracy.py " + " ".join(sys.argv[1:])
            write_atomic(path, old + "\n".join([f"# {cmd}"] + lines) + "\n")
            print(f"appended to {os.path.relpath(path)}")
        return
    warnings.filterwarnings("ignore", category=UserWarning, module="torch.distributed")
    nncompile.init_distributed("gloo")
    torch.set_num_threads(args.threads)
    rank, world = dist.get_rank(), dist.get_world_size()
    args.profile_name = get_profile(args.device).name
    args.compare = list(dict.fromkeys(c for c in args.also_plan + args.compare
                                      if get_profile(c).name != args.profile_name))
    runs = [Run("dp (plan 1)", "dp", 1), Run("data", "data", world), Run("tp", "tp", world),
            Run("tp_sp", "tp_sp", world)]
    for i, dev in enumerate([args.device] + args.also_plan):
        tag = "autodist" if i == 0 else f"autodist@{get_profile(dev).name}"
        for f in args.mem_fractions:
            limit = None if f >= 1 else f
            runs.append(Run(tag if limit is None else f"{tag} x{f:g}", "autodist", world,
                            {"device": dev}, limit))
    t0 = time.perf_counter()
    box = [None, None]
    if rank == 0:
        box = [predict(runs, args, world, [args.device] + list(args.compare)),
               tempfile.mkdtemp(prefix="cost_model_bench_")]
    dist.broadcast_object_list(box, src=0)
    runs, savedir = box
    build(args, runs, savedir, world)
    build_s = time.perf_counter() - t0
    load = [os.getloadavg()[0]]
    machine, mine = busy_cpu_s(), time.process_time()
    train_s = train(args, runs, world)
    load.append(os.getloadavg()[0])
    ours = [None] * world
    dist.all_gather_object(ours, time.process_time() - mine)
    if machine is not None:
        load.append(max(0.0, busy_cpu_s() - machine - sum(ours)) /
                    ((os.cpu_count() or 1) * train_s))
    mine = {run.name: {"times": run.times, "losses": run.losses} for run in runs}
    every = [None] * world
    dist.all_gather_object(every, mine)
    ok = True
    if rank == 0:
        shutil.rmtree(savedir, ignore_errors=True)
        lines, record = report(args, world, runs, every, load, build_s, train_s,
                               sum(p.numel() for p in make_model(args).parameters()))
        print("\n".join(lines), flush=True)
        ok = record["loss_max_rel_diff"] <= args.loss_rtol
        if not args.no_save:
            save(args, lines, record)
        if args.json:
            write_atomic(os.path.abspath(args.json), json.dumps(record, indent=1) + "\n")
        if not ok:
            print("ERROR: plans that compute the same losses differ beyond float32 noise",
                  flush=True)
    dist.barrier()
    dist.destroy_process_group()
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
