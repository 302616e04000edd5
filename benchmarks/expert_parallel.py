"""Mixture-of-experts layers with their experts split across E ranks (each holds E_total / E
experts of every layer), two ways: `ep` (pas_config expert_parallel=E under the data policy:
each rank its own tokens, dispatched to the experts' ranks by all-to-all), `tp` (the tp
policy: every rank has every token and computes its experts' picks, outputs all-reduced) and
`eptp` (an ep axis of E beside 2 tensor ranks, 2E ranks in all: attention by heads).
Per rank: parameter bytes (experts and the rest), the bytes autograd keeps for backward and
the step time, for E = 1, 2, 4, on a Hugging Face Mixtral.

    python benchmarks/expert_parallel.py [--eps 1,2,4] [--modes ep,tp] [--experts 8]
                  [--hidden 256] [--layers 2] [--batch 4] [--seq 128] [--steps 3]

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
import time
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

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


def run(args, ep: int, mode: str, outdir: Path) -> dict:
    import nncompile
    from nncompile.tools.simulate import run_ranks
    model, batch = model_and_batch(args)
    ranks = 2 * ep if mode == "eptp" else ep
    pas = {"ep": ep} if mode in ("ep", "eptp") and ep > 1 else {}
    config = nncompile.ComputeConfig(ranks, ranks, parallel=pas)
    policy = "data" if mode == "ep" else "tp"

    def rank_fn(rank: int) -> dict:
        pm = nncompile.parallelize(copy.deepcopy(model), batch, config, pas_policy=policy,
                                   gen_savedir=str(outdir), instance_name=f"{mode}{ep}")
        local = {n: p.to_local() if isinstance(p, DTensor) else p      # this rank's bytes
                 for n, p in pm.named_parameters()}
        experts = sum(p.numel() * p.element_size() for n, p in local.items()
                      if n.endswith(EXPERT_NAMES))
        total = sum(p.numel() * p.element_size() for p in local.values())
        times, acts, loss = timed_steps(pm, batch, args.steps)
        return {"experts": experts, "params": total, "activations": acts,
                "ms": statistics.median(times), "loss": float(loss)}

    rows = run_ranks(ranks, rank_fn) if ranks > 1 else [rank_fn(0)]
    return {"ep": ep, "mode": mode if ep > 1 else "-", **{k: max(r[k] for r in rows) for k in ("experts", "params",
                                                               "activations", "ms")},
            "loss": rows[0]["loss"]}


def kernel(args) -> None:
    """--kernel: one Mixtral layer's experts on --device in --dtype, forward + backward, as
    Hugging Face computes them and as moe_experts does (the grouped product where torch
    offers it: nncompile/experts.py), their outputs compared."""
    import transformers
    from nncompile.experts import _grouped_ok, routed_sum
    dev, dtype = torch.device(args.device), getattr(torch, args.dtype)
    cfg = transformers.MixtralConfig(hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                                     num_local_experts=args.experts, num_experts_per_tok=2)
    experts = transformers.models.mixtral.modeling_mixtral.MixtralExperts(cfg).to(dev, dtype)
    for w in experts.parameters():
        torch.nn.init.normal_(w, std=args.hidden ** -0.5)
    tokens = args.batch * args.seq
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, args.hidden, generator=g).to(dev, dtype).requires_grad_()
    index = torch.stack([torch.randperm(args.experts, generator=g)[:2] for _ in range(tokens)])
    index, weights = index.to(dev), torch.rand(tokens, 2, generator=g).to(dev, dtype)

    def ours():
        return routed_sum(x, index, weights, experts.gate_up_proj, experts.down_proj, "silu",
                          False)

    def theirs():
        return experts(x, index, weights)

    def timed(fn) -> float:
        times = []
        for i in range(args.steps + 1):
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            fn().float().square().mean().backward()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            if i:
                times.append((time.perf_counter() - t) * 1e3)
        return statistics.median(times)

    err = float((ours() - theirs()).float().abs().max() / theirs().float().abs().max())
    print(f"# torch {torch.__version__} transformers {transformers.__version__} {dev} {dtype}: "
          f"{tokens} tokens x hidden {args.hidden}, {args.experts} experts (top-2); grouped "
          f"product: {_grouped_ok(x)}; largest difference {err:.2e} of the largest output")
    print(f"moe_experts {timed(ours):8.2f} ms   Hugging Face "
          f"({getattr(experts.config, '_experts_implementation', None) or 'default'}) {timed(theirs):8.2f} ms  (forward + backward)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--eps", default="1,2,4")
    p.add_argument("--modes", default="ep,tp")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--kernel", action="store_true", help="time one layer's experts only")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    args = p.parse_args()
    if args.kernel:
        return kernel(args)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for ep in [int(e) for e in args.eps.split(",")]:
            for mode in args.modes.split(",") if ep > 1 else ["ep"]:
                results.append(run(args, ep, mode, Path(tmp)))
    base = results[0]
    print(f"# torch {torch.__version__}  Mixtral hidden {args.hidden} x {args.layers} layers, "
          f"{args.experts} experts (top-2), batch {args.batch} x {args.seq}, CPU threads")
    print(f"{'E':>3} {'mode':>4} {'experts/rank':>13} {'x E=1':>6} {'params/rank':>12} {'x E=1':>6} "
          f"{'activations':>12} {'step ms':>8}")
    for r in results:
        if abs(r["loss"] - base["loss"]) > 1e-5 * abs(base["loss"]):
            raise SystemExit(f"E={r['ep']}: loss {r['loss']} differs from E=1's {base['loss']}")
        print(f"{r['ep']:3d} {r['mode']:>4} {r['experts'] / 2**20:9.2f} MiB {r['experts'] / base['experts']:6.3f} "
              f"{r['params'] / 2**20:8.2f} MiB {r['params'] / base['params']:6.3f} "
              f"{r['activations'] / 2**20:8.2f} MiB {r['ms']:8.1f}")


if __name__ == "__main__":
    main()
