"""Float8 training against bf16, both with compile=True: tokens/s, memory and the loss after N
steps, on a Hugging Face Llama of about 1 B parameters (TinyLlama's shape: 22 layers, d 2048,
32 heads, 4 KV heads, FFN 5632, vocab 32000).

    torchrun --nproc_per_node=1 benchmarks/float8.py --device cuda            # one GPU
    torchrun --nproc_per_node=8 benchmarks/float8.py --device cuda --plan 8   # tp 8
    torchrun --nproc_per_node=1 benchmarks/float8.py --tiny --steps 6         # a CPU smoke run
    torchrun --nproc_per_node=8 benchmarks/float8.py --device cuda --zero3    # ZeRO-3 over 8

--zero3 trains every contender under ZeRO-3 (use_zero=3, without compile=True, which ZeRO-3's
gathers refuse) and adds a third: float8 with its weights gathered in high precision
(Float8Spec(all_gather=False)) beside float8's default, gathered as float8 bytes; the
`gathered MiB` column is what one rank's ZeRO-3 gathers received per step.

Each contender is the same model from the same seed, parallelized with the same plan
(ComputeConfig(plan, world, compile=True), bf16 weights), one with float8=--recipe (torchao's
float8 training on every nn.Linear but the output head, torchao's auto filter), trained with
AdamW (lr 3e-4) on the same random-token batches (labels = input_ids). Reported per contender:
median step time after --warmup steps, tokens/s per GPU, peak memory (CUDA) or peak RSS, and
the mean loss of the last 10 steps; then float8/bf16 speedup and the loss difference. The
issue's target on a GPU: tokens/s >= 1.25x bf16, loss after 100 steps within 1 % of bf16's.
On the CPU float8 matmuls are emulated (slower than bf16): --tiny only checks that it runs.
The table is printed and appended to benchmarks/results/float8_<device>.txt unless --no-save.
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from run_record import command, write_atomic  # noqa: E402

import nncompile  # noqa: E402


def llama(tiny: bool):
    from transformers import LlamaConfig, LlamaForCausalLM
    if tiny:
        cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    else:
        cfg = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                          num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4,
                          max_position_embeddings=4096)
    return LlamaForCausalLM(cfg), cfg.vocab_size


class Loss(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, labels):
        return self.model(input_ids=input_ids, labels=labels, use_cache=False).loss


def run(args, float8: str | None, device: torch.device, savedir: str,
        all_gather: bool = True) -> dict:
    torch.manual_seed(0)
    model, vocab = llama(args.tiny)
    model = Loss(model.to(torch.bfloat16))
    world = dist.get_world_size()
    spec = nncompile.Float8Spec(float8, filter="all" if args.tiny else "auto",
                                all_gather=all_gather) if float8 else None
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, vocab, (args.batch, args.seq), generator=g)
               for _ in range(args.steps)]
    cfg = nncompile.ComputeConfig(args.plan, world, compile=args.compile and not args.zero3,
                                  float8=spec, use_zero=3 if args.zero3 else 0)
    name = (float8 or "bf16") + ("" if all_gather or not float8 else ", hp gather")
    pm = nncompile.parallelize(model, {"input_ids": batches[0], "labels": batches[0]}, cfg,
                               pas_policy="tp" if args.plan > 1 else "dp",
                               gen_savedir=savedir, device=device,
                               instance_name=f"float8_{float8}_{int(all_gather)}")
    opt = torch.optim.AdamW(pm.parameters(), lr=3e-4)
    times, losses = [], []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for ids in batches:
        ids = ids.to(device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        loss = pm(input_ids=ids, labels=ids)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    step = statistics.median(times[args.warmup:])
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) / 2 ** 30
    else:
        import resource
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20
    gathered = pm.zero.gathered_bytes / len(batches) / 2 ** 20 if pm.zero is not None else 0
    return {"name": name, "step_s": step,
            "tokens_s": args.batch * args.seq / step / args.plan,    # a unit of plan GPUs
            "peak_gib": peak, "loss": statistics.mean(losses[-10:]), "gathered_mib": gathered}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--plan", type=int, default=1, help="tensor-parallel ranks")
    ap.add_argument("--recipe", default="tensorwise", choices=["tensorwise", "rowwise"])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--tiny", action="store_true", help="a 2-layer d 128 Llama (CPU smoke)")
    ap.add_argument("--no-compile", dest="compile", action="store_false")
    ap.add_argument("--zero3", action="store_true",
                    help="ZeRO-3 (no compile): float8 gathered in float8 and in high precision")
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args()
    if args.tiny:
        args.seq = min(args.seq, 64)
        args.warmup = min(args.warmup, args.steps // 2)
    cuda = args.device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}") if cuda \
        else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    with tempfile.TemporaryDirectory() as tmp:
        rows = [run(args, None, device, tmp), run(args, args.recipe, device, tmp)]
        if args.zero3:
            rows.append(run(args, args.recipe, device, tmp, all_gather=False))
    base, f8 = rows[:2]
    gathered = f"{'gathered MiB':>14}" if args.zero3 else ""
    lines = [f"# {datetime.datetime.now():%Y-%m-%d %H:%M}  "
             f"{command('benchmarks/float8.py', dist.get_world_size())}",
             f"{'contender':<24}{'step ms':>10}{'tokens/s/GPU':>14}{'peak GiB':>10}{'loss':>10}"
             + gathered]
    lines += [f"{r['name']:<24}{r['step_s'] * 1e3:>10.1f}{r['tokens_s']:>14.0f}"
              f"{r['peak_gib']:>10.2f}{r['loss']:>10.4f}"
              + (f"{r['gathered_mib']:>14.2f}" if args.zero3 else "") for r in rows]
    lines.append(f"float8/bf16: tokens/s {f8['tokens_s'] / base['tokens_s']:.3f}x, loss "
                 f"{(f8['loss'] - base['loss']) / base['loss'] * 100:+.2f} %")
    if dist.get_rank() == 0:
        print("\n".join(lines), flush=True)
        if not args.no_save:
            path = os.path.join(HERE, "results", f"float8_{args.device}.txt")
            old = open(path).read() if os.path.exists(path) else ""
            write_atomic(path, old + "\n".join(lines) + "\n\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
