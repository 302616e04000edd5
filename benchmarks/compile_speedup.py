"""torch.compile of the generated program: ComputeConfig(compile=True) against the same generated
module run eagerly, on the GPT, forward + backward.

    torchrun --nproc_per_node=1 benchmarks/compile_speedup.py            # dp on 1 rank
    torchrun --nproc_per_node=2 benchmarks/compile_speedup.py            # tp plan 2, and dp
    [--plans tp,dp] [--steps 20] [--warmup 3] [--n-layer 4] [--n-embd 256] [--threads 1]
    torchrun --nproc_per_node=1 benchmarks/compile_speedup.py --device cuda --dtype bfloat16 \
        --gpt2-small                                                     # GPT-2 small on a GPU

Every rank builds the same GPT (examples/gpt.py, seed 0, vocab 512, 8 heads) twice per plan and
parallelizes both copies with the same plan: one eager, one with compile=True (inductor; its
collectives traced as functional collectives). Each contender trains with AdamW on the same
batches; the two step in turn, the order alternating every step, so machine noise hits both
alike. The timed part is forward + backward (what compile changes; AdamW runs untimed), each
step's time the slowest rank's; medians after --warmup. The first compiled step (tracing and
inductor's code generation, with an empty inductor cache unless --warm-cache) is reported
separately. On one rank the eager model itself runs too ("model"), so the table also gives the
generated module's overhead over it (eager/model).

The loss check. In float32 all contenders start from the same weights, so their losses agree
to float32 reordering: a difference from eager's beyond --loss-rtol (1e-4) fails the run. In
bfloat16 eager and compiled legitimately part ways: inductor fuses pointwise ops and computes
them in float32, rounding to bf16 only where a kernel stores, so every step rounds differently
from eager, and 20-odd AdamW steps on bf16 weights amplify that. The loss itself is a bf16
number (1/32 apart near 6: 0.4-0.8 % relative), so even the first step, before any update,
can differ by one such step (measured on a CPU, GPT 4L d256, 23 steps: first losses 6.3125
eager, 6.28125 compiled, 6.2853 float32; eager vs compiled 1.2e-2 apart over the run, eager
8.6e-3 from float32, compiled 4.3e-3, while compiled float32 stays within 8e-7 of the float32
model; on an H100 they were seen 9.6e-2 apart). Comparing them with each other is then the
wrong test. Instead a float32 reference (the same generated module eager, weights cast to
float32, same batches and AdamW, untimed) trains beside them, and each contender's drift, its
largest relative loss difference from the reference over the run, is checked: the compiled
one (and the model) must drift at most max(2 x eager's drift, --loss-rtol, default 2e-2 in
bf16). A wrong compiled program drifts far beyond the eager one; bf16 rounding does not.

--device cuda runs on the GPUs with NCCL (one per rank); --dtype bfloat16 casts the model's
weights (and so the whole step) to bf16; --gpt2-small is GPT-2 small's shape (12 layers,
d 768, 12 heads, vocab 50257) at batch 8 x 1024.

Plans: `dp` (plan_ngpus 1, data parallel over the ranks) and `tp` (plan_ngpus = world size,
Megatron-style). The table is printed and appended to benchmarks/results/compile_cpu.txt
unless --no-save. Check `uptime` first: other jobs on the machine skew CPU timings.
"""
from __future__ import annotations

import argparse
import datetime
import os
import socket
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
from gpt import GPT  # noqa: E402

import nncompile  # noqa: E402
from run_record import command, write_atomic  # noqa: E402

RESULTS = os.path.join(HERE, "results")
CONTENDERS = ("eager", "compiled")
REFERENCE = "float32 reference"      # low precision: what each contender's drift is measured from
DRIFT_FACTOR = 2.0                   # a contender may drift this much more than eager does


def contenders(world: int) -> tuple[str, ...]:
    """The generated module eager and compiled; on one rank the plain model as well."""
    return ("model",) + CONTENDERS if world == 1 else CONTENDERS


def make_model(args, dtype: str | None = None) -> GPT:
    torch.manual_seed(0)
    model = GPT(vocab_size=args.vocab, block_size=args.block, n_layer=args.n_layer,
                n_head=args.n_head, n_embd=args.n_embd)
    return model.to(device=args.device, dtype=getattr(torch, dtype or args.dtype))


def drift(losses: list[float], reference: list[float]) -> float:
    """The largest relative difference of `losses` from `reference` over the run."""
    ref = torch.tensor(reference, dtype=torch.float64)
    return float(((torch.tensor(losses, dtype=torch.float64) - ref).abs() / ref.abs()).max())


