"""Training parity worker (torchrun, gloo): 20 AdamW steps of the GPT under every runtime
variant equal single-device training on the same global batch, step by step, and the merged
final weights and optimizer state equal the single-device ones.

    torchrun --nproc_per_node=2 tests/workers/train.py --savedir DIR
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import models  # noqa: E402

import nncompile  # noqa: E402

RTOL, ATOL = 1e-5, 1e-6
# Weights after 20 AdamW steps: AdamW divides each element's update by the RMS of that
# element's gradient, so where a gradient is near rounding level the order of the sums (which
# data parallelism and k-split matmuls change) moves the update by a fraction of lr. Measured
# on one process, merely splitting the batch in two moves weights by up to 1.6e-5 in 20 steps,
# and attention key biases (exact gradient zero: softmax ignores a per-row shift) by 4.4e-4.
WEIGHT_ATOL = {"attn.k_proj.bias": 2e-3}
WEIGHT_ATOL_DEFAULT = 1e-4
STATE_ATOL = 1e-3      # times the largest |entry| of each state tensor: follows the weights
STEPS, GLOBAL_BATCH, SEQ = 20, 8, 16
LR, WEIGHT_DECAY = 1e-2, 0.1
PLANS = {2: [("dp", 1, 2), ("tp", 2, 2)], 4: [("tp", 2, 4)]}


@dataclass(frozen=True)
class Variant:
    name: str
    use_async_reducer: bool = False
    use_zero: bool = False
    accum: int = 1              # micro-batches per step
    no_sync: bool = True        # accumulate under pm.no_sync() (else reduce every micro-batch)
    clip: float | None = None
    bucket_mb: float = 25.0


VARIANTS = [
    Variant("sync"),
    Variant("async+clip+small-buckets", use_async_reducer=True, clip=0.3, bucket_mb=0.0002),
    Variant("accum(no_sync)", accum=2),
    Variant("accum(reduce each)+async", use_async_reducer=True, accum=2, no_sync=False),
    Variant("zero", use_zero=True),
    Variant("zero+async+accum+clip", use_zero=True, use_async_reducer=True, accum=2, clip=0.3),
]


def global_batch(step: int, micro: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5000 + 100 * step + micro)
    return {"idx": torch.randint(0, 64, (GLOBAL_BATCH, SEQ), generator=g),
            "targets": torch.randint(0, 64, (GLOBAL_BATCH, SEQ), generator=g)}


def unit_batch(step: int, micro: int, unit: int, n_units: int) -> dict[str, torch.Tensor]:
    rows = GLOBAL_BATCH // n_units
    return {k: v[unit * rows:(unit + 1) * rows] for k, v in global_batch(step, micro).items()}


def reference(v: Variant):
    model = models.build("gpt")
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    losses, clipped = [], 0
    for step in range(STEPS):
        total = 0.0
        for micro in range(v.accum):
            loss = model(**global_batch(step, micro)) / v.accum
            loss.backward()
            total += loss.item()
        if v.clip is not None:
            clipped += float(torch.nn.utils.clip_grad_norm_(model.parameters(), v.clip)) > v.clip
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, model, opt, clipped


def train(policy: str, plan: int, runtime: int, v: Variant, savedir: str):
    n_units = runtime // plan
    unit = dist.get_rank() // plan
    cfg = nncompile.ComputeConfig(plan, runtime, use_async_reducer=v.use_async_reducer,
                                  reducer_bucket_cap_mb=v.bucket_mb, use_zero=v.use_zero)
    pm = nncompile.parallelize(models.build("gpt"), unit_batch(0, 0, 0, n_units), cfg,
                               pas_policy=policy, gen_savedir=savedir,
                               instance_name=f"gpt_{policy}_{plan}x{runtime}")
    if v.use_zero:
        opt = nncompile.build_optimizer(pm, torch.optim.AdamW, lr=LR, weight_decay=WEIGHT_DECAY)
    else:       # a plain optimizer over pm.parameters() needs no extra call
        opt = torch.optim.AdamW(pm.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    losses = []
    for step in range(STEPS):
        total = torch.zeros(())
        for micro in range(v.accum):
            last = micro == v.accum - 1
            ctx = pm.no_sync() if v.no_sync and not last else contextlib.nullcontext()
            with ctx:
                loss = pm(**unit_batch(step, micro, unit, n_units)) / v.accum
                loss.backward()
            total += loss.detach()
        if v.use_async_reducer and v.bucket_mb < 0.001:
            reducer = pm._reducer
            assert reducer.overlapped >= len(reducer.buckets) // 2 and \
                len(reducer.buckets) > 4, \
                f"async reducer overlapped {reducer.overlapped} of {len(reducer.buckets)} buckets"
        if v.clip is not None:
            nncompile.clip_grad_norm_(pm, v.clip)
        opt.step()
        opt.zero_grad()
        dist.all_reduce(total)                  # each unit's loss counted `plan` times
        losses.append(float(total) / runtime)
    return pm, opt, losses


def check(policy: str, plan: int, runtime: int, v: Variant, savedir: str) -> str:
    what = f"{policy} {plan}x{runtime} [{v.name}]"
    pm, opt, losses = train(policy, plan, runtime, v, savedir)
    ref_losses, ref_model, ref_opt, clipped = reference(v)
    if v.clip is not None:
        assert clipped >= STEPS // 2, f"{what}: clipping must bite (it did {clipped} times)"
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=RTOL,
                               atol=ATOL, msg=lambda m: f"{what} losses: {m}")
    # the merged weights and optimizer state equal the single-device ones, and load into it
    sds = [None] * dist.get_world_size()
    dist.all_gather_object(sds, (pm.state_dict(), opt.state_dict()))
    model_sd, opt_sd = nncompile.merge_state_dicts([s[0] for s in sds], [s[1] for s in sds])
    ref_sd = ref_model.state_dict()
    assert set(model_sd) == set(ref_sd), sorted(set(model_sd) ^ set(ref_sd))
    for k, want in ref_sd.items():
        atol = next((a for name, a in WEIGHT_ATOL.items() if k.endswith(name)),
                    WEIGHT_ATOL_DEFAULT)
        torch.testing.assert_close(model_sd[k], want, rtol=RTOL, atol=atol,
                                   msg=lambda m: f"{what} merged weight {k}: {m}")
    ref_state = ref_opt.state_dict()["state"]
    assert set(opt_sd["state"]) == set(ref_state), (sorted(opt_sd["state"]), sorted(ref_state))
    for i, st in ref_state.items():
        for key, want in st.items():
            atol = STATE_ATOL * float(want.abs().max()) + 1e-8 if want.dim() else 0.0
            torch.testing.assert_close(opt_sd["state"][i][key], want, rtol=RTOL, atol=atol,
                                       msg=lambda m: f"{what} merged optimizer {i}.{key}: {m}")
    fresh = models.build("gpt", seed=1)
    fresh.load_state_dict(model_sd)
    torch.optim.AdamW(fresh.parameters(), lr=LR).load_state_dict(opt_sd)
    return f"ok train {what}: final loss {losses[-1]:.5f}"


def check_fp32_reduce(savedir: str) -> str:
    """bf16 parameters with reduce_in_fp32: the reduced gradient is the float32 mean of the
    ranks' bf16 gradients, rounded to bf16 once."""
    world = dist.get_world_size()
    model = models.build("mlp").to(torch.bfloat16)
    batch = {k: v.to(torch.bfloat16) if v.is_floating_point() else v
             for k, v in models.batch("mlp", dist.get_rank()).items()}
    cfg = nncompile.ComputeConfig(1, world, reduce_in_fp32=True)
    pm = nncompile.parallelize(model, batch, cfg, pas_policy="dp", gen_savedir=savedir,
                               instance_name="mlp_bf16")
    assert all(b.dtype == torch.float32 for b in pm._reducer.buckets)
    with pm.no_sync():
        pm(**batch).backward()
    local = {n: p.grad.clone() for n, p in pm.named_parameters()}
    pm.zero_grad()
    pm(**batch).backward()
    for n, p in pm.named_parameters():
        parts = [torch.empty_like(local[n]) for _ in range(world)]
        dist.all_gather(parts, local[n])
        want = (sum(t.float() for t in parts) / world).to(torch.bfloat16)
        assert p.grad.dtype == torch.bfloat16
        torch.testing.assert_close(p.grad, want, rtol=0, atol=0, msg=lambda m: f"{n}: {m}")
    return f"ok train fp32 reduction of bf16 grads on {world} ranks"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--savedir", default="./.nncompile/train")
    ap.add_argument("--variants", default=",".join(v.name for v in VARIANTS))
    args = ap.parse_args()
    nncompile.init_distributed("gloo", timeout_s=300)
    torch.manual_seed(0)
    wanted = args.variants.split(",")
    for policy, plan, runtime in PLANS[dist.get_world_size()]:
        for v in VARIANTS:
            if v.name in wanted:
                line = check(policy, plan, runtime, v, args.savedir)
                if dist.get_rank() == 0:
                    print(line, flush=True)
    line = check_fp32_reduce(args.savedir)
    if dist.get_rank() == 0:
        print(line, flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
