"""nncompile data parallel vs torch DistributedDataParallel on the GPT, side by side in one run.

    python benchmarks/dp_vs_ddp.py [--sizes tiny,small,base] [--nproc 2] [--steps 30]
                                   [--device cpu|cuda]

Every rank builds the same GPT (examples/gpt.py, seed 0, vocab 512, 8 heads) three times per
size: one copy wrapped in DDP, two compiled with the `dp` policy (plan_ngpus 1, data parallel
over the --nproc ranks), one with the sync reducer and one with the async one. A training step
is forward, backward (with the gradient all-reduce) and AdamW. The three contenders step in
turn, the order rotating every round, each step starting after a barrier (so no rank carries
another contender's lag into it); a step's time is the slowest rank's. Reported after
--warmup: each contender's median step time, and DDP / ours = the median over rounds of
(DDP's step / ours in the same round), which cancels load that drifts between rounds
(>= 1.0: ours is at least as fast). The same ratio of the CPU time all ranks spend in a
step (process time, which waiting does not count) is printed beside it: on a machine that
other jobs share it shows the work each contender does, which their load hardly changes.
All three start from the same weights and train on the same batches, so their losses are
the same numbers up to float32 reordering; the first and last are printed, and a difference
beyond --loss-rtol fails the run (exit status 1).

Sizes (batch --batch x --block tokens per rank):

    tiny   d 64,  2 blocks  (0.14M parameters)
    small  d 128, 4 blocks  (0.88M)
    base   d 256, 4 blocks  (3.32M; the default model)

Without --sizes one model of --n-layer x --n-embd (default: base) runs. Afterwards the `tp`
plan of the last size is compiled and each rank's parameter bytes are reported as a fraction
of the full model. The table is printed and appended to benchmarks/results/dp_vs_ddp_cpu.txt
(dp_vs_ddp_cuda.txt with --device cuda), unless --no-save; --json PATH writes every number.
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
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
from gpt import GPT  # noqa: E402

import nncompile  # noqa: E402
from run_record import write_atomic  # noqa: E402

RESULTS = os.path.join(HERE, "results")
SIZES = {"tiny": (2, 64), "small": (4, 128), "base": (4, 256)}     # name: (blocks, width)
CONTENDERS = ("ddp", "dp sync", "dp async")


def make_model(args, size: tuple[int, int]) -> GPT:
    torch.manual_seed(0)
    n_layer, n_embd = size
    return GPT(vocab_size=512, block_size=args.block, n_layer=n_layer, n_head=8, n_embd=n_embd)


def timed_step(module, opt, batch, device) -> tuple[float, float, float]:
    """(wall seconds, this process's CPU seconds, loss) of one training step."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    start, cpu = time.perf_counter(), time.process_time()
    loss = module(**batch)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, time.process_time() - cpu, loss.item()


def tp_param_fraction(args, size, savedir: str) -> list[float]:
    """Each rank's parameter bytes under the tp plan (plan_ngpus = nproc) / the full model's."""
    model = make_model(args, size)
    batch = {"idx": torch.zeros(args.batch, args.block, dtype=torch.long),
             "targets": torch.zeros(args.batch, args.block, dtype=torch.long)}
    out = nncompile.parallelize(model, batch, nncompile.ComputeConfig(args.nproc, args.nproc),
                                pas_policy="tp", gen_savedir=savedir, instance_name="tp",
                                load_module=False)
    manifest = json.loads((out / "manifest.json").read_text())
    full = sum(p.numel() for p in model.parameters())
    fractions = []
    for r in range(args.nproc):
        local = 0
        for p in manifest["ranks"][str(r)]["params"]:
            n = 1
            for a, b in p["slices"]:
                n *= b - a
            local += n
        fractions.append(local / full)
    return fractions


def run_size(args, name: str, size, rank: int, device, savedir: str) -> dict:
    """Time the three contenders on one model size; every rank returns its own numbers."""
    g = torch.Generator().manual_seed(1000 + rank)
    batches = [{k: torch.randint(0, 512, (args.batch, args.block), generator=g).to(device)
                for k in ("idx", "targets")} for _ in range(4)]
    ddp_model = make_model(args, size).to(device)
    ddp = torch.nn.parallel.DistributedDataParallel(
        ddp_model, device_ids=[rank] if device.type == "cuda" else None)
    runs = {"ddp": (ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-3))}
    for label, async_ in (("dp sync", False), ("dp async", True)):
        cfg = nncompile.ComputeConfig(1, args.nproc, use_async_reducer=async_)
        pm = nncompile.parallelize(make_model(args, size).to(device), batches[0], cfg,
                                   pas_policy="dp", gen_savedir=savedir, instance_name=f"dp_{name}")
        runs[label] = (pm, nncompile.build_optimizer(pm, torch.optim.AdamW, lr=1e-3))
    times: dict[str, list[float]] = {k: [] for k in runs}
    cpu: dict[str, list[float]] = {k: [] for k in runs}
    losses: dict[str, list[float]] = {k: [] for k in runs}
    names = list(runs)
    load = os.getloadavg()[0]
    for i in range(args.warmup + args.steps):
        for label in names[i % len(names):] + names[:i % len(names)]:      # rotate the order
            module, opt = runs[label]
            dist.barrier()
            t, c, loss = timed_step(module, opt, batches[i % len(batches)], device)
            losses[label].append(loss)
            if i >= args.warmup:
                times[label].append(t)
                cpu[label].append(c)
    return {"times": times, "cpu": cpu, "losses": losses, "load": [load, os.getloadavg()[0]],
            "params": sum(p.numel() for p in ddp_model.parameters())}


