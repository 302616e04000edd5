"""What the lockstep exchange before each forward costs: measured with the check on vs off in
one run, and modelled up to 16,384 ranks.

    python benchmarks/lockstep.py [--worlds 2,4] [--steps 40] [--warmup 5] [--no-save]

Before each forward whose collectives span ranks, the ranks of the group that shares them
exchange a 40-byte row over a CPU (gloo) group (runtime/protocol/lockstep.py), so that a
forward one rank runs alone (rank-0-only evaluation) is joined by the others. The check is
`ComputeConfig(check_lockstep=...)`; this benchmark builds every plan twice, once with it and
once without, and steps the two in turn (the order rotating every round, each step after a
barrier), so load that drifts hits both alike. The model is the small step where the exchange
shows most: a 2-layer MLP (64 -> 256 -> 64, GELU), batch --batch rows per rank, AdamW from
nncompile.build_optimizer; a step is forward + backward + step, its time the slowest rank's.

Plans: dp, ZeRO-1, ZeRO-2, ZeRO-3 (data parallel over every rank) and tp (plan_ngpus = world).
For each: the exchange group's size G as the runtime made it, the median step with the check
off and on, and the median over rounds of (on - off) in milliseconds.

The cost model. The exchange is one all-gather of a row per rank over the G ranks of the
group; gloo runs it as a ring, G - 1 messages in a row, so per forward it costs about
c + (G - 1) x alpha: c what one exchange costs whatever its size (Python, packing the row,
waking gloo's thread), alpha the latency of one small message between two ranks; both fitted
here by least squares from the measured overheads of the plans that exchange (with one group
size only, c = 0). G follows from the plan and the number of ranks R (`group_size`, checked
against the groups the runtime made in the measured runs): 0 where forwards communicate
nothing (dp, ZeRO-1/2); the unit's ranks under tp / cp / ep; every data-parallel replica under
ZeRO-3, whose ranks gather the weights together. The table gives the model's per-forward cost
at 8, 64, 1,024 and 16,384 ranks with this machine's alpha and, at 16,384, with a cluster's
(--cluster-alpha-us: one small TCP message between nodes), tp 8 wide, and the ratio of the
1,024-rank figure to the 8-rank one: which plans' cost grows with the job.

The table is printed and appended to benchmarks/results/lockstep_cpu.txt unless --no-save.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import nncompile  # noqa: E402
from nncompile.runtime.protocol.lockstep import lockstep_group  # noqa: E402
from run_record import write_atomic  # noqa: E402
from tp_vs_dtensor import timed_step  # noqa: E402

RESULTS = os.path.join(HERE, "results")
PLANS = {"dp": dict(use_zero=0), "zero1": dict(use_zero=1), "zero2": dict(use_zero=2),
         "zero3": dict(use_zero=3), "tp": dict(use_zero=0, tp=True)}
MODEL_RANKS = (8, 64, 1024, 16384)
TP_WIDTH = 8                      # the tensor-parallel width of the modelled tp jobs (a node)


class MLP(torch.nn.Module):
    def __init__(self, width: int = 64, hidden: int = 256):
        super().__init__()
        self.fc1 = torch.nn.Linear(width, hidden)
        self.fc2 = torch.nn.Linear(hidden, width)

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.fc2(torch.nn.functional.gelu(self.fc1(x))), y)


def group_size(plan: str, ranks: int, tp: int) -> int:
    """The cost model's exchange group: how many ranks exchange before each forward under
    `plan` on `ranks` ranks with tensor parallelism `tp` wide (0: no exchange)."""
    if plan in ("dp", "zero1", "zero2"):
        return 0                  # forwards communicate nothing: no exchange
    if plan == "tp":
        return tp                 # the unit's ranks; the data-parallel replicas of it do not
    return ranks                  # ZeRO-3: every replica (and under tp, every rank of each)


def build(plan: str, check: bool, world: int, batch: dict, savedir: str):
    spec = PLANS[plan]
    torch.manual_seed(0)
    cfg = nncompile.ComputeConfig(world if spec.get("tp") else 1, world,
                                  use_zero=spec["use_zero"], check_lockstep=check)
    pm = nncompile.parallelize(MLP(), batch, cfg, pas_policy="tp" if spec.get("tp") else "dp",
                               gen_savedir=savedir, instance_name=f"lockstep_{plan}_{world}")
    return pm, nncompile.build_optimizer(pm, torch.optim.AdamW, lr=1e-3)


def run_world(rank: int, world: int, args, port: int, savedir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), NNCOMPILE_QUIET="1")
    torch.set_num_threads(1)
    nncompile.init_distributed()
    out = {}
    for plan in PLANS:
        g = torch.Generator().manual_seed(0 if PLANS[plan].get("tp") else rank)  # one per unit
        batch = {"x": torch.randn(args.batch, 64, generator=g),
                 "y": torch.randn(args.batch, 64, generator=g)}
        runs = {check: build(plan, check, world, batch, savedir) for check in (False, True)}
        group = lockstep_group(runs[True][0])
        times = {False: [], True: []}
        losses = {False: [], True: []}
        for i in range(args.warmup + args.steps):
            for check in ((False, True) if i % 2 else (True, False)):
                dist.barrier()
                t, loss = timed_step(*runs[check], batch)
                losses[check].append(loss)
                if i >= args.warmup:
                    times[check].append(t)
        every = [None] * world
        dist.all_gather_object(every, {"times": times, "losses": losses})
        off = [max(r["times"][False][i] for r in every) for i in range(args.steps)]
        on = [max(r["times"][True][i] for r in every) for i in range(args.steps)]
        out[plan] = {"group": 0 if group is None else dist.get_world_size(group),
                     "off_ms": statistics.median(off) * 1e3,
                     "on_ms": statistics.median(on) * 1e3,
                     "overhead_ms": statistics.median(b - a for a, b in zip(off, on)) * 1e3,
                     "same_losses": all(r["losses"][False] == r["losses"][True] for r in every)}
        del runs
    if rank == 0:
        with open(os.path.join(savedir, f"world{world}.json"), "w") as f:
            json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()


def fit(measured: dict[int, dict]) -> tuple[float, float]:
    """(c, alpha) in ms of overhead = c + (G - 1) x alpha over the runs that exchange (least
    squares; with one group size only, c = 0)."""
    points = [(m["group"] - 1, m["overhead_ms"]) for rows in measured.values()
              for m in rows.values() if m["group"] > 1]
    if not points:
        return 0.0, float("nan")
    xs = [x for x, _ in points]
    if len(set(xs)) < 2:
        return 0.0, statistics.median(y / x for x, y in points)
    mx, my = statistics.fmean(xs), statistics.fmean(y for _, y in points)
    alpha = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x in xs)
    alpha = max(alpha, 0.0)
    return max(my - alpha * mx, 0.0), alpha


def model_lines(measured: dict[int, dict], cluster_alpha_us: float) -> list[str]:
    """The cost model's table: c and alpha fitted from the measurements, then each plan's
    per-forward cost at MODEL_RANKS."""
    c, alpha = fit(measured)
    lines = [f"cost model: per forward c + (G - 1) x alpha, G the exchange group (gloo's ring "
             f"all-gather: G - 1 messages in a row); fitted here c = {c:.2f} ms, alpha = "
             f"{alpha:.3f} ms per message; a cluster's alpha = {cluster_alpha_us:.0f} us "
             f"(--cluster-alpha-us); tp {TP_WIDTH} wide, the rest data parallel",
             f"{'plan':<8}" + "".join(f"{'G@' + str(r):>9}" for r in MODEL_RANKS)
             + "".join(f"{'ms@' + str(r):>10}" for r in MODEL_RANKS)
             + f"{'cluster ms@' + str(MODEL_RANKS[-1]):>18}{'@1024/@8':>10}"]
    for plan in PLANS:
        sizes = [group_size(plan, r, TP_WIDTH) for r in MODEL_RANKS]
        cost = [c + (g - 1) * alpha if g > 1 else 0.0 for g in sizes]
        cluster = c + (sizes[-1] - 1) * cluster_alpha_us / 1e3 if sizes[-1] > 1 else 0.0
        growth = f"{cost[2] / cost[0]:10.1f}" if cost[0] else f"{'-':>10}"
        lines.append(f"{plan:<8}" + "".join(f"{g:9d}" for g in sizes)
                     + "".join(f"{x:10.2f}" for x in cost) + f"{cluster:18.2f}" + growth)
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worlds", default="2,4", help="comma-separated numbers of ranks")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--batch", type=int, default=8, help="rows per rank")
    ap.add_argument("--cluster-alpha-us", type=float, default=30.0,
                    help="one small message between two nodes (TCP), for the model's last column")
    ap.add_argument("--results-dir", default=RESULTS)
    ap.add_argument("--no-save", action="store_true", help="do not write a results file")
    args = ap.parse_args()
    worlds = [int(w) for w in args.worlds.split(",")]
    os.environ.setdefault("NNCOMPILE_QUIET", "1")
    measured: dict[int, dict] = {}
    with tempfile.TemporaryDirectory() as savedir:
        for world in worlds:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            mp.spawn(run_world, args=(world, args, port, savedir), nprocs=world)
            with open(os.path.join(savedir, f"world{world}.json")) as f:
                measured[world] = json.load(f)
    stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    lines = [f"nncompile lockstep exchange -- {stamp} on {socket.gethostname()} "
             f"({os.cpu_count()} cores), torch {torch.__version__}, gloo, 1 thread/rank",
             f"2-layer MLP 64-256-64, batch {args.batch} per rank, {args.steps} rounds after "
             f"{args.warmup} warmup, check on/off interleaved; step = slowest rank's "
             "forward + backward + AdamW; medians",
             f"{'ranks':<7}{'plan':<8}{'G':>4}{'off ms':>9}{'on ms':>9}{'on-off ms':>11}"
             f"{'x step':>8}  losses"]
    same = True
    for world, rows in measured.items():
        for plan, m in rows.items():
            expected = group_size(plan, world, world)
            if m["group"] != expected:      # the model's groups are the runtime's
                raise SystemExit(f"{plan} at {world} ranks: the runtime's exchange group has "
                                 f"{m['group']} ranks, the model says {expected}")
            same &= m["same_losses"]
            lines.append(f"{world:<7}{plan:<8}{m['group']:4d}{m['off_ms']:9.2f}"
                         f"{m['on_ms']:9.2f}{m['overhead_ms']:11.2f}"
                         f"{m['on_ms'] / m['off_ms']:8.2f}  "
                         f"{'equal' if m['same_losses'] else 'DIFFER'}")
    lines += model_lines(measured, args.cluster_alpha_us)
    print("\n".join(lines), flush=True)
    if not args.no_save:
        path = os.path.join(args.results_dir, "lockstep_cpu.txt")
        old = open(path).read() if os.path.exists(path) else ""
        write_atomic(path, old + "\n".join(
            [f"# python benchmarks/lockstep.py {' '.join(sys.argv[1:])}"] + lines) + "\n")
        print(f"appended to {os.path.relpath(path)}")
    if not same:
        raise SystemExit("check on and off trained different losses")


if __name__ == "__main__":
    main()
