"""ZeRO-3 with CPU offload vs without, at one rank: peak device memory and step time.

    torchrun --nproc_per_node=1 benchmarks/zero_offload.py --device cuda     # NCCL
    torchrun --nproc_per_node=1 benchmarks/zero_offload.py                   # gloo, CPU

Three runs of the same GPT, same weights and batches, measured one after the other in one
process (each configuration alone on the device, so its peak is its own): plain (use_zero=0), ZeRO-3
(use_zero=3; one rank: the pieces are whole, the gathers are copies) and ZeRO-3 with
offload_optimizer=True and offload_params=True (parameters, gradients and AdamW state in host
memory; each layer is copied to the device right before use). Peak device memory is
torch.cuda.max_memory_allocated over the configuration's steps (model and optimizer built
after the previous one was freed); on CPU, host and
device are one memory and only step time and loss equality are reported. The losses of all
three must agree (float32 reordering only).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from gpt import GPT  # noqa: E402

import nncompile  # noqa: E402

CONFIGS = {"plain": dict(use_zero=0), "zero3": dict(use_zero=3),
           "zero3+offload": dict(use_zero=3, offload_optimizer=True, offload_params=True)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--embd", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    nncompile.init_distributed("nccl" if args.device == "cuda" else "gloo")
    device = torch.device(args.device)
    vocab = 8192
    torch.manual_seed(0)
    base = GPT(vocab_size=vocab, block_size=args.seq, n_layer=args.layers, n_head=16,
               n_embd=args.embd)
    nparams = sum(p.numel() for p in base.parameters())
    g = torch.Generator().manual_seed(1)
    batches = [{"idx": torch.randint(0, vocab, (args.batch, args.seq), generator=g).to(device),
                "targets": torch.randint(0, vocab, (args.batch, args.seq), generator=g)
                .to(device)} for _ in range(args.steps + 1)]
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, kw in CONFIGS.items():
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            model = GPT(vocab_size=vocab, block_size=args.seq, n_layer=args.layers, n_head=16,
                        n_embd=args.embd)
            model.load_state_dict(base.state_dict())
            model.to(device)
            cfg = nncompile.ComputeConfig(1, 1, **kw)
            pm = nncompile.parallelize(model, batches[0], cfg, pas_policy="dp", gen_savedir=tmp,
                                       instance_name=name.replace("+", "_"))
            del model
            opt = nncompile.build_optimizer(pm, torch.optim.AdamW, lr=1e-4)
            r = runs[name] = {"times": [], "losses": [], "peak": 0}
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            for step in range(args.steps + 1):
                if device.type == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                loss = pm(**batches[step])
                loss.backward()
                opt.step()
                opt.zero_grad()
                if device.type == "cuda":
                    torch.cuda.synchronize()
                if step:                      # step 0 is warm-up
                    r["times"].append(time.perf_counter() - t0)
                r["losses"].append(float(loss.detach()))
            if device.type == "cuda":
                r["peak"] = torch.cuda.max_memory_allocated()
            del pm, opt, loss
    ref = runs["plain"]["losses"]
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"GPT {args.layers}x{args.embd}, {nparams / 1e6:.0f}M params, batch "
          f"{args.batch}x{args.seq}, fp32, AdamW, {name}, torch {torch.__version__}")
    print(f"{'config':<16}{'step ms (median)':>18}{'peak GiB':>10}{'max |loss - plain|':>20}")
    for cname, r in runs.items():
        diff = max(abs(a - b) for a, b in zip(r["losses"], ref))
        peak = f"{r['peak'] / 2**30:.2f}" if device.type == "cuda" else "-"
        print(f"{cname:<16}{statistics.median(r['times']) * 1e3:>18.1f}{peak:>10}{diff:>20.2e}")
        assert diff <= 1e-3 * abs(ref[-1]), f"{cname} losses differ from plain by {diff}"
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