def worker(rank: int, args, port: int, savedir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(args.nproc), LOCAL_RANK=str(rank), NNCOMPILE_QUIET="1")
    torch.set_num_threads(args.threads)
    nncompile.init_distributed()
    device = torch.device(f"cuda:{rank}" if args.device == "cuda" else "cpu")
    out = {}
    for name, size in args.size_table:
        mine = run_size(args, name, size, rank, device, savedir)
        every = [None] * args.nproc
        dist.all_gather_object(every, mine)
        if rank == 0:
            out[name] = every
    if rank == 0:
        with open(os.path.join(savedir, "results.json"), "w") as f:
            json.dump([dist.get_backend(), out], f)
    dist.barrier()
    dist.destroy_process_group()


def summarize(args, backend: str, results: dict) -> tuple[list[str], dict, bool]:
    """The table (lines), the record for --json, and whether the losses agree."""
    stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    lines = [f"nncompile dp vs DDP -- {stamp} on {socket.gethostname()} ({os.cpu_count()} cores)",
             f"GPT vocab 512, 8 heads, batch {args.batch}x{args.block} per rank, {args.nproc} "
             f"ranks ({backend}, {args.device}), torch {torch.__version__}, {args.threads} "
             f"thread(s)/rank",
             f"{args.steps} timed rounds after {args.warmup} warmup, contenders interleaved; a "
             "step = the slowest rank's forward + backward + AdamW; medians; DDP/x = median "
             "over rounds of DDP's step / x's; cpu x = the same for the CPU time all ranks "
             "spent in the step (what other processes' load does not change)",
             f"{'size':<7}{'model':<17}{'ddp ms':>8}{'sync ms':>9}{'async ms':>9}"
             f"{'DDP/sync':>10}{'DDP/async':>10}{'cpu sync':>10}{'cpu async':>10}"
             f"   {'loss first':>10}{'loss last':>10}"
             f"{'max rel diff':>14}"]
    record = {"benchmark": "dp_vs_ddp", "time": stamp, "cpus": os.cpu_count(),
              "torch": torch.__version__, "config": {k: v for k, v in vars(args).items()
                                                     if k != "size_table"}, "sizes": {}}
    same = True
    for (name, (n_layer, n_embd)), every in zip(args.size_table, results.values()):
        step = {k: [max(r["times"][k][i] for r in every) for i in range(args.steps)]
                for k in CONTENDERS}
        med = {k: statistics.median(v) for k, v in step.items()}
        ratio = {k: statistics.median(a / b for a, b in zip(step["ddp"], step[k]))
                 for k in CONTENDERS[1:]}
        cpu = {k: [sum(r["cpu"][k][i] for r in every) for i in range(args.steps)]
               for k in CONTENDERS}
        cpu_ratio = {k: statistics.median(a / b for a, b in zip(cpu["ddp"], cpu[k]))
                     for k in CONTENDERS[1:]}
        losses = every[0]["losses"]      # this rank's losses: each contender saw the same batches
        ref = torch.tensor(losses["ddp"], dtype=torch.float64)
        diff = max(float(((torch.tensor(losses[k], dtype=torch.float64) - ref).abs()
                          / ref.abs()).max()) for k in CONTENDERS[1:])
        same &= diff <= args.loss_rtol
        model = f"{n_layer}L d{n_embd} {every[0]['params'] / 1e6:.2f}M"
        lines.append(f"{name:<7}{model:<17}" + "".join(f"{med[k] * 1e3:{w}.2f}" for k, w in
                                                       zip(CONTENDERS, (8, 9, 9)))
                     + f"{ratio['dp sync']:10.3f}{ratio['dp async']:10.3f}"
                     + f"{cpu_ratio['dp sync']:10.3f}{cpu_ratio['dp async']:10.3f}"
                     f"   {losses['ddp'][0]:10.5f}{losses['ddp'][-1]:10.5f}{diff:14.1e}")
        record["sizes"][name] = {"n_layer": n_layer, "n_embd": n_embd,
                                 "params": every[0]["params"], "median_s": med,
                                 "ddp_over": ratio, "cpu_ddp_over": cpu_ratio,
                                 "cpu_s": cpu,
                                 "step_s": step, "losses_rank0": losses,
                                 "loadavg": every[0]["load"]}
    loads = [r[0]["load"] for r in results.values()]
    lines.append(f"losses of ddp, dp sync, dp async: {'equal' if same else 'MISMATCH'} within "
                 f"{args.loss_rtol:g} (rank 0, {args.warmup + args.steps} steps each); 1-minute "
                 f"load average {loads[0][0]:.1f} before, {loads[-1][1]:.1f} after")
    return lines, record, same


