"""Compile time without a GPU: a Llama-3-8B-shaped model and GPT-2 small, built on the meta
device (no weights in memory), compiled with autodist for plan_ngpus 8 (load_module=False).

    python benchmarks/compile_time.py [--models llama3_8b,gpt2_small] [--plan 8]
    python benchmarks/compile_time.py --pipeline [--stages 8] [--plan 64] [--microbatches 8]
                                      [--layers 80] [--dtype float32]

Prints seconds for trace / passes (of which the ILP) / codegen and the total, wall and CPU
(this process and the ILP solver it runs: a shared machine's wall time includes other jobs,
so the load average is printed too), the plan's collectives and one PASS / OVER TARGET line
per model. Targets (total wall seconds) on a 2-core CPU: Llama-8B <= 5 s, GPT-2 small <= 1 s.
The first model compiled also pays for importing torch.export (about 0.8 s of CPU).

--pipeline: a Llama-3-70B shape (hidden 8192, intermediate 28672, 80 layers, 64 heads, 8 kv
heads, vocab 128256, seq 4096) on the meta device, autodist with pipeline_stages (8 stages x 8
tensor-parallel ranks = plan 64; or "auto"), M micro-batches of one sequence, 1F1B, on the
h100-80g profile; 64 rank files written. Prints the seconds per phase (trace, every pass,
codegen; wall and this process's CPU, since a shared machine's wall time includes other
jobs) and the stage balance: layers, predicted ms and memory per stage, slowest / mean.
Target on a 2-core CPU: <= 30 s, slowest stage <= 1.10 x the mean.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import nncompile  # noqa: E402
from models import HFCausalLM  # noqa: E402


def llama3_8b():
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                      max_position_embeddings=8192, rope_theta=500000.0,
                      bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return HFCausalLM(LlamaForCausalLM(cfg)), 4096


def llama3_70b(layers: int = 80, dtype: str = "float32"):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                      num_hidden_layers=layers, num_attention_heads=64, num_key_value_heads=8,
                      max_position_embeddings=8192, rope_theta=500000.0,
                      bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return HFCausalLM(LlamaForCausalLM(cfg)).to(getattr(torch, dtype)), 4096


def gpt2_small():
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12,
                     bos_token_id=0, eos_token_id=0)
    return HFCausalLM(GPT2LMHeadModel(cfg)), 1024


MODELS = {"llama3_8b": llama3_8b, "gpt2_small": gpt2_small}
TARGETS = {"llama3_8b": 5.0, "gpt2_small": 1.0}     # total wall seconds on a 2-core CPU


def pipeline(args) -> None:
    """The Llama-3-70B pipeline compile: seconds per phase and the stage balance."""
    import time
    start, cpu = time.perf_counter(), time.process_time()
    with torch.device("meta"):
        model, seq = llama3_70b(args.layers, args.dtype)
    build = time.perf_counter() - start
    ids = torch.zeros(args.microbatches, seq, dtype=torch.long, device="meta")
    stages = args.stages if args.stages == "auto" else int(args.stages)
    pas = {"device": args.device, "pp": stages, "microbatches": args.microbatches}
    if args.mem_limit_gb:
        pas["mem_limit_gb"] = args.mem_limit_gb
    with tempfile.TemporaryDirectory() as tmp:
        t0, c0 = time.perf_counter(), time.process_time()
        out = nncompile.parallelize(model, {"input_ids": ids, "labels": ids},
                                    nncompile.ComputeConfig(args.plan, parallel=pas),
                                    gen_savedir=tmp, load_module=False, instance_name="llama70b")
        wall, cpu_compile = time.perf_counter() - t0, time.process_time() - c0
        secs = json.loads((out / "manifest.json").read_text())["compile_seconds"]
        passes = [f.read_text().split("\n", 1)[0] for f in sorted((out / "graphs").glob("*.py"))]
        plan = json.loads((out / "plan.json").read_text())
        files = len(list(out.glob("gencode*.py")))
    pp = plan["pipeline"]
    print(f"llama3_70b-shaped ({args.layers} layers, {args.dtype}), seq {seq}, plan_ngpus "
          f"{args.plan}, pipeline_stages={stages}, {args.microbatches} micro-batches, "
          f"{args.device}: {files} rank files")
    print(f"  build on meta {build:.2f} s | trace {secs['trace']:.2f} s | passes "
          f"{secs['passes']:.2f} s (ILP {secs['ilp']:.2f} s) | codegen {secs['codegen']:.2f} s"
          f" | total {secs['total']:.2f} s (parallelize {wall:.2f} s wall, {cpu_compile:.2f} s "
          f"CPU of this process; {time.process_time() - cpu:.2f} s CPU since start)")
    print("  passes: " + "; ".join(line.removeprefix("# after ").split(" of a ")[0]
                                   .replace("'", "") for line in passes[1:]))
    if not pp or not pp.get("stages"):
        print(f"  no pipeline: {pp and pp.get('chosen_by')}")
        return
    times = [st["predicted_ms"] for st in pp["stages"]]
    mean = sum(times) / len(times)
    print(f"  {pp['nstages']} stages x tp {pp['tp']} ({pp['chosen_by']}); predicted step "
          f"{pp.get('predicted_step_ms') or float('nan'):.1f} ms")
    print(f"  balance: slowest stage {max(times):.2f} ms = {max(times) / mean:.4f} x the mean "
          f"{mean:.2f} ms (target <= 1.10)")
    for st in pp["stages"]:
        print(f"    stage {st['stage']}: {len(st['layers']):3d} layers ({st['layers'][0]} ... "
              f"{st['layers'][-1]}), {st['predicted_ms']:8.2f} ms, "
              f"{st['memory_bytes'] / 1e9:6.2f} GB ({st['inflight_microbatches']:g} micro-batches"
              f" in flight)")
    if pp.get("candidates") and pp.get("auto"):
        for c in pp["candidates"]:
            print(f"    S={c['stages']} x tp {c['tp']}: {c['status']}, step {c['step_ms']} ms")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="llama3_8b,gpt2_small")
    ap.add_argument("--plan", type=int, default=None, help="plan_ngpus (default 8; 64 with "
                    "--pipeline)")
    ap.add_argument("--device", default="h100-80g")
    ap.add_argument("--pipeline", action="store_true", help="the Llama-3-70B pipeline case")
    ap.add_argument("--stages", default="8", help="pipeline_stages (an int or 'auto')")
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--layers", type=int, default=80)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--mem-limit-gb", type=float, default=None)
    args = ap.parse_args()
    os.environ.setdefault("NNCOMPILE_QUIET", "1")
    if args.pipeline:
        args.plan = args.plan or 64
        pipeline(args)
        return
    args.plan = args.plan or 8
    for name in args.models.split(","):
        with torch.device("meta"):
            model, seq = MODELS[name]()
        ids = torch.zeros(1, seq, dtype=torch.long, device="meta")
        n_params = sum(p.numel() for p in model.parameters())
        with tempfile.TemporaryDirectory() as tmp:
            out = nncompile.parallelize(
                model, {"input_ids": ids, "labels": ids},
                nncompile.ComputeConfig(args.plan, args.plan,
                                        parallel={"device": args.device}),
                gen_savedir=tmp, load_module=False, instance_name=name)
            secs = json.loads((out / "manifest.json").read_text())["compile_seconds"]
            plan = json.loads((out / "plan.json").read_text())
        ad = plan["autodist"]
        cpu = secs.get("cpu", {})
        print(f"{name}: {n_params / 1e9:.2f}B params, seq {seq}, plan_ngpus {args.plan}, "
              f"{len(plan['ops'])} ops -> {len(ad['choices'])} decisions "
              f"(shared layers {ad['shared_layers']}), {ad['variables']} ILP vars")
        print(f"  wall: trace {secs['trace']:.2f} s | passes {secs['passes']:.2f} s "
              f"(ILP {secs['ilp']:.2f} s, {ad['solver']}) | codegen {secs['codegen']:.2f} s | "
              f"total {secs['total']:.2f} s")
        if cpu:
            print(f"  CPU:  trace {cpu['trace']:.2f} s | passes {cpu['passes']:.2f} s | "
                  f"codegen {cpu['codegen']:.2f} s | total {cpu['total']:.2f} s "
                  f"(load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs)")
        print(f"  plan: {ad['objective_ms']:.1f} ms/step modelled on {ad['device']}, "
              f"{ad['memory_gb']:.1f} GB/rank; collectives {plan['collectives']}")
        target = TARGETS.get(name) if args.plan == 8 else None
        if target is not None:
            verdict = "PASS" if secs["total"] <= target else \
                f"OVER TARGET by {secs['total'] - target:.2f} s"
            print(f"  target <= {target:.1f} s total: {verdict} ({secs['total']:.2f} s wall, "
                  f"{cpu.get('total', float('nan')):.2f} s CPU)")


if __name__ == "__main__":
    main()
