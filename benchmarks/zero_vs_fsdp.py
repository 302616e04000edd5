"""nncompile ZeRO-3 vs PyTorch FSDP2 (`fully_shard`) on the GPT, side by side in one run.

    torchrun --nproc_per_node=4 benchmarks/zero_vs_fsdp.py [--steps 8] [--n-layer 4]
    torchrun --nproc_per_node=N benchmarks/zero_vs_fsdp.py --device cuda [--offload]

Every rank builds the same GPT (examples/gpt.py, seed 0) twice:

  ours   nncompile.parallelize(..., ComputeConfig(1, world, use_zero=3), pas_policy="dp"): one
         flat parameter piece per layer unit, gathered in the generated forward (with prefetch
         of the next unit) and again in backward, gradients reduce-scattered (gloo: all-reduce
         + slice); AdamW from nncompile.build_optimizer.
  fsdp2  torch.distributed.fsdp.fully_shard on every block, then on the root; AdamW over its
         DTensor parameters.

Both train on the same batches (a global batch of world x --batch rows per step, rank r takes
rows [r*batch, (r+1)*batch)), with the same AdamW settings. Steps alternate between the two
(the order rotates every step) and every step starts after a barrier, so machine noise hits
both alike; a step's time is the slowest rank's, and the median over --steps steps after
--warmup is compared. The global loss of every step (mean over ranks) of both must agree to
float32 reordering noise (--loss-rtol), else the comparison is between different computations
and the run says so (exit status 1).

Memory, per rank (the largest rank is reported):

  persistent  bytes of the model state counted from the tensors themselves right after a
              backward: parameter pieces (DTensor: the local shard), their gradients, the
              optimizer's state and any parameter copies it steps (ZeRO offload), each storage
              once. Exact; this is what sharding is meant to cut.
  peak        CPU: 4 more steps of each run under torch.profiler(profile_memory=True); every
              allocation and free of the CPU allocator is an event with its address and size.
              Peak of a step = the model state alive when it begins (parameters + optimizer
              state, counted from the tensors; gradients are None there) + the blocks the
              previous step left alive for this one to free (if any) + the high-water mark of the running sum of the step's own events. The largest of
              the two middle steps is reported. The profiler misses frees that happen on a
              thread gloo runs without profiler state; the main thread allocates the same
              sequence every step (checked), so a free missed in one step is placed where
              it is seen in the others (cpu_peak). What is never seen freed is counted as
              alive and reported as `unsure` (0 on the runs so far: exact). This counts the
              tensors torch allocates (activations, gathered layers, gradient and
              communication buffers), not memory gloo or Python malloc on their own, for
              both runs alike; RSS cannot tell two models in one process apart, and the
              profiler's events can, one step at a time.
              CUDA: torch.cuda.max_memory_allocated over a step after reset_peak_memory_stats
              (device memory; with --offload host copies show in "persistent state (host)").

--offload runs ours with offload_optimizer=True, offload_params=True and FSDP2 with
CPUOffloadPolicy (pinned host memory on a GPU). With --device cpu host and device memory are
one, so nothing moves: the run shows that both offload paths train the same losses side by
side; what offloading costs or saves is measured with --device cuda.

The table is printed and appended to benchmarks/results/zero_vs_fsdp_<cpu|h100|...>.txt
(its first line says when and on which host); --json PATH writes every number.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import socket
import statistics
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
from run_record import command, write_atomic  # noqa: E402
from gpt import GPT  # noqa: E402

import nncompile  # noqa: E402

RESULTS = os.path.join(HERE, "results")


def make_model(args) -> GPT:
    torch.manual_seed(0)
    return GPT(vocab_size=args.vocab, block_size=args.block, n_layer=args.n_layer,
               n_head=args.n_head, n_embd=args.n_embd)


def batches(args, world: int, rank: int, device) -> list[dict[str, torch.Tensor]]:
    """The same global batches on every rank; this rank's rows of each."""
    out = []
    for i in range(args.warmup + args.steps + 2):
        g = torch.Generator().manual_seed(1000 + i)
        rows = slice(rank * args.batch, (rank + 1) * args.batch)
        out.append({k: torch.randint(0, args.vocab, (world * args.batch, args.block),
                                     generator=g)[rows].to(device) for k in ("idx", "targets")})
    return out


