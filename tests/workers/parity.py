"""Multi-rank parity worker (run under torchrun, gloo): for every model, policy and legal
(plan, runtime) at this world size, the parallel loss and every gathered gradient must equal a
single-device run (plan units see different batches; gradients are the units' average).

    torchrun --nproc_per_node=4 tests/workers/parity.py --models gpt --out report.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import models  # noqa: E402

import nncompile  # noqa: E402

# float32. Partial sums (k-split matmuls, cross-rank loss sums) reorder additions, so
# gradients are compared with rtol 1e-5 and an atol of 1e-6 scaled by the tensor's magnitude
# (max(1, max |ref|)); losses with rtol 1e-5 / atol 1e-6.
RTOL, ATOL = 1e-5, 1e-6
PLANS = {1: [(1, 1)], 2: [(1, 2), (2, 2)], 4: [(2, 4), (4, 4)]}


def reference(name: str, n_units: int):
    losses, grads = [], None
    for u in range(n_units):
        model = models.build(name)
        loss = model(**models.batch(name, u))
        loss.backward()
        losses.append(loss.detach())
        g = {k: p.grad.clone() for k, p in model.named_parameters()}
        grads = g if grads is None else {k: grads[k] + g[k] for k in g}
    return losses, {k: v / n_units for k, v in grads.items()}


RECOMPUTE = ["Block", "LlamaDecoderLayer", "T5Block", "BartEncoderLayer", "BartDecoderLayer"]


def pas_config(name: str, policy: str, plan: int, runtime: int) -> dict:
    """autodist_mem: a memory limit halfway between the leanest plan and replicating everything
    (so weights must be split), with the transformer blocks recomputed."""
    if policy != "autodist_mem":
        return {}
    from nncompile.frontend import trace
    from nncompile.passes.autodist import leanest_memory, plan_problem, replicated_memory
    config = {"recompute_modules": RECOMPUTE}
    g = trace(models.build(name), models.batch(name, 0))
    _, prob = plan_problem(g, nncompile.ComputeConfig(plan, runtime, pas_config=config))
    config["mem_limit_gb"] = (leanest_memory(prob) + replicated_memory(prob)) / 2 / 1e9
    return config


def check(name: str, policy: str, plan: int, runtime: int, savedir: str) -> dict:
    rank = dist.get_rank()
    unit = rank // plan
    model = models.build(name)
    cfg = nncompile.ComputeConfig(plan_ngpus=plan, runtime_ngpus=runtime,
                                  pas_config=pas_config(name, policy, plan, runtime))
    pm = nncompile.parallelize(model, models.batch(name, 0), cfg,
                               pas_policy=policy.split("_")[0],
                               gen_savedir=savedir, reuse="override",
                               instance_name=f"{name}_{policy}_{plan}x{runtime}")
    loss = pm(**models.batch(name, unit))
    loss.backward()
    grads = pm.gather_grads()
    ref_losses, ref_grads = reference(name, runtime // plan)
    torch.testing.assert_close(loss.detach(), ref_losses[unit], rtol=RTOL, atol=ATOL,
                               msg=lambda m: f"{name} {policy} {plan}x{runtime} loss: {m}")
    worst = 0.0
    assert set(grads) == set(ref_grads), (sorted(grads), sorted(ref_grads))
    for fqn, g in grads.items():
        want = ref_grads[fqn]
        scale = max(1.0, float(want.abs().max()))
        torch.testing.assert_close(
            g, want, rtol=RTOL, atol=ATOL * scale,
            msg=lambda m: f"{name} {policy} {plan}x{runtime} grad {fqn}: {m}")
        worst = max(worst, float((g - want).abs().max()))
    plan_file = json.load(open(os.path.join(savedir, f"{name}_{policy}_{plan}x{runtime}",
                                            "plan.json")))
    return {"model": name, "policy": policy, "plan": plan, "runtime": runtime,
            "loss": float(loss.detach()), "max_grad_err": worst,
            "collectives": plan_file["collectives"],
            "sharded_params": sum(p != "R" for p in plan_file["params"].values()),
            "custom_ops": [(op["op"], op["strategy"]) for op in plan_file["ops"]
                           if op["op"].startswith("custom.")],
            "recompute": open(pm.gencode_path).read().count("= checkpoint(")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="mlp,gpt,hf_gpt2,hf_llama,custom")
    ap.add_argument("--policies", default="dp,data,tp,autodist,autodist_mem")
    ap.add_argument("--autodist-models", default="gpt,hf_llama")
    ap.add_argument("--seq2seq-models", default="hf_t5,hf_bart",
                    help="encoder-decoder models, checked under tp/data/autodist at plan 2")
    ap.add_argument("--savedir", default="./.nncompile/parity")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    os.environ.setdefault("NNCOMPILE_QUIET", "1")
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    results = []
    for plan, runtime in PLANS[dist.get_world_size()]:
        for policy in args.policies.split(","):
            if policy == "dp" and plan != 1 or policy.startswith("autodist") and plan == 1:
                continue
            names = args.models.split(",")
            if plan == 2 and policy in ("tp", "data", "autodist", "autodist_mem"):
                names += [m for m in args.seq2seq_models.split(",") if m]
            for name in names:
                if policy.startswith("autodist") and name not in args.autodist_models \
                        and name not in args.seq2seq_models.split(","):
                    continue
                results.append(check(name, policy, plan, runtime, args.savedir))
    if dist.get_rank() == 0:
        for r in results:
            print(f"ok {r['model']:<9} {r['policy']:<12} {r['plan']}x{r['runtime']}  "
                  f"loss {r['loss']:.5f}  max grad err {r['max_grad_err']:.2e}  "
                  f"{r['collectives']}", flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