def save(args, lines: list[str], record: dict) -> None:
    """Append this run's table to <results-dir>/dp_vs_ddp_<device>.txt (a '# command' line,
    then the table); --json: every number."""
    os.makedirs(args.results_dir, exist_ok=True)
    path = os.path.join(args.results_dir, f"dp_vs_ddp_{args.device}.txt")
    argv, shown = sys.argv[1:], []
    while argv:
        a = argv.pop(0)
        if a in ("--results-dir", "--json"):
            argv = argv[1:]
        elif not a.startswith(("--results-dir=", "--json=")):
            shown.append(a)
    old = open(path).read() if os.path.exists(path) else ""
    block = [f"# python {' '.join(['benchmarks/dp_vs_ddp.py'] + shown)}"] + lines
    write_atomic(path, old + "\n".join(block) + "\n")
    print(f"appended to {os.path.relpath(path)}")
    if args.json:
        write_atomic(os.path.abspath(args.json), json.dumps(record, indent=1) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default=None,
                    help=f"comma-separated, of {', '.join(SIZES)} (default: --n-layer x --n-embd)")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--n-layer", type=int, default=SIZES["base"][0])
    ap.add_argument("--n-embd", type=int, default=SIZES["base"][1])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--loss-rtol", type=float, default=1e-4)
    ap.add_argument("--results-dir", default=RESULTS)
    ap.add_argument("--json", help="also write every number to this file")
    ap.add_argument("--no-save", action="store_true", help="do not write a results file")
    args = ap.parse_args()
    if args.sizes:
        unknown = [s for s in args.sizes.split(",") if s not in SIZES]
        if unknown:
            ap.error(f"unknown size(s) {unknown}; choose from {list(SIZES)}")
        args.size_table = [(s, SIZES[s]) for s in args.sizes.split(",")]
    else:
        size = (args.n_layer, args.n_embd)
        name = next((k for k, v in SIZES.items() if v == size), "custom")
        args.size_table = [(name, size)]
    os.environ.setdefault("NNCOMPILE_QUIET", "1")
    with tempfile.TemporaryDirectory() as savedir:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(worker, args=(args, port, savedir), nprocs=args.nproc)
        with open(os.path.join(savedir, "results.json")) as f:
            backend, results = json.load(f)
        fractions = tp_param_fraction(args, args.size_table[-1][1], savedir)
    lines, record, same = summarize(args, backend, results)
    lines.append(f"tp plan of {args.size_table[-1][0]} (plan_ngpus {args.nproc}): parameter bytes "
                 "per rank / full model: "
                 + ", ".join(f"rank {r} {f:.3f}" for r, f in enumerate(fractions)))
    print("\n".join(lines), flush=True)
    if not args.no_save:
        save(args, lines, record)
    if not same:
        print("ERROR: the contenders' losses differ beyond float32 noise", flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
