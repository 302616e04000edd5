"""Mixture-of-experts layers with their experts split across the plan's ranks (E ranks: each
holds E_total / E experts of every layer): per-rank parameter bytes (experts and the rest),
the bytes autograd keeps for backward, and the step time, for E = 1, 2, 4, on a Hugging Face
Mixtral.

    python benchmarks/expert_parallel.py [--eps 1,2,4] [--experts 8] [--hidden 256]
                                         [--layers 2] [--batch 4] [--seq 128] [--steps 3]

Every rank runs in this process, one thread each (nncompile.tools.simulate: collectives between
threads, sharing this machine's cores, so step times show the work split and the
communication, not a cluster's speed); E = 1 is the generated program on one rank. The loss of
every E is checked against E = 1 (1e-5 relative). Per rank: the slowest rank's median step of
--steps after one warm-up; the largest parameter and saved-activation bytes over ranks.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from context_parallel import timed_steps  # noqa: E402

EXPERT_NAMES = ("experts_gate_up_proj", "experts_down_proj")


def model_and_batch(args):
    import transformers
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(
        vocab_size=512, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
        num_local_experts=args.experts, num_experts_per_tok=2,
        max_position_embeddings=args.seq, output_router_logits=True)

    class LM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lm = transformers.MixtralForCausalLM(cfg)

        def forward(self, input_ids):
            return self.lm(input_ids=input_ids, labels=input_ids).loss

    g = torch.Generator().manual_seed(1)
    return LM().train(), {"input_ids": torch.randint(0, 512, (args.batch, args.seq), generator=g)}


def run(args, ep: int, outdir: Path) -> dict:
    import nncompile
    from nncompile.tools.simulate import run_ranks
    model, batch = model_and_batch(args)
    config = nncompile.ComputeConfig(ep, ep)

    def rank_fn(rank: int) -> dict:
        pm = nncompile.parallelize(copy.deepcopy(model), batch, config, pas_policy="tp",
                                   gen_savedir=str(outdir), instance_name=f"ep{ep}")
        experts = sum(p.numel() * p.element_size() for n, p in pm.named_parameters()
                      if n.endswith(EXPERT_NAMES))
        total = sum(p.numel() * p.element_size() for p in pm.parameters())
        times, acts, loss = timed_steps(pm, batch, args.steps)
        return {"experts": experts, "params": total, "activations": acts,
                "ms": statistics.median(times), "loss": float(loss)}

    rows = run_ranks(ep, rank_fn) if ep > 1 else [rank_fn(0)]
    return {"ep": ep, **{k: max(r[k] for r in rows) for k in ("experts", "params",
                                                               "activations", "ms")},
            "loss": rows[0]["loss"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--eps", default="1,2,4")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for ep in [int(e) for e in args.eps.split(",")]:
            results.append(run(args, ep, Path(tmp)))
    base = results[0]
    print(f"# torch {torch.__version__}  Mixtral hidden {args.hidden} x {args.layers} layers, "
          f"{args.experts} experts (top-2), batch {args.batch} x {args.seq}, CPU threads")
    print(f"{'E':>3} {'experts/rank':>13} {'x E=1':>6} {'params/rank':>12} {'x E=1':>6} "
          f"{'activations':>12} {'step ms':>8}")
    for r in results:
        if abs(r["loss"] - base["loss"]) > 1e-5 * abs(base["loss"]):
            raise SystemExit(f"E={r['ep']}: loss {r['loss']} differs from E=1's {base['loss']}")
        print(f"{r['ep']:3d} {r['experts'] / 2**20:9.2f} MiB {r['experts'] / base['experts']:6.3f} "
              f"{r['params'] / 2**20:8.2f} MiB {r['params'] / base['params']:6.3f} "
              f"{r['activations'] / 2**20:8.2f} MiB {r['ms']:8.1f}")


if __name__ == "__main__":
    main()
