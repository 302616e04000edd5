"""nncompile's `tp` and `autodist` plans vs PyTorch's own DTensor tensor parallelism, side by
side in one run, on the example GPT (examples/gpt.py).

The DTensor contender is the hand-written Megatron plan: `parallelize_module` with
ColwiseParallel on q/k/v and mlp_fc, RowwiseParallel on c_proj and mlp_proj, the attention's
head count divided by the plan size (heads counted locally), everything else replicated.
nncompile compiles the same model (same seed, same weights) with `tp`, `tp_sp` and
`autodist` (the h100-less default profile of this machine, or --device), and `tp` and `tp_sp`
once more with pas_config overlap_grad_sync=False ("tp serial", "tp_sp serial": backward
reduces each column region's input gradient after, not while, computing the weight
gradients; serial/tp and serial/tp_sp are what the overlap gains). Every rank runs one
training step (forward, backward, AdamW) of each contender in turn on the same batch, the
order rotating; a step's time is the slowest rank's; medians are compared. Losses are printed
for every contender: they must be equal (same model, same data, same math).

    torchrun --nproc_per_node=2 benchmarks/tp_vs_dtensor.py [--sizes 256x4,512x2] [--seq 128]
        [--batch 8] [--steps 20] [--warmup 3]

Writes benchmarks/results/tp_vs_dtensor_<device>.txt (appends, atomically).
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
sys.path.insert(0, HERE)
from gpt import GPT  # noqa: E402
from run_record import command, write_atomic  # noqa: E402

import nncompile  # noqa: E402

VOCAB, HEADS = 512, 8
OURS = ("tp", "tp_sp", "autodist")
# `tp` and `tp_sp` with pas_config overlap_grad_sync=False: the input gradient's all-reduce
# (reduce-scatter) waits for the weight gradients (passes/overlap_grad_sync.py), to measure
# what the overlap gains
SERIAL = ("tp serial", "tp_sp serial")


def make_model(n_embd: int, n_layer: int, seq: int) -> GPT:
    torch.manual_seed(0)
    return GPT(vocab_size=VOCAB, block_size=seq, n_layer=n_layer, n_head=HEADS, n_embd=n_embd)


def _local_heads_forward(self, x):
    """CausalSelfAttention.forward with sizes read from the local (column-split) tensors."""
    B, T, _ = x.size()
    q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
    q, k, v = (t.view(B, T, self.n_head, -1).transpose(1, 2) for t in (q, k, v))
    y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    return self.c_proj(y.transpose(1, 2).reshape(B, T, -1))


def dtensor_tp(model: GPT, world: int) -> GPT:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    mesh = init_device_mesh("cpu", (world,))
    for block in model.h:
        parallelize_module(block, mesh, {
            "attn.q_proj": ColwiseParallel(), "attn.k_proj": ColwiseParallel(),
            "attn.v_proj": ColwiseParallel(), "attn.c_proj": RowwiseParallel(),
            "mlp_fc": ColwiseParallel(), "mlp_proj": RowwiseParallel()})
        block.attn.n_head //= world
        block.attn.forward = _local_heads_forward.__get__(block.attn)
    return model


def timed_step(module, opt, batch) -> tuple[float, float]:
    start = time.perf_counter()
    loss = module(**batch)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - start, float(loss.detach())


def run_size(args, n_embd: int, n_layer: int, savedir: str) -> dict:
    world = dist.get_world_size()
    g = torch.Generator().manual_seed(1234)
    batches = [{k: torch.randint(0, VOCAB, (args.batch, args.seq), generator=g)
                for k in ("idx", "targets")} for _ in range(4)]
    runs = {}
    model = dtensor_tp(make_model(n_embd, n_layer, args.seq), world)
    runs["dtensor"] = (model, torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False))
    for label in OURS + SERIAL:
        policy = label.split()[0]
        pas = {"device": args.device} if policy == "autodist" and args.device else {}
        if label in SERIAL:
            pas = {"overlap_grad_sync": False}
        cfg = nncompile.ComputeConfig(world, world, parallel=pas)
        pm = nncompile.parallelize(make_model(n_embd, n_layer, args.seq), batches[0], cfg,
                                   pas_policy=policy, gen_savedir=savedir,
                                   instance_name=f"{label.replace(' ', '_')}_{n_embd}x{n_layer}")
        runs[label] = (pm, nncompile.build_optimizer(pm, torch.optim.AdamW, lr=1e-3,
                                                      foreach=False))
    names = list(runs)
    times = {k: [] for k in names}
    losses = {k: [] for k in names}
    for i in range(args.warmup + args.steps):
        for label in names[i % len(names):] + names[:i % len(names)]:
            module, opt = runs[label]
            dist.barrier()
            t, loss = timed_step(module, opt, batches[i % len(batches)])
            losses[label].append(loss)
            if i >= args.warmup:
                times[label].append(t)
    return {"times": times, "losses": losses}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="256x4,512x2", help="n_embd x n_layer, comma separated")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--device", default=None, help="autodist device profile (default: the "
                    "profile nncompile picks for this machine)")
    ap.add_argument("--results-dir", default=os.path.join(HERE, "results"))
    ap.add_argument("--loss-rtol", type=float, default=1e-4)
    args = ap.parse_args()
    os.environ.setdefault("NNCOMPILE_QUIET", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    load0 = os.getloadavg()[0]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        savedir = tmp if rank == 0 else None
        box = [savedir]
        dist.broadcast_object_list(box, src=0)
        for size in args.sizes.split(","):
            n_embd, n_layer = (int(x) for x in size.split("x"))
            mine = run_size(args, n_embd, n_layer, box[0])
            every = [None] * world
            dist.all_gather_object(every, mine)
            results[size] = every
        dist.barrier()
    if rank == 0:
        report(args, results, world, load0)
    dist.destroy_process_group()


def report(args, results: dict, world: int, load0: float) -> None:
    stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    lines = [f"nncompile tp / autodist vs DTensor tensor parallel -- {stamp} on "
             f"{socket.gethostname()} ({os.cpu_count()} cores)",
             f"GPT vocab {VOCAB}, {HEADS} heads, batch {args.batch}x{args.seq}, plan {world} "
             f"(gloo, cpu), torch {torch.__version__}, 1 thread/rank; {args.steps} timed steps "
             f"after {args.warmup} warmup, contenders interleaved; a step = the slowest rank's "
             "forward + backward + AdamW; medians",
             f"{'model':<10}{'dtensor ms':>11}" + "".join(f"{k + ' ms':>13}" for k in OURS)
             + "".join(f"{'DT/' + k:>12}" for k in OURS)
             + "".join(f"{'serial/' + k.split()[0]:>15}" for k in SERIAL)
             + f"{'loss 0':>9}{'loss last':>10}"
             f"{'max rel diff':>14}"]
    ok = True
    for size, every in results.items():
        names = list(every[0]["times"])
        step = {k: [max(r["times"][k][i] for r in every) for i in range(args.steps)]
                for k in names}
        med = {k: statistics.median(v) for k, v in step.items()}
        losses = every[0]["losses"]
        ref = torch.tensor(losses["dtensor"], dtype=torch.float64)
        diff = max(float(((torch.tensor(losses[k], dtype=torch.float64) - ref).abs()
                          / ref.abs()).max()) for k in OURS + SERIAL)
        ok &= diff <= args.loss_rtol
        n_embd, n_layer = size.split("x")
        gain = [statistics.median(a / b for a, b in zip(step[k], step[k.split()[0]]))
                for k in SERIAL]         # serial over overlapped, step by step
        lines.append(f"{f'd{n_embd} x {n_layer}':<10}{med['dtensor'] * 1e3:11.2f}"
                     + "".join(f"{med[k] * 1e3:13.2f}" for k in OURS)
                     + "".join(f"{med['dtensor'] / med[k]:12.3f}" for k in OURS)
                     + "".join(f"{g:15.3f}" for g in gain)
                     + f"{losses['dtensor'][0]:9.4f}{losses['dtensor'][-1]:10.4f}{diff:14.1e}")
    lines.append(f"losses: {'equal' if ok else 'MISMATCH'} within {args.loss_rtol:g} over "
                 f"{args.warmup + args.steps} steps; DT/x = DTensor step time / x's (> 1: x is "
                 f"faster); serial/x = median over steps of `x serial`'s step / x's "
                 f"(> 1: the overlap helps); 1-minute load average {load0:.1f} before, {os.getloadavg()[0]:.1f} "
                 "after")
    print("\n".join(lines), flush=True)
    os.makedirs(args.results_dir, exist_ok=True)
    path = os.path.join(args.results_dir, "tp_vs_dtensor_cpu.txt")
    old = open(path).read() if os.path.exists(path) else ""
    write_atomic(path, old + "\n".join(
        ["# " + command("benchmarks/tp_vs_dtensor.py", world)] + lines) + "\n")


if __name__ == "__main__":
    main()
