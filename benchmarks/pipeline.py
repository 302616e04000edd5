"""Pipeline parallelism on the GPT: measured bubble per schedule, and pp x tp against tp and dp.

    torchrun --nproc_per_node=4 benchmarks/pipeline.py [--steps 5] [--microbatches 4,8,16]

Every rank builds the same GPT (examples/gpt.py, seed 0, --n-layer 8 so that 4 pipeline ranks
can hold 2 stages each) once per run below, and all runs train side by side: one repeat steps
every run once (`pm.train_step` + AdamW), the order rotating each repeat, every step after a
barrier, so machine noise hits all runs alike; medians over --steps repeats after --warmup.

(a) bubble, pp 4 (plan_ngpus = 4 = pipeline_stages, tp 1) for every schedule and each M in
    --microbatches, at --micro rows per micro-batch (the unit's batch is micro x M rows):
    gpipe, 1f1b, interleaved_1f1b (V=2), zero_bubble (V=1: ScheduleInterleavedZeroBubble,
    V=2: ScheduleZBVZeroBubble), dualpipev (V=2, M >= 2S); V=2 needs at least 2 x 4 layers.

    How it is measured. On every rank, each PipelineStage the schedule runs gets its
    `forward_one_chunk`, `backward_one_chunk` and `backward_weight_one_chunk` wrapped with a
    timer (perf_counter before and after). These are the stage's compute: the schedule waits
    for the micro-batch's activations (or their gradients) before calling them and posts the
    sends after, so the time between them is time the rank waits on its pipeline neighbours
    (or spends in p2p calls). The schedule's `step` is wrapped the same way. Then, per rank and
    step,

        busy    = sum of the wrapped compute calls' wall time in that step
        bubble  = 1 - busy / (wall time of schedule.step)

    averaged over the 4 ranks; the median over the repeats is reported. The loss the schedule
    computes (a division by M) runs outside the wrapped calls and counts as bubble; it is
    microseconds. The denominator is the schedule alone: train_step's tie-gradient all-reduce
    and loss broadcast after it (a few ms) are in the step time, not in the bubble.

    Next to it: the textbook bubble of GPipe/1F1B, (S - 1) / (M + S - 1), and the schedule's
    paper's at F : B : W = 1 : 2 : 1 (passes/schedule_time.textbook_bubble, which the action
    list's simulation reproduces): interleaved (S - 1) / (V M + S - 1); ZB-H1 (zero_bubble,
    V=1) (S - 1) / (3 M + S - 1), ZB-V (V=2) (S - 1) / (6 M + S - 1) and DualPipeV (S - 1) /
    (3 M + S - 1), the last three only when input- and weight-backward take equal time (they
    do not here: a weight-gradient matmul costs about a forward, the input gradient more),
    and all of them assuming equal stages and free p2p.

    CPU caveat. On a machine with fewer cores than ranks (4 ranks on the 2-core CI box) the
    ranks share cores: while all four compute (1F1B's steady state) each compute call runs
    slower than while only one or two do (warm-up, cool-down). The wall-clock busy time above
    includes that slow-down, as it includes any rank's time lost to waiting; the table shows
    the factor as `stretch` = busy wall time / busy thread CPU time (1.0 on a core per rank).
    `cores busy` = (thread CPU time of all ranks' compute calls) / (min(cores, ranks) x the
    schedule's wall time): with a core per rank it is 1 - bubble; with fewer cores than ranks
    it says how much of the machine the stages kept busy (near 1: the step is bound by the
    cores, and no schedule could be faster). So the measured bubbles are those of this
    machine, not of 4 dedicated devices; run with as many cores as ranks for the textbook's
    setting (on 2 cores: --nproc_per_node=2, pp 2). Other processes on the machine take cores
    too: the last line gives the 1-minute load average before and after the timed steps and
    the share of the cores used by processes other than the ranks meanwhile (/proc/stat's busy
    time minus the ranks' own CPU time).

(b) step time of one GPT on the same batch (micro x --mb-compare rows) under pp 2 x tp 2
    (1f1b, M = --mb-compare), tp 4 (the whole batch in one forward) and dp 4 (each rank a
    quarter of the rows), plus pp 4 x tp 1 (1f1b, from (a)); the `tp` policy for tp, `dp` for
    dp. Their losses are the same numbers (mean over micro-batches = mean over the batch;
    dp: mean over ranks) and are printed side by side; a difference beyond float32 reordering
    (--loss-rtol) fails the run (exit status 1).

Compilation is split over the ranks (each compiles a share of the runs with
load_module=False, then every rank loads its file of each), so start-up stays short.

The table is printed and appended to benchmarks/results/pipeline_cpu.txt; --json PATH writes
every number.
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
from run_record import command, write_atomic  # noqa: E402

RESULTS = os.path.join(HERE, "results")
SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zero_bubble", 1),
             ("zero_bubble", 2), ("dualpipev", 2))


@dataclass
class Run:
    name: str
    part: str                      # "a" (bubble) or "b" (pp x tp vs tp vs dp)
    config: nncompile.ComputeConfig
    policy: str
    rows: int                      # rows of the unit's batch
    schedule: str = ""
    v: int = 1
    m: int = 1
    pm: object = None
    opt: object = None
    timer: object = None
    times: list = field(default_factory=list)     # train_step wall per repeat
    bubble: list = field(default_factory=list)    # (busy, busy cpu, schedule wall) per repeat
    losses: list = field(default_factory=list)


def make_model(args) -> GPT:
    torch.manual_seed(0)
    return GPT(vocab_size=args.vocab, block_size=args.block, n_layer=args.n_layer,
               n_head=args.n_head, n_embd=args.n_embd)


def batch(args, step: int, rows: int, part: slice | None = None) -> dict[str, torch.Tensor]:
    """Step `step`'s global batch (the same on every rank), its first `rows` rows; `part`:
    this rank's share of them (dp)."""
    g = torch.Generator().manual_seed(1000 + step)
    out = {k: torch.randint(0, args.vocab, (rows, args.block), generator=g)
           for k in ("idx", "targets")}
    return {k: v[part] for k, v in out.items()} if part is not None else out