def loss_check(args, losses: dict[str, list[float]]) -> tuple[bool, dict[str, float]]:
    """(passed, each contender's number): float32, the difference from eager's losses;
    lower precision, the drift from the float32 reference (the module docstring says why)."""
    names = [k for k in losses if k != REFERENCE]
    if REFERENCE not in losses:
        diff = {k: drift(losses[k], losses["eager"]) for k in names}
        return all(d <= args.loss_rtol for d in diff.values()), diff
    off = {k: drift(losses[k], losses[REFERENCE]) for k in names}
    bound = max(DRIFT_FACTOR * off["eager"], args.loss_rtol)
    return all(d <= bound for d in off.values()), off


def fwd_bwd(pm, batch) -> tuple[float, float]:
    """(seconds of forward + backward, loss)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    start = time.perf_counter()
    loss = pm(**batch)
    loss.backward()
    sync()
    return time.perf_counter() - start, loss.item()


def run_plan(args, policy: str, savedir: str) -> dict:
    """Both contenders on one plan; this rank's numbers."""
    from torch._dynamo.utils import counters
    world, rank = dist.get_world_size(), dist.get_rank()
    plan = 1 if policy == "dp" else world
    unit = rank // plan
    g = torch.Generator().manual_seed(1000 + unit)
    batches = [{k: torch.randint(0, args.vocab, (args.batch, args.block), generator=g)
                .to(args.device) for k in ("idx", "targets")} for _ in range(4)]
    runs = {}
    labels = contenders(world)
    for label in labels:
        if label == "model":                        # the eager model itself, one rank
            model = make_model(args)
            runs[label] = (model, torch.optim.AdamW(model.parameters(), lr=1e-3))
            continue
        cfg = nncompile.ComputeConfig(plan, world, compile=label == "compiled")
        pm = nncompile.parallelize(make_model(args), batches[0], cfg, pas_policy=policy,
                                   gen_savedir=savedir, instance_name=f"{policy}_{label}",
                                   device=args.device)
        runs[label] = (pm, nncompile.build_optimizer(pm, torch.optim.AdamW, lr=1e-3))
    reference = None
    if args.dtype != "float32":           # untimed: what each contender's drift is measured from
        pm = nncompile.parallelize(make_model(args, "float32"), batches[0],
                                   nncompile.ComputeConfig(plan, world), pas_policy=policy,
                                   gen_savedir=savedir, instance_name=f"{policy}_float32",
                                   device=args.device)
        reference = (pm, nncompile.build_optimizer(pm, torch.optim.AdamW, lr=1e-3))
    counters.clear()
    times = {k: [] for k in labels}
    losses = {k: [] for k in labels + ((REFERENCE,) if reference is not None else ())}
    first = {}
    load = os.getloadavg()[0]
    for i in range(args.warmup + args.steps):
        for label in labels[::-1] if i % 2 else labels:
            pm, opt = runs[label]
            dist.barrier()
            t, loss = fwd_bwd(pm, batches[i % len(batches)])
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses[label].append(loss)
            if i == 0:
                first[label] = t
            elif i >= args.warmup:
                times[label].append(t)
        if reference is not None:
            pm, opt = reference
            _, loss = fwd_bwd(pm, batches[i % len(batches)])
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses[REFERENCE].append(loss)
    return {"times": times, "losses": losses, "first": first,
            "graphs": counters["stats"]["unique_graphs"],
            "breaks": sum(counters["graph_break"].values()),
            "load": [load, os.getloadavg()[0]]}


