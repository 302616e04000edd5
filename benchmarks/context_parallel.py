"""Context parallelism: per-rank activation memory and step time against sequence length, for
C = 1, 2, 4 context ranks (parallel.cp), on a Hugging Face Llama.

    python benchmarks/context_parallel.py [--seqs 256,512,1024,2048] [--cps 1,2,4]
                                          [--hidden 64 --layers 2 --heads 4 --kv-heads 2]
                                          [--attention allgather|ulysses] [--json out.json]
                                          [--device cpu|cuda] [--dtype float32|bfloat16]

Every rank of a plan unit of C ranks runs in this process, one thread each
(nncompile.tools.simulate, collectives between threads; with --device cuda all of them on the
one GPU); C = 1 is the generated program on one rank. Per rank and step:
  activations  the bytes autograd keeps for backward at the end of forward: every tensor the
               forward saves (torch.autograd.graph.saved_tensors_hooks), each storage once;
               what context parallelism divides
  step ms      one forward + backward, the median of --steps after one warm-up, the slowest
               rank's (threads share this machine's cores, so C ranks also share its compute:
               the time shows the work split and the communication, not a cluster's speed)
The loss of every C is checked against C = 1 (1e-5 relative in float32, 1e-2 in bfloat16).
The table is printed and appended to benchmarks/results/context_parallel_<device>.txt; --json
writes every number.
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def model_and_batch(args, seq: int):
    import transformers
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=args.hidden,
                                   intermediate_size=4 * args.hidden,
                                   num_hidden_layers=args.layers,
                                   num_attention_heads=args.heads,
                                   num_key_value_heads=args.kv_heads,
                                   max_position_embeddings=max(args.seqs),
                                   attn_implementation="sdpa", use_cache=False)

    class LM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lm = transformers.LlamaForCausalLM(cfg)

        def forward(self, input_ids):
            return self.lm(input_ids=input_ids, labels=input_ids).loss

    g = torch.Generator().manual_seed(seq)
    ids = torch.randint(0, 256, (args.batch, seq), generator=g).to(args.device)
    return LM().to(args.device, getattr(torch, args.dtype)).train(), {"input_ids": ids}


def saved_bytes(fn) -> tuple[torch.Tensor, int]:
    """fn()'s result and the bytes of the distinct storages autograd saved while it ran."""
    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


def timed_steps(pm, batch: dict, steps: int, cuda: bool = False) -> tuple[list, int, object]:
    """(ms of each of `steps` forward + backward steps after one warm-up, the bytes the last
    forward saved, its loss); every rank starts each step together."""
    times, acts, loss = [], 0, None
    for step in range(steps + 1):
        if dist.is_initialized():
            dist.barrier()
        t0 = time.perf_counter()
        loss, acts = saved_bytes(lambda: pm(**batch))
        loss.backward()
        pm.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        if step:
            times.append((time.perf_counter() - t0) * 1e3)
    return times, acts, loss


def run(args, seq: int, cp: int, outdir: Path) -> dict:
    import nncompile
    from nncompile.tools.simulate import run_ranks
    model, batch = model_and_batch(args, seq)
    pas = {"cp": cp, "cp_attention": args.attention} \
        if cp > 1 else {}
    config = nncompile.ComputeConfig(cp, cp, parallel=pas)

    def rank_fn(rank: int) -> dict:
        pm = nncompile.parallelize(model, batch, config, pas_policy="tp",
                                   gen_savedir=str(outdir), instance_name=f"s{seq}_c{cp}")
        times, acts, loss = timed_steps(pm, batch, args.steps, args.device == "cuda")
        return {"rank": rank, "activations": acts, "ms": statistics.median(times),
                "loss": float(loss)}

    rows = run_ranks(cp, rank_fn) if cp > 1 else [rank_fn(0)]
    return {"seq": seq, "cp": cp, "activations": max(r["activations"] for r in rows),
            "ms": max(r["ms"] for r in rows), "loss": rows[0]["loss"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seqs", default="256,512,1024,2048")
    p.add_argument("--cps", default="1,2,4")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--attention", default="allgather", choices=("allgather", "ulysses"))
    p.add_argument("--json")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = p.parse_args()
    args.seqs = [int(s) for s in args.seqs.split(",")]
    cps = [int(c) for c in args.cps.split(",")]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for seq in args.seqs:
            for cp in cps:
                r = run(args, seq, cp, Path(tmp))
                results.append(r)
                print(f"seq {seq:6d}  cp {cp}  activations {r['activations'] / 2**20:9.2f} MiB"
                      f"  step {r['ms']:9.1f} ms  loss {r['loss']:.6f}", flush=True)
    base = {r["seq"]: r for r in results if r["cp"] == 1}
    lines = [f"# {datetime.date.today()}  torch {torch.__version__}  Llama hidden {args.hidden}"
             f" x {args.layers} layers, {args.heads} heads ({args.kv_heads} kv), batch "
             f"{args.batch}, attention {args.attention}, {args.dtype}, "
             + ("CPU threads" if args.device == "cpu" else
                f"{torch.cuda.get_device_name()} (threads sharing it)"),
             f"{'seq':>6} {'cp':>3} {'activations/rank':>17} {'x cp 1':>7} {'step ms':>9} "
             f"{'x cp 1':>7}"]
    for r in results:
        b = base.get(r["seq"])
        rtol = 1e-5 if args.dtype == "float32" else 1e-2
        if b is not None and abs(r["loss"] - b["loss"]) > rtol * abs(b["loss"]):
            raise SystemExit(f"seq {r['seq']} cp {r['cp']}: loss {r['loss']} differs from "
                             f"cp 1's {b['loss']}")
        lines.append(f"{r['seq']:6d} {r['cp']:3d} {r['activations'] / 2**20:13.2f} MiB "
                     f"{r['activations'] / b['activations'] if b else float('nan'):7.3f} "
                     f"{r['ms']:9.1f} {r['ms'] / b['ms'] if b else float('nan'):7.3f}")
    text = "\n".join(lines)
    print(text)
    out = ROOT / "benchmarks" / "results" / f"context_parallel_{args.device}.txt"
    with open(out, "a") as f:
        f.write(text + "\n\n")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results},
                                              indent=1))


if __name__ == "__main__":
    main()
