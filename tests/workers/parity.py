"""Multi-rank parity worker (run under torchrun, gloo): for every model, policy and legal
(plan, runtime) at this world size, the parallel loss and every gathered gradient must equal a
single-device run (plan units see different batches; gradients are the units' average). A
few plans run again with ComputeConfig(compile=True) (COMPILED), reporting dynamo's graph and
graph-break counts.

    torchrun --nproc_per_node=4 tests/workers/parity.py --models gpt --out report.json
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import models  # noqa: E402

import nncompile  # noqa: E402
from nncompile.passes.policies import split_everything  # noqa: E402

# float32. Partial sums (k-split matmuls, cross-rank loss sums) reorder additions, so
# gradients are compared with rtol 1e-5 and an atol of 1e-6 scaled by the tensor's magnitude
# (max(1, max |ref|)); losses with rtol 1e-5 / atol 1e-6.
RTOL, ATOL = 1e-5, 1e-6
PLANS = {1: [(1, 1)], 2: [(1, 2), (2, 2)], 4: [(2, 4), (4, 4)]}
# ComputeConfig(compile=True) cases per world size, (model, policy, plan), at the same
# tolerances (inductor's fused kernels reorder float sums by ~1e-7 relative). Few: one inductor
# compile of a small model takes 10-30 s on two cores.
COMPILED = {1: [("gpt", "dp", 1)], 2: [("gpt", "tp", 2), ("hf_llama", "tp", 2)]}


@functools.lru_cache(maxsize=None)
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


SEQ2SEQ = ("hf_t5", "hf_bart")
# autodist on the encoder-decoders: CBC finds its plan within a second or two but cannot prove
# it optimal (their layers differ, so none share variables) and would search to the default
# 60 s limit; 5 s gives the same plan (the same modelled step time)
SEQ2SEQ_SOLVER_S = 5.0


def pas_config(name: str, policy: str, plan: int, runtime: int) -> dict:
    """autodist_mem: a memory limit halfway between the leanest plan and replicating everything
    (so weights must be split), with the transformer blocks recomputed."""
    limit = {"solver_time_limit": SEQ2SEQ_SOLVER_S} if name in SEQ2SEQ and \
        policy.startswith("autodist") else {}
    if policy != "autodist_mem":
        return limit
    from nncompile.frontend import trace
    from nncompile.passes.autodist import leanest_memory, plan_problem, replicated_memory
    config = {"recompute_modules": RECOMPUTE, **limit}
    box = [None]
    if dist.get_rank() == 0:        # rank 0 compiles; the others take its limit
        g = trace(models.build(name), models.batch(name, 0))
        _, prob = plan_problem(g, nncompile.ComputeConfig(plan, runtime, parallel=config))
        box[0] = (leanest_memory(prob) + replicated_memory(prob)) / 2 / 1e9
    dist.broadcast_object_list(box, src=0)
    config["mem_limit_gb"] = box[0]
    return config


def late_gather(graph, config):
    """tp_sp with the norms' weight multiplies replicated: the gather lands before them, as
    autodist once planned Llama-3-8B, and the sink_gathers pass must move it after them."""
    from nncompile.ir import PARAM, Replicate
    from nncompile.passes.policies import tp_sp
    from nncompile.rules import replicated
    g = tp_sp(graph, config)
    for op in g.ops:
        if op.target_name == "aten.mul.Tensor" and "layernorm" in op.module_path \
                and any(v.kind == PARAM for v in op.tensor_inputs()):
            op.strategy = replicated(op)
            op.outputs[0].placement = Replicate()
    return g


# matrix names that are not policy names: autodist under a memory limit, a plan that splits
# every op (not one to train with: it exercises every collective of the table), a gather to sink
POLICY = {"autodist_mem": "autodist", "split_all": split_everything, "late_gather": late_gather}


def check(name: str, policy: str, plan: int, runtime: int, savedir: str,
          compile: bool = False) -> dict:
    rank = dist.get_rank()
    unit = rank // plan
    model = models.build(name)
    cfg = nncompile.ComputeConfig(plan_ngpus=plan, runtime_ngpus=runtime,
                                  parallel=pas_config(name, policy, plan, runtime),
                                  compile=compile)
    from torch._dynamo.utils import counters      # graphs and graph breaks of compile=True
    counters.clear()
    start = time.perf_counter()
    pm = nncompile.parallelize(model, models.batch(name, 0), cfg,
                               pas_policy=POLICY.get(policy, policy),
                               gen_savedir=savedir, reuse="override",
                               instance_name=f"{name}_{policy}_{plan}x{runtime}"
                               + ("_compiled" if compile else ""))
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
    plan_file = json.load(open(os.path.join(savedir, os.path.basename(
        os.path.dirname(pm.gencode_path)), "plan.json")))
    return {"model": name, "policy": policy, "plan": plan, "runtime": runtime,
            "compile": compile, "graphs": counters["stats"]["unique_graphs"],
            "graph_breaks": sum(counters["graph_break"].values()),
            "seconds": round(time.perf_counter() - start, 1),
            "loss": float(loss.detach()), "max_grad_err": worst,
            "collectives": plan_file["collectives"],
            "sharded_params": sum(p != "R" for p in plan_file["params"].values()),
            "custom_ops": [(op["op"], op["strategy"]) for op in plan_file["ops"]
                           if op["op"].startswith("custom.")],
            "recompute": open(pm.gencode_path).read().count("= checkpoint("),
            "fused_gathers": open(pm.gencode_path).read().count("reduce_grad=True")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="mlp,gpt,hf_gpt2,hf_llama,custom")
    ap.add_argument("--policies",
                    default="dp,data,tp,tp_sp,split_all,late_gather,autodist,autodist_mem")
    ap.add_argument("--autodist-models", default="gpt,hf_llama")
    ap.add_argument("--seq2seq-models", default="hf_t5,hf_bart",
                    help="encoder-decoder models, checked under tp/data/autodist at plan 2")
    ap.add_argument("--savedir", default="./.nncompile/parity")
    ap.add_argument("--out", default=None)
    ap.add_argument("--no-compile", action="store_true", help="skip the compile=True cases")
    args = ap.parse_args()
    os.environ.setdefault("NNCOMPILE_QUIET", "1")
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    results = []
    for plan, runtime in PLANS[dist.get_world_size()]:
        for policy in args.policies.split(","):
            if policy == "dp" and plan != 1 or policy.startswith("autodist") and plan == 1 \
                    or policy in ("tp_sp", "split_all", "late_gather") and plan != 2:
                continue
            names = args.models.split(",")
            if policy == "split_all":
                names = ["gpt", "custom"]
            elif policy == "late_gather":
                names = ["hf_llama"]
            elif policy == "tp_sp" and runtime > plan:      # with data parallelism: two models
                names = ["gpt", "hf_llama"]
            elif plan == 2 and policy in ("tp", "tp_sp", "data", "autodist", "autodist_mem"):
                names += [m for m in args.seq2seq_models.split(",") if m]
            for name in names:
                if policy.startswith("autodist") and name not in args.autodist_models \
                        and name not in args.seq2seq_models.split(","):
                    continue
                results.append(check(name, policy, plan, runtime, args.savedir))
    for name, policy, plan in [] if args.no_compile else COMPILED.get(dist.get_world_size(), []):
        if name in args.models.split(",") and policy in args.policies.split(","):
            results.append(check(name, policy, plan, dist.get_world_size(), args.savedir,
                                 compile=True))
    if dist.get_rank() == 0:
        for r in results:
            print(f"ok {r['model']:<9} {r['policy'] + ' compiled' * r['compile']:<12} "
                  f"{r['plan']}x{r['runtime']}  "
                  f"loss {r['loss']:.5f}  max grad err {r['max_grad_err']:.2e}  "
                  f"{r['collectives']}", flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