def plan_runs(args, world: int) -> list[Run]:
    runs = []
    for m in args.microbatches:
        for schedule, v in SCHEDULES:
            if v * world > args.n_layer or (schedule == "dualpipev" and m < 2 * world):
                continue
            pas = {"pp": world, "schedule": schedule, "microbatches": m,
                   "stages_per_rank": v}
            runs.append(Run(f"pp{world} {schedule} V{v} M{m}", "a",
                            nncompile.ComputeConfig(world, world, parallel=pas), "tp",
                            args.micro * m, schedule, v, m))
    m = args.mb_compare
    rows = args.micro * m
    if world % 2 == 0 and world > 2:
        runs.append(Run(f"pp2 x tp{world // 2}", "b", nncompile.ComputeConfig(
            world, world, parallel={"pp": 2, "schedule": "1f1b",
                                      "microbatches": m}), "tp", rows, "1f1b", 1, m))
    runs.append(Run(f"tp{world}", "b", nncompile.ComputeConfig(world, world), "tp", rows))
    if rows % world == 0:
        runs.append(Run(f"dp{world}", "b", nncompile.ComputeConfig(1, world), "dp",
                        rows // world))
    return runs


def instance(run: Run) -> str:
    return run.name.replace(" ", "_")


def build(args, runs: list[Run], savedir: str) -> None:
    """Rank r compiles runs r, r + world, ... (no process group needed); then every rank
    loads its own file of each run."""
    rank, world = dist.get_rank(), dist.get_world_size()
    error = None
    for i, run in enumerate(runs):
        if i % world != rank:
            continue
        try:
            nncompile.parallelize(make_model(args), batch(args, 0, run.rows), run.config,
                                  pas_policy=run.policy, gen_savedir=savedir,
                                  instance_name=instance(run), load_module=False)
        except nncompile.NNCompileError as e:
            error = f"{run.name}: {type(e).__name__}: {e}"
    errors = [None] * world
    dist.all_gather_object(errors, error)
    if any(errors):
        raise SystemExit("compilation failed: " + "; ".join(e for e in errors if e))
    for run in runs:
        run.pm = load_rank_module(Path(savedir) / instance(run), rank, make_model(args),
                                  None, run.config.resolved(world))
        run.opt = torch.optim.AdamW(run.pm.parameters(), lr=args.lr)
        if run.pm.pipeline is not None:
            run.timer = StageTimer(run.pm)


class StageTimer:
    """Wall and thread-CPU time of this rank's stage compute calls, and the schedule's step."""

    CALLS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")

    def __init__(self, pm):
        schedule = pm.pipeline.schedule
        stages = getattr(schedule, "_stages", None) or [schedule._stage]
        self.busy = self.cpu = self.step = 0.0
        for stage in stages:
            for name in self.CALLS:
                setattr(stage, name, self._timed(getattr(stage, name)))
        inner = schedule.step

        def step(*a, **k):
            start = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                self.step += time.perf_counter() - start
        schedule.step = step

    def _timed(self, fn):
        def call(*a, **k):
            start, cpu = time.perf_counter(), time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                self.busy += time.perf_counter() - start
                self.cpu += time.thread_time() - cpu
        return call

    def take(self) -> tuple[float, float, float]:
        out = (self.busy, self.cpu, self.step)
        self.busy = self.cpu = self.step = 0.0
        return out


def busy_cpu_s() -> float | None:
    """CPU seconds the whole machine has spent busy (Linux /proc/stat), or None."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)          # idle + iowait
    return (sum(fields[:7]) - idle) / os.sysconf("SC_CLK_TCK")     # steal left out


def train(args, runs: list[Run]) -> float:
    rank, world = dist.get_rank(), dist.get_world_size()
    t0 = time.perf_counter()
    for i in range(args.warmup + args.steps):
        k = i % len(runs)
        for run in runs[k:] + runs[:k]:                      # rotate the order
            part = slice(rank * run.rows, (rank + 1) * run.rows) \
                if run.config.plan_ngpus == 1 else None
            data = batch(args, i, run.rows * (world if part else 1), part)
            dist.barrier()
            start = time.perf_counter()
            loss = run.pm.train_step(**data)
            wall = time.perf_counter() - start
            run.opt.step()
            run.opt.zero_grad(set_to_none=True)
            run.losses.append(loss.item())
            timed = run.timer.take() if run.timer is not None else None
            if i >= args.warmup:
                run.times.append(wall)
                if timed is not None:
                    run.bubble.append(timed)
    return time.perf_counter() - t0


# ---- the report ----------------------------------------------------------------------------
def textbook(s: int, m: int) -> float:
    return (s - 1) / (m + s - 1)


def paper_bubble(schedule: str, s: int, v: int, m: int) -> float:
    """The schedule's paper's bubble (the `model` column) as a number."""
    from nncompile.passes.schedule_time import textbook_bubble
    return textbook_bubble(schedule, s, v, m)


def model_bubble(schedule: str, s: int, v: int, m: int) -> str:
    """The schedule's paper's bubble at F : B : W = 1 : 2 : 1 (passes/schedule_time.py, which
    autodist's step model reproduces from the action list); * where it assumes a split
    backward's halves take equal time."""
    from nncompile.passes.schedule_time import textbook_bubble
    star = "*" if schedule in ("zero_bubble", "dualpipev") else ""
    return f"{textbook_bubble(schedule, s, v, m):.3f}{star}"


def summarize(every: list[dict], name: str, steps: int) -> dict:
    """Medians over repeats of: the slowest rank's train_step, the rank-mean bubble, busy
    and stretch."""
    step = statistics.median(max(r[name]["times"][i] for r in every) for i in range(steps))
    out = {"step": step}
    if every[0][name]["bubble"]:
        rows = [[r[name]["bubble"][i] for r in every] for i in range(steps)]
        out["bubble"] = statistics.median(
            sum(1 - b / w for b, _, w in ranks) / len(ranks) for ranks in rows)
        out["sched"] = statistics.median(max(w for _, _, w in ranks) for ranks in rows)
        out["busy"] = statistics.median(sum(b for b, _, _ in ranks) / len(ranks)
                                        for ranks in rows)
        out["stretch"] = statistics.median(sum(b for b, _, _ in ranks) /
                                           max(1e-9, sum(c for _, c, _ in ranks))
                                           for ranks in rows)
        cores = min(os.cpu_count() or 1, len(every))
        out["cores_busy"] = statistics.median(sum(c for _, c, _ in ranks) /
                                              (cores * max(w for _, _, w in ranks))
                                              for ranks in rows)
        out["per_rank_bubble"] = [statistics.median(1 - rows[i][r][0] / rows[i][r][2]
                                                    for i in range(steps))
                                  for r in range(len(every))]
    return out


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(1.0, abs(b))


def report(args, world: int, runs: list[Run], every: list[dict], build_s: float,
           train_s: float, n_params: int, load: list[float]) -> bool:
    stats = {run.name: summarize(every, run.name, args.steps) for run in runs}
    n = args.warmup + args.steps
    gloss = {run.name: [sum(r[run.name]["losses"][i] for r in every) / world for i in range(n)]
             for run in runs}
    host = socket.gethostname()
    stamp = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    lines = [
        f"nncompile pipeline parallelism -- {stamp} on {host} ({os.cpu_count()} cores)",
        f"GPT {args.n_layer}L d{args.n_embd} h{args.n_head} vocab {args.vocab} "
        f"({n_params / 1e6:.2f}M params), {args.micro}x{args.block} tokens per micro-batch, "
        f"{world} ranks ({dist.get_backend()}, cpu), torch {torch.__version__}, "
        f"{args.threads} thread(s)/rank",
        f"{args.steps} timed repeats after {args.warmup} warmup, all runs interleaved; "
        f"medians; a step = the slowest rank's train_step",
        "",
        f"(a) bubble at pp {world}: 1 - (stage compute wall time) / (schedule.step wall "
        f"time), mean over ranks",
        f"{'schedule':18}{'V':>3}{'M':>4}{'step ms':>10}{'busy ms':>10}{'measured':>10}"
        f"{'textbook':>10}{'model':>9}{'stretch':>9}{'cores busy':>12}",
    ]
    same = True
    for m in args.microbatches:
        group = [run for run in runs if run.part == "a" and run.m == m]
        for run in group:
            st = stats[run.name]
            model = model_bubble(run.schedule, world, run.v, m)
            lines.append(f"{run.schedule:18}{run.v:>3}{m:>4}{st['step'] * 1e3:10.1f}"
                         f"{st['busy'] * 1e3:10.1f}{st['bubble']:10.3f}"
                         f"{textbook(world, m):10.3f}{model:>9}{st['stretch']:9.2f}"
                         f"{st['cores_busy']:12.2f}")
        gaps = {run.schedule + (f" V={run.v}" if run.v > 1 else ""):
                abs(stats[run.name]["bubble"] - paper_bubble(run.schedule, world, run.v, m))
                for run in group}
        worst = max(gaps, key=gaps.get)
        lines.append(f"{'':25}largest gap to the schedule's paper bubble at M={m}: "
                     f"{gaps[worst]:.3f} of the step ({worst}); every schedule within "
                     f"{args.bubble_tol:g}: {'yes' if gaps[worst] <= args.bubble_tol else 'NO'}")
        err = max(rel(a, b) for run in group for a, b in zip(gloss[run.name], gloss[group[0].name]))
        same &= err <= args.loss_rtol
        lines.append(f"{'':25}losses of the {len(group)} schedules at M={m}: max relative "
                     f"difference {err:.1e} ({'equal' if err <= args.loss_rtol else 'MISMATCH'})")
    lines += [
        "textbook = (S-1)/(M+S-1) (GPipe, 1F1B); model = the schedule's paper at F:B:W = "
        "1:2:1: interleaved (S-1)/(VM+S-1), * ZB-H1 (S-1)/(3M+S-1), ZB-V (S-1)/(6M+S-1), "
        "DualPipeV (S-1)/(3M+S-1) (passes/schedule_time.py);",
        "stretch = stage compute wall / thread CPU time (1.00 when every rank has a core "
        "of its own);",
        f"cores busy = stage compute CPU time of all ranks / (min(cores, ranks) = "
        f"{min(os.cpu_count() or 1, world)} x schedule.step wall): 1 - bubble with a core per "
        f"rank; near 1 the cores, not the schedule, set the step time",
        "",
        f"(b) one GPT, one batch of {args.micro * args.mb_compare}x{args.block} tokens per "
        f"step, {world} ranks",
        f"{'plan':22}{'step ms':>10}{'vs tp':>8}{'loss step 0':>13}{'loss last':>11}"
        f"{'max rel diff vs tp':>20}",
    ]
    part_b = [run for run in runs if run.part == "b"]
    pp_ref = next((run for run in runs if run.part == "a" and run.schedule == "1f1b"
                   and run.m == args.mb_compare), None)
    if pp_ref is not None:
        part_b.insert(1, pp_ref)
    tp = next(run for run in part_b if run.name == f"tp{world}")
    for run in part_b:
        err = max(rel(a, b) for a, b in zip(gloss[run.name], gloss[tp.name]))
        same &= err <= args.loss_rtol
        label = run.name if run.part == "b" else f"pp{world} x tp1 (1f1b M{run.m})"
        if run.part == "b" and run.m > 1:
            label += f" (1f1b M{run.m})"
        lines.append(f"{label:22}{stats[run.name]['step'] * 1e3:10.1f}"
                     f"{stats[run.name]['step'] / stats[tp.name]['step']:8.2f}"
                     f"{gloss[run.name][0]:13.5f}{gloss[run.name][-1]:11.5f}{err:20.1e}")
    lines.append(f"losses over {n} steps: {'equal' if same else 'MISMATCH'} within "
                 f"{args.loss_rtol:g}")
    others = f"; other processes used {load[2]:.0%} of the {os.cpu_count()} cores meanwhile" \
        if len(load) > 2 else ""
    lines.append(f"wall: build {build_s:.1f} s, interleaved steps {train_s:.1f} s; 1-minute load "
                 f"average {load[0]:.1f} before the steps, {load[1]:.1f} after{others}")
    print("\n".join(lines), flush=True)
    if not args.no_save:
        save(args, lines, {
            "benchmark": "pipeline", "time": stamp, "host": host, "cpus": os.cpu_count(),
            "command": command('benchmarks/pipeline.py', world), "torch": torch.__version__, "world": world,
            "config": vars(args), "n_params": n_params, "loadavg": load,
            "runs": {run.name: {"schedule": run.schedule, "stages_per_rank": run.v,
                                "microbatches": run.m, "rows": run.rows, **stats[run.name],
                                "losses": gloss[run.name],
                                "step_s": [max(r[run.name]["times"][i] for r in every)
                                           for i in range(args.steps)]}
                     for run in runs}})
    if not same:
        print("ERROR: runs that compute the same losses differ beyond float32 noise",
              flush=True)
    return same


def save(args, lines: list[str], record: dict) -> None:
    """Append this run's table to <results-dir>/pipeline_cpu.txt (a '# command' line, then
    the table), and --json: the full record."""
    os.makedirs(args.results_dir, exist_ok=True)
    path = os.path.join(args.results_dir, "pipeline_cpu.txt")
    old = open(path).read() if os.path.exists(path) else ""
    block = [f"# {record['command']}   (gloo, {record['world']} ranks)"] + \
        [ln for ln in lines if ln]
    write_atomic(path, old + "\n".join(block) + "\n")
    print(f"appended to {os.path.relpath(path)}")
    if args.json:
        write_atomic(os.path.abspath(args.json), json.dumps(record, indent=1) + "\n")


def ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=5, help="timed repeats of every run")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--microbatches", type=ints, default=[4, 8, 16],
                    help="M values for the bubble table (comma-separated)")
    ap.add_argument("--micro", type=int, default=2, help="rows per micro-batch")
    ap.add_argument("--mb-compare", type=int, default=8,
                    help="(b): micro-batches of the pipelined runs; the batch is micro x this")
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--n-layer", type=int, default=8)
    ap.add_argument("--n-embd", type=int, default=128)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--loss-rtol", type=float, default=1e-4)
    ap.add_argument("--bubble-tol", type=float, default=0.05,
                    help="how far (a share of the step) a measured bubble may be from its "
                         "schedule's paper value")
    ap.add_argument("--results-dir", default=RESULTS)
    ap.add_argument("--json", help="also write every number to this file")
    ap.add_argument("--no-save", action="store_true", help="do not write a results file")
    args = ap.parse_args()
    os.environ.setdefault("NNCOMPILE_QUIET", "1")
    warnings.filterwarnings("ignore", category=UserWarning, module="torch.distributed")
    nncompile.init_distributed("gloo")
    torch.set_num_threads(args.threads)
    rank, world = dist.get_rank(), dist.get_world_size()
    box = [tempfile.mkdtemp(prefix="pipeline_bench_") if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    savedir = box[0]
    runs = plan_runs(args, world)
    t0 = time.perf_counter()
    build(args, runs, savedir)
    build_s = time.perf_counter() - t0
    load = [os.getloadavg()[0]]
    machine, mine = busy_cpu_s(), time.process_time()
    train_s = train(args, runs)
    load.append(os.getloadavg()[0])
    ours = [None] * world
    dist.all_gather_object(ours, time.process_time() - mine)
    if machine is not None:       # the share of the cores other processes used meanwhile
        load.append(max(0.0, busy_cpu_s() - machine - sum(ours)) /
                    ((os.cpu_count() or 1) * train_s))
    mine = {run.name: {"times": run.times, "bubble": run.bubble, "losses": run.losses}
            for run in runs}
    every = [None] * world
    dist.all_gather_object(every, mine)
    same = True
    if rank == 0:
        shutil.rmtree(savedir, ignore_errors=True)
        same = report(args, world, runs, every, build_s, train_s,
                      sum(p.numel() for p in make_model(args).parameters()), load)
    dist.barrier()
    dist.destroy_process_group()
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
