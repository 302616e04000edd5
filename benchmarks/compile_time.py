"""Compile time without a GPU: a Llama-3-8B-shaped model and GPT-2 small, built on the meta
device (no weights in memory), compiled with autodist for plan_ngpus 8 (load_module=False).

    python benchmarks/compile_time.py [--models llama3_8b,gpt2_small] [--plan 8]

Prints seconds for trace / passes (of which the ILP) / codegen and the total, and the plan's
collectives. Targets on a 2-core CPU: Llama-8B <= 15 s, GPT-2 small <= 3 s.
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


def gpt2_small():
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12,
                     bos_token_id=0, eos_token_id=0)
    return HFCausalLM(GPT2LMHeadModel(cfg)), 1024


MODELS = {"llama3_8b": llama3_8b, "gpt2_small": gpt2_small}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="llama3_8b,gpt2_small")
    ap.add_argument("--plan", type=int, default=8)
    ap.add_argument("--device", default="h100-80g")
    args = ap.parse_args()
    os.environ.setdefault("NNCOMPILE_QUIET", "1")
    for name in args.models.split(","):
        with torch.device("meta"):
            model, seq = MODELS[name]()
        ids = torch.zeros(1, seq, dtype=torch.long, device="meta")
        n_params = sum(p.numel() for p in model.parameters())
        with tempfile.TemporaryDirectory() as tmp:
            out = nncompile.parallelize(
                model, {"input_ids": ids, "labels": ids},
                nncompile.ComputeConfig(args.plan, args.plan,
                                        pas_config={"device": args.device}),
                gen_savedir=tmp, load_module=False, instance_name=name)
            secs = json.loads((out / "manifest.json").read_text())["compile_seconds"]
            plan = json.loads((out / "plan.json").read_text())
        ad = plan["autodist"]
        print(f"{name}: {n_params / 1e9:.2f}B params, seq {seq}, plan_ngpus {args.plan}, "
              f"{len(plan['ops'])} ops -> {len(ad['choices'])} decisions "
              f"(shared layers {ad['shared_layers']}), {ad['variables']} ILP vars")
        print(f"  trace {secs['trace']:.2f} s | passes {secs['passes']:.2f} s "
              f"(ILP {secs['ilp']:.2f} s, {ad['solver']}) | codegen {secs['codegen']:.2f} s | "
              f"total {secs['total']:.2f} s")
        print(f"  plan: {ad['objective_ms']:.1f} ms/step modelled on {ad['device']}, "
              f"{ad['memory_gb']:.1f} GB/rank; collectives {plan['collectives']}")


if __name__ == "__main__":
    main()