def summarize(args, results: dict) -> tuple[list[str], bool]:
    world = dist.get_world_size()
    stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    n_params = sum(p.numel() for p in make_model(args).parameters())
    lines = [f"nncompile compile=True vs eager generated code -- {stamp} on "
             f"{socket.gethostname()} ({os.cpu_count()} cores)",
             f"GPT {args.n_layer}L d{args.n_embd} h{args.n_head} vocab {args.vocab} "
             f"({n_params / 1e6:.2f}M params, {args.dtype}), batch {args.batch}x{args.block} per "
             f"plan unit, {world} rank(s) ({dist.get_backend()}, {args.device}), torch "
             f"{torch.__version__}, {args.threads} thread(s)/rank, backend inductor",
             f"{args.steps} timed steps after {args.warmup} warmup, alternating; a step = the "
             "slowest rank's forward + backward (AdamW untimed); medians",
             f"{'plan':<10}{'eager ms':>10}{'compiled ms':>13}{'speedup':>9}{'1st step s':>12}"
             f"{'graphs':>8}{'breaks':>8}   {'loss first':>10}{'loss last':>10}"
             f"{'max rel diff':>14}" + (f"{'model ms':>10}{'eager/model':>13}"
                                        if world == 1 else "")]
    same = True
    drifts = []
    for policy, every in results.items():
        step = {k: [max(r["times"][k][i] for r in every) for i in range(args.steps)]
                for k in contenders(world)}
        med = {k: statistics.median(v) for k, v in step.items()}
        losses = every[0]["losses"]
        diff = max(drift(losses[k], losses["eager"]) for k in contenders(world) if k != "eager")
        ok, numbers = loss_check(args, losses)
        same &= ok
        plan = "dp 1x" if policy == "dp" else f"tp {world}x"
        if REFERENCE in losses:
            drifts.append(f"{plan + str(world)}: " + ", ".join(
                f"{k} {v:.1e}" for k, v in numbers.items()) + f" ({'ok' if ok else 'TOO FAR'})")
        first = max(r["first"]["compiled"] for r in every)
        lines.append(f"{plan + str(world):<10}{med['eager'] * 1e3:10.2f}"
                     f"{med['compiled'] * 1e3:13.2f}{med['eager'] / med['compiled']:9.3f}"
                     f"{first:12.1f}{every[0]['graphs']:8d}{every[0]['breaks']:8d}   "
                     f"{losses['eager'][0]:10.5f}{losses['eager'][-1]:10.5f}{diff:14.1e}"
                     + (f"{med['model'] * 1e3:10.2f}{med['eager'] / med['model']:13.3f}"
                        if world == 1 else ""))
    loads = [r[0]["load"] for r in results.values()]
    if drifts:
        check = (f"{args.dtype}: each contender's drift from a float32 reference (max rel loss "
                 f"diff) {'within' if same else 'NOT within'} max({DRIFT_FACTOR:g} x eager's, "
                 f"{args.loss_rtol:g}): " + "; ".join(drifts))
    else:
        check = (f"losses of all contenders: {'equal' if same else 'MISMATCH'} within "
                 f"{args.loss_rtol:g}")
    lines.append(f"speedup = eager / compiled median; eager/model = the generated module's "
                 f"median over the plain model's (one rank); {check} (rank 0, "
                 f"{args.warmup + args.steps} AdamW steps each); 1-minute load average "
                 f"{loads[0][0]:.1f} before, {loads[-1][1]:.1f} after")
    return lines, same


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--plans", default=None, help="comma-separated, of tp, dp (default: dp on "
                                                   "1 rank, tp,dp on more)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--n-head", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--gpt2-small", action="store_true",
                    help="GPT-2 small's shape: 12 layers, d 768, 12 heads, vocab 50257, "
                         "batch 8 x 1024")
    ap.add_argument("--loss-rtol", type=float, default=1e-4,
                    help="float32: the largest relative loss difference from eager; bfloat16 "
                         "(default 2e-2 there): the drift from float32 always allowed")
    ap.add_argument("--results-dir", default=RESULTS)
    ap.add_argument("--no-save", action="store_true", help="do not write a results file")
    ap.add_argument("--warm-cache", action="store_true",
                    help="use inductor's usual cache (default: an empty one, so the first step "
                         "shows a cold compile)")
    args = ap.parse_args()
    if args.gpt2_small:
        args.n_layer, args.n_embd, args.n_head, args.vocab = 12, 768, 12, 50257
        args.batch, args.block = 8, 1024
    if args.dtype != "float32" and args.loss_rtol == 1e-4:
        args.loss_rtol = 2e-2                 # the least drift from float32 bf16 may show
    os.environ.setdefault("NNCOMPILE_QUIET", "1")
    torch.set_num_threads(args.threads)
    nncompile.init_distributed("nccl" if args.device == "cuda" else "gloo")
    world = dist.get_world_size()
    plans = (args.plans or ("dp" if world == 1 else "tp,dp")).split(",")
    if set(plans) - {"tp", "dp"}:
        ap.error(f"unknown plan(s) {sorted(set(plans) - {'tp', 'dp'})}; choose from tp, dp")
    results = {}
    with tempfile.TemporaryDirectory() as savedir:
        box = [savedir]
        dist.broadcast_object_list(box, src=0)        # one directory for every rank
        if not args.warm_cache:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(box[0], "inductor")
        for policy in plans:
            every = [None] * world
            dist.all_gather_object(every, run_plan(args, policy, box[0]))
            results[policy] = every
        dist.barrier()
    same = True
    if dist.get_rank() == 0:
        lines, same = summarize(args, results)
        print("\n".join(lines), flush=True)
        if not args.no_save:
            os.makedirs(args.results_dir, exist_ok=True)
            path = os.path.join(args.results_dir, f"compile_{args.device}.txt")
            old = open(path).read() if os.path.exists(path) else ""
            block = [f"# {command('benchmarks/compile_speedup.py', world)}   "
                     f"({dist.get_backend()}, {world} rank(s))"] + lines
            write_atomic(path, old + "\n".join(block) + "\n")
            print(f"appended to {os.path.relpath(path)}")
        if not same:
            print("ERROR: eager and compiled losses differ beyond float32 noise"
                  if args.dtype == "float32" else
                  f"ERROR: a contender drifts from the float32 reference beyond "
                  f"{DRIFT_FACTOR:g} x eager's drift", flush=True)
    dist.destroy_process_group()
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