# ---- the two runs --------------------------------------------------------------------------
def build_ours(args, batch, device, savedir):
    cfg = nncompile.ComputeConfig(1, dist.get_world_size(), use_zero=3,
                                  offload_optimizer=args.offload, offload_params=args.offload)
    pm = nncompile.parallelize(make_model(args).to(device), batch, cfg, pas_policy="dp",
                               gen_savedir=savedir,
                               instance_name="zero3_offload" if args.offload else "zero3")
    return pm, nncompile.build_optimizer(pm, torch.optim.AdamW, lr=args.lr)


def build_fsdp(args, device):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    kw = {}
    if args.offload:
        from torch.distributed.fsdp import CPUOffloadPolicy
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    model = make_model(args).to(device)
    for block in model.h:
        fully_shard(block, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    return model, torch.optim.AdamW(model.parameters(), lr=args.lr)


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def train_step(module, opt, batch, after_backward=None) -> torch.Tensor:
    loss = module(**batch)
    loss.backward()
    if after_backward is not None:
        after_backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def barrier(device) -> None:
    sync(device)
    if device.type == "cuda":
        dist.barrier(device_ids=[device.index])
    else:
        dist.barrier()


def timed_step(module, opt, batch, device) -> tuple[list[float], float]:
    """([forward, backward, optimizer step + zero_grad] seconds, loss), after a barrier."""
    barrier(device)
    t = [time.perf_counter()]
    loss = module(**batch)
    sync(device)
    t.append(time.perf_counter())
    loss.backward()
    sync(device)
    t.append(time.perf_counter())
    opt.step()
    opt.zero_grad(set_to_none=True)
    sync(device)
    t.append(time.perf_counter())
    return [b - a for a, b in zip(t, t[1:])], loss.item()


# ---- memory --------------------------------------------------------------------------------
def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def state_tensors(module, opt):
    """(kind, tensor) of the model state: parameters (DTensor: the local shard), gradients,
    the optimizer's state and any parameter copies it steps (ZeRO offload)."""
    params = list(module.parameters())
    for p in params:
        yield "params", p
    for p in params:
        yield "grads", p.grad
    for group in opt.param_groups:
        for p in group["params"]:
            yield "optimizer", p
            yield "grads", p.grad
    for st in opt.state.values():
        for v in st.values():
            yield "optimizer", v


def state_bytes(module, opt) -> dict[str, int]:
    """{"<kind> <device type>": bytes}, each byte of memory counted once (a storage that is a
    slice of another's memory, as a ZeRO-3 DTensor parameter's local tensor is of its flat
    piece, adds only what the earlier ones do not cover)."""
    covered: dict[tuple, list[tuple[int, int]]] = {}
    out: dict[str, int] = {}
    for kind, t in state_tensors(module, opt):
        if not isinstance(t, torch.Tensor):
            continue
        t = _local(t)
        s = t.untyped_storage()
        if s.nbytes() == 0:
            continue
        spans = covered.setdefault((t.device.type, t.device.index), [])
        new = _uncovered(spans, s.data_ptr(), s.data_ptr() + s.nbytes())
        spans.append((s.data_ptr(), s.data_ptr() + s.nbytes()))
        if new:
            name = f"{kind} {t.device.type}"
            out[name] = out.get(name, 0) + new
    return out


def _uncovered(spans: list[tuple[int, int]], lo: int, hi: int) -> int:
    """Bytes of [lo, hi) outside every span."""
    cuts = sorted((max(a, lo), min(b, hi)) for a, b in spans if a < hi and b > lo)
    total, at = 0, lo
    for a, b in cuts:
        if a > at:
            total += a - at
        at = max(at, b)
    return total + max(0, hi - at)


def total(d: dict[str, int], device_type: str | None = None) -> int:
    return sum(v for k, v in d.items() if device_type is None or k.endswith(device_type))


MARK = 1234567      # bytes of the marker allocation between two profiled steps


def _allocations(prof):
    """(time ns, thread, ptr, bytes) of every CPU allocation (+) and free (-) profiled."""
    from torch._C._profiler import _EventType
    out, todo = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while todo:
        e = todo.pop()
        todo.extend(e.children)
        if e.tag == _EventType.Allocation and e.extra_fields.device.type == "cpu":
            f = e.extra_fields
            out.append((e.start_time_ns, e.start_tid, f.ptr, f.alloc_size))
    return sorted(out)


def cpu_peak(module, opt, batches, nsteps: int = 4) -> dict:
    """`nsteps` steps under torch.profiler(profile_memory=True); the middle ones are measured.

    Every CPU allocation and free is an event with its address, size and thread. The CPU
    allocator reports a free only on a thread the profiler watches and only for a block it
    saw allocated, so (1) a block allocated before the window is freed without an event:
    a measured step has a profiled step before it, whose blocks still alive when it starts
    (a buffer kept for the next step to free) are known; and (2) a block
    whose last reference dies on a thread gloo runs without profiler state is freed without
    an event, at random. The main thread allocates the same sequence every step (checked), so
    a free missed in one step is taken from the other steps: allocation #j is freed before
    the main thread's allocation #p of the same (or the next) step, as most often seen.
    A measured step's peak = the model state at its start (counted from the tensors) + the
    previous step's blocks alive then + the high-water mark of the running sum of its events.
    Blocks never seen freed in any step are counted as alive to the step's end; `unsure` is
    their bytes at the peak (the true peak lies in [peak - unsure, peak]; 0: exact).
    """
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for i in range(nsteps):
            if i:
                mark = torch.empty(MARK, dtype=torch.uint8)
                del mark
            train_step(module, opt, batches[i % len(batches)])
    events = _allocations(prof)
    main = max(set(t for _, t, _, _ in events), key=[t for _, t, _, _ in events].count)
    steps: list[list] = [[]]
    for ev in events:
        if abs(ev[3]) == MARK:
            if ev[3] > 0:
                steps.append([])
            continue
        steps[-1].append(ev)
    # every block: (step, key) -> size; key = ("m", j) for the main thread's j-th allocation
    size: dict[tuple, int] = {}
    freed: dict[tuple, tuple[int, int]] = {}     # block -> (steps later, main allocs before)
    other_at: dict[tuple, int] = {}               # other-thread block -> main allocs before it
    live: dict[int, tuple] = {}                   # ptr -> block
    seqs = []
    for s, evs in enumerate(steps):
        c = k = 0
        seq = []
        for _, tid, ptr, n in evs:
            if n > 0:
                if tid == main:
                    block = (s, ("m", c))
                    c += 1
                    seq.append(n)
                else:
                    block = (s, ("o", k))
                    k += 1
                    other_at[block] = c
                live[ptr] = block                 # an address still live: freed unseen
                size[block] = n
            elif ptr in live:
                block = live.pop(ptr)
                freed[block] = (s - block[0], c)
        seqs.append(seq)
    aligned = all(q == seqs[0] for q in seqs)
    seen: dict[tuple, list] = {}                  # main allocation j -> [(later, pos), ...]
    for (s, key), f in freed.items():
        if key[0] == "m":
            seen.setdefault(key, []).append(f)

    def free_of(block):
        if block in freed:
            return freed[block]
        obs = sorted(seen.get(block[1], [])) if aligned and block[1][0] == "m" else []
        return obs[len(obs) // 2] if obs else None

    out = []
    for s in range(1, len(steps) - 1):
        deltas, held, never, borrowed = [], 0, 0, 0   # deltas: (when, bytes, never seen freed)
        for block, n in size.items():
            f = free_of(block)
            if block[0] == s - 1:                 # alive at the start, freed in this step?
                if f is not None and f[0] == 1:
                    held += n
                    deltas.append(((f[1], 0), -n, False))
                continue
            if block[0] != s:
                continue
            kind, j = block[1]
            deltas.append(((j, 1) if kind == "m" else (other_at[block] - 1, 2), n, f is None))
            borrowed += block not in freed and f is not None
            if f is None:
                never += n
            elif f[0] == 0:
                deltas.append(((f[1], 0) if kind == "m" or f[1] > other_at[block]
                               else (f[1] - 1, 3), -n, False))
        running = high = held
        unseen = unsure = 0                       # never-seen-freed bytes now / at the peak
        for _, d, unknown in sorted(deltas, key=lambda x: (x[0], x[1] < 0)):
            running += d
            unseen += d if unknown else 0
            if running > high:
                high, unsure = running, unseen
        out.append({"held_over": held, "step_added": high - held, "unsure": unsure,
                    "never_seen_freed": never, "borrowed_frees": borrowed,
                    "events": len(steps[s]), "net": running - held})
    worst = max(out, key=lambda r: (r["held_over"] + r["step_added"]))
    worst["aligned"] = aligned
    worst["steps"] = [r["held_over"] + r["step_added"] for r in out]
    return worst


def measure_memory(module, opt, batches, device) -> dict:
    """Persistent and peak bytes of one run (see the module docstring)."""
    persistent: dict[str, int] = {}

    def after_backward():
        persistent.update(state_bytes(module, opt))

    barrier(device)
    if device.type == "cuda":
        train_step(module, opt, batches[0])
        sync(device)
        start_state = total(state_bytes(module, opt), device.type)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        train_step(module, opt, batches[1], after_backward)
        sync(device)
        peak = torch.cuda.max_memory_allocated(device)
        return {"peak": peak, "step_added": peak - base, "persistent": persistent,
                "start_state": start_state, "unsure": 0}
    start_state = total(state_bytes(module, opt), device.type)
    r = cpu_peak(module, opt, batches)
    r["start_state"] = start_state
    r["peak"] = start_state + r["held_over"] + r["step_added"]
    train_step(module, opt, batches[1], after_backward)
    r["persistent"] = persistent
    return r


# ---- the run -------------------------------------------------------------------------------
def ratio(a: float, b: float) -> str:
    return f"{a / b:.3f}" if b else "-"


def fmt_mb(n: float) -> str:
    return f"{n / 2 ** 20:9.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=8, help="timed steps of each run")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--batch", type=int, default=4, help="rows per rank")
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=256)
    ap.add_argument("--n-head", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank (CPU)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--offload", action="store_true",
                    help="ours: offload_optimizer + offload_params; fsdp2: CPUOffloadPolicy")
    ap.add_argument("--loss-rtol", type=float, default=1e-4)
    ap.add_argument("--results-dir", default=RESULTS)
    ap.add_argument("--json", help="also write the full record (per-step times, per-rank "
                    "memory) to this file")
    ap.add_argument("--no-save", action="store_true", help="do not write a results file")
    args = ap.parse_args()
    os.environ.setdefault("NNCOMPILE_QUIET", "1")
    warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.* is deprecated")
    if args.device == "cuda":
        nncompile.init_distributed("nccl")
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        nncompile.init_distributed("gloo")
        device = torch.device("cpu")
        torch.set_num_threads(args.threads)
    rank, world = dist.get_rank(), dist.get_world_size()

    box = [tempfile.mkdtemp(prefix="zero_vs_fsdp_") if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    savedir = box[0]
    data = batches(args, world, rank, device)
    t0 = time.perf_counter()
    runs = {"ours": build_ours(args, data[0], device, savedir),
            "fsdp2": build_fsdp(args, device)}
    build_s = time.perf_counter() - t0

    names = list(runs)
    times = {k: [] for k in names}
    losses = {k: [] for k in names}
    t0 = time.perf_counter()
    for i in range(args.warmup + args.steps):
        for name in names[i % 2:] + names[:i % 2]:               # rotate the order
            module, opt = runs[name]
            t, loss = timed_step(module, opt, data[i], device)
            losses[name].append(loss)
            if i >= args.warmup:
                times[name].append(t)
    train_s = time.perf_counter() - t0
    mem = {}
    for name in names:                       # a few more steps each, the same batches
        module, opt = runs[name]
        mem[name] = measure_memory(module, opt, data[-2:], device)

    # ---- gather over ranks ----
    mine = {"times": times, "losses": losses, "mem": mem}
    every = [None] * world
    dist.all_gather_object(every, mine)
    same = True
    if rank == 0:
        shutil.rmtree(savedir, ignore_errors=True)
        same = report(args, device, world, every, build_s, train_s,
                      sum(p.numel() for p in make_model(args).parameters()))
    barrier(device)
    dist.destroy_process_group()
    if not same:
        sys.exit(1)


def device_tag(device) -> str:
    """"cpu", or the GPU's model as in the other results files ("h100")."""
    if device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(device)
    model = re.search(r"\b([A-Z]+\d+)\b", name)
    return model.group(1).lower() if model else "cuda"


def save(args, lines: list[str], record: dict, device) -> None:
    """Append this run's table to <results-dir>/zero_vs_fsdp_<device>.txt (the format of the
    other files there: a '# command' line, then the table), and --json: the full record."""
    os.makedirs(args.results_dir, exist_ok=True)
    path = os.path.join(args.results_dir, f"zero_vs_fsdp_{device_tag(device)}.txt")
    old = open(path).read() if os.path.exists(path) else ""
    block = [f"# {record['command']}   ({record['backend']}, {record['world']} ranks)"] + \
        [ln for ln in lines if ln]
    write_atomic(path, old + "\n".join(block) + "\n")
    print(f"appended to {os.path.relpath(path)}")
    if args.json:
        write_atomic(os.path.abspath(args.json), json.dumps(record, indent=1) + "\n")


def report(args, device, world, every, build_s, train_s, n_params) -> bool:
    names = ("ours", "fsdp2")
    step_max = {k: [max(sum(r["times"][k][i]) for r in every) for i in range(args.steps)]
                for k in names}
    med = {k: statistics.median(v) for k, v in step_max.items()}
    phase = {k: [statistics.median(max(r["times"][k][i][j] for r in every)
                                   for i in range(args.steps)) for j in range(3)]
             for k in names}
    gloss = {k: [sum(r["losses"][k][i] for r in every) / world
                 for i in range(args.warmup + args.steps)] for k in names}
    loss_err = max(abs(a - b) / max(1.0, abs(b)) for a, b in zip(gloss["ours"], gloss["fsdp2"]))
    same = loss_err <= args.loss_rtol
    dev = device.type
    peak = {k: max(r["mem"][k]["peak"] for r in every) for k in names}
    pers = {k: max(total(r["mem"][k]["persistent"], dev) for r in every) for k in names}
    pers_host = {k: max(total(r["mem"][k]["persistent"], "cpu") for r in every) for k in names} \
        if dev == "cuda" else None
    unsure = {k: max(r["mem"][k]["unsure"] for r in every) for k in names}
    host = socket.gethostname()
    stamp = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    lines = [
        f"nncompile ZeRO-3 vs FSDP2 -- {stamp} on {host}",
        f"GPT {args.n_layer}L d{args.n_embd} h{args.n_head} vocab {args.vocab} "
        f"({n_params / 1e6:.2f}M params), batch {args.batch}x{args.block} per rank, "
        f"{world} ranks ({dist.get_backend()}, {dev}{', offload' if args.offload else ''}), "
        f"torch {torch.__version__}, {args.threads} thread(s)/rank",
        f"{args.steps} timed steps after {args.warmup} warmup, alternating; a step = the "
        f"slowest rank's fwd+bwd+AdamW; memory = the largest rank's",
        "",
        f"{'':32}{'ours':>11}{'fsdp2':>11}   ratio",
        f"{'median step time (ms)':32}{med['ours'] * 1e3:11.1f}{med['fsdp2'] * 1e3:11.1f}"
        f"   fsdp/ours {ratio(med['fsdp2'], med['ours'])} (target >= 1.0)",
        *(f"{'  ' + p + ' (ms)':32}{phase['ours'][j] * 1e3:11.1f}{phase['fsdp2'][j] * 1e3:11.1f}"
          f"   fsdp/ours {ratio(phase['fsdp2'][j], phase['ours'][j])}"
          for j, p in enumerate(("forward", "backward", "AdamW step + zero_grad"))),
        f"{'peak memory (MiB, ' + dev + ')':32}{fmt_mb(peak['ours']):>11}"
        f"{fmt_mb(peak['fsdp2']):>11}   ours/fsdp {ratio(peak['ours'], peak['fsdp2'])} "
        f"(target <= 1.0)",
        f"{'persistent state (MiB, ' + dev + ')':32}{fmt_mb(pers['ours']):>11}"
        f"{fmt_mb(pers['fsdp2']):>11}   ours/fsdp {ratio(pers['ours'], pers['fsdp2'])}",
    ]
    if args.offload and dev == "cpu":
        lines.append("offload on cpu: host and device memory are one, so nothing moves; the "
                     "losses show both offload paths run, the times are not offloading's")
    if args.offload and pers_host is not None:
        lines.append(f"{'persistent state (MiB, host)':32}{fmt_mb(pers_host['ours']):>11}"
                     f"{fmt_mb(pers_host['fsdp2']):>11}   ours/fsdp "
                     f"{ratio(pers_host['ours'], pers_host['fsdp2'])}")
    lines += [
        f"{'  full model state, unsharded':32}{fmt_mb(n_params * 4 * 4):>11}   "
        f"(params + grads + 2 AdamW moments, fp32)",
        f"losses: max relative difference {loss_err:.2e} over {len(gloss['ours'])} steps "
        f"({'equivalent' if same else 'MISMATCH'}; tolerance {args.loss_rtol:g}); "
        f"first {gloss['ours'][0]:.4f} / {gloss['fsdp2'][0]:.4f}, "
        f"last {gloss['ours'][-1]:.4f} / {gloss['fsdp2'][-1]:.4f}",
    ]
    if dev == "cpu":
        lines.append(f"peak check: bytes at the peak possibly freed unseen (0: exact; cpu_peak) "
                     f"ours {unsure['ours']}, fsdp2 {unsure['fsdp2']}")
    lines.append(f"wall: build {build_s:.1f} s, alternating steps {train_s:.1f} s")
    print("\n".join(lines), flush=True)
    if not args.no_save:
        save(args, lines, {
            "benchmark": "zero_vs_fsdp", "time": stamp, "host": host,
            "command": command('benchmarks/zero_vs_fsdp.py', world), "torch": torch.__version__, "world": world,
            "backend": dist.get_backend(), "config": vars(args), "n_params": n_params,
            "median_step_ms": {k: med[k] * 1e3 for k in names},
            "median_phase_ms": {k: dict(zip(("forward", "backward", "optimizer"),
                                            (x * 1e3 for x in v))) for k, v in phase.items()},
            "peak_bytes": peak, "peak_unsure_bytes": unsure if dev == "cpu" else None,
            "persistent_bytes": pers, "persistent_host_bytes": pers_host,
            "loss_max_rel_diff": loss_err, "losses": gloss,
            "step_ms": {k: [t * 1e3 for t in v] for k, v in step_max.items()},
            "per_rank_memory": [r["mem"] for r in every]}, device)
    if not same:
        print("ERROR: the two runs' losses differ beyond float32 noise", flush=True)
    return same


if __name__ == "__main__":
    main()
