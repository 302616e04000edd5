"""Training parity worker (torchrun, gloo): 20 AdamW steps of the GPT under every runtime
variant equal single-device training on the same global batch, step by step, and the merged
final weights and optimizer state equal the single-device ones.

    torchrun --nproc_per_node=2 tests/workers/train.py --savedir DIR
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import models  # noqa: E402

import nncompile  # noqa: E402
from nncompile.rows import param_rows  # noqa: E402

# Tolerance. A correct parallel run computes single-device training's float32 sums in another
# order (gradient all-reduce and its buckets, k-split matmuls, ZeRO's shards), and 20 AdamW
# steps amplify that rounding far past float32's eps: AdamW divides each element's update by
# the RMS of that element's gradient, so where a gradient is near rounding level (it cancels;
# the attention key biases' exact gradient is zero since softmax ignores a per-row shift) the
# order of the sums moves the update by a fraction of lr, and later gradients follow the moved
# weights. After 20 steps weights differ by up to 2e-4 of their norm, exp_avg by 8e-4,
# exp_avg_sq by 2e-3 and the key biases by 100%; how much depends on the CPU's kernels. Fixed
# atols cannot follow that: they are either meaningless for exp_avg_sq (entries ~1e-8) or
# flaky for the weights (the old 1e-3 * max|exp_avg| failed by 13% on one machine).
#
# So the bound is measured per tensor, on the machine that runs the test: two more
# single-device runs on the same batches, changed only in the order of the sums (batch rows
# reversed; the batch in two halves with gradients accumulated), give
#     NOISE = the larger of their distances from the reference (L2 norm of the whole tensor),
# the size of the difference reordering alone makes after STEPS steps, and the parallel run
# must be within K_NOISE * NOISE + STEPS * eps * |reference| of the reference, for the loss
# curve, every weight and every optimizer state tensor. Over all plans and variants (3
# reorderings of the same sums; chaos amplifies them alike) the parallel distance measured at
# most 2.5 x NOISE (exactly 1 x for dp 1x2 [sync], which sums in the halves run's order), so
# K_NOISE = 8 leaves a 3x margin; the eps term is a floor for a tensor that both reorderings
# happen to leave bitwise equal.
# Real bugs land far outside (checked by injecting them): NOISE is below 2e-3 of each tensor's
# norm (except the key biases, whose values are rounding noise either way). Gradients not
# averaged over units (2x) fail by 1e5 x the bound: AdamW's update is scale-invariant, so the
# weights hardly move, but exp_avg is 100% off and exp_avg_sq 300% (the clip variants cannot
# see a uniform 2x at all: clipping rescales it away). No gradient reduction at all fails by
# 4e3 x or more, and one tensor's gradient 2% too large by 16 x or more.
K_NOISE = 8.0
EPS = torch.finfo(torch.float32).eps
ORDERS = ("rows reversed", "halves")     # the reorderings that measure NOISE
# checkpoint.py compares the losses of two parallel runs over <= 10 steps with these (its
# largest difference is 1% of the bound)
RTOL, ATOL = 1e-5, 1e-6
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
    offload: bool = False       # offload_optimizer
    offload_params: bool = False
    recompute: bool = False     # recompute every block
    plain_opt: bool = False     # torch.optim.AdamW(pm.parameters()) instead of build_optimizer


VARIANTS = [
    Variant("sync"),
    Variant("async+clip+small-buckets", use_async_reducer=True, clip=0.3, bucket_mb=0.0002),
    Variant("accum(no_sync)", accum=2),
    Variant("accum(reduce each)", accum=2, no_sync=False),
    Variant("accum(reduce each)+async", use_async_reducer=True, accum=2, no_sync=False),
    Variant("zero", use_zero=True),
    Variant("zero+async+accum+clip", use_zero=True, use_async_reducer=True, accum=2, clip=0.3),
]
# ZeRO stages 2 and 3, offload and recompute (--zero): on dp 1x4 and the hybrid tp 2x4
ZERO_VARIANTS = [
    Variant("zero1", use_zero=1),
    Variant("zero2+clip", use_zero=2, clip=0.3),
    Variant("zero3", use_zero=3),
    Variant("zero3+plain AdamW", use_zero=3, plain_opt=True),
    Variant("zero3+offload", use_zero=3, offload=True, offload_params=True),
    Variant("zero2+offload_optimizer", use_zero=2, offload=True),
    Variant("zero3+recompute+accum+clip", use_zero=3, recompute=True, accum=2, no_sync=False,
            clip=0.3),
]
ZERO_PLANS = {4: [("dp", 1, 4), ("tp", 2, 4)], 2: [("dp", 1, 2)]}


def global_batch(step: int, micro: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5000 + 100 * step + micro)
    return {"idx": torch.randint(0, 64, (GLOBAL_BATCH, SEQ), generator=g),
            "targets": torch.randint(0, 64, (GLOBAL_BATCH, SEQ), generator=g)}


def rows(batch: dict[str, torch.Tensor], part: int, parts: int) -> dict[str, torch.Tensor]:
    n = GLOBAL_BATCH // parts
    return {k: v[part * n:(part + 1) * n] for k, v in batch.items()}


def unit_batch(step: int, micro: int, unit: int, n_units: int) -> dict[str, torch.Tensor]:
    return rows(global_batch(step, micro), unit, n_units)


def reference(v: Variant, order: str = "as is"):
    """Single-device training on the global batches: losses, final state dicts of the model and
    the optimizer, how often clipping bit. `order` changes only the order of the sums: 'rows
    reversed' flips each batch, 'halves' accumulates the gradients of its two halves."""
    model = models.build("gpt")
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    parts = 2 if order == "halves" else 1
    losses, clipped = [], 0
    for step in range(STEPS):
        total = 0.0
        for micro in range(v.accum):
            batch = global_batch(step, micro)
            if order == "rows reversed":
                batch = {k: t.flip(0) for k, t in batch.items()}
            for part in range(parts):
                loss = model(**rows(batch, part, parts)) / (v.accum * parts)
                loss.backward()
                total += loss.item()
        if v.clip is not None:
            clipped += float(torch.nn.utils.clip_grad_norm_(model.parameters(), v.clip)) > v.clip
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return torch.tensor(losses), model.state_dict(), opt.state_dict(), clipped


def references(v: Variant) -> list:
    return _references(Variant("ref", accum=v.accum, clip=v.clip))


@functools.cache
def _references(v: Variant) -> list:
    """reference(v, order) for "as is" and each of ORDERS, each run on one rank and shared."""
    orders = ("as is",) + ORDERS
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = {i: reference(v, o) for i, o in enumerate(orders) if i % world == rank}
    parts = [None] * world
    dist.all_gather_object(parts, mine)
    done = {i: r for part in parts for i, r in part.items()}
    return [done[i] for i in range(len(orders))]


def assert_near(what: str, got: torch.Tensor, want: torch.Tensor,
                reordered: list[torch.Tensor]) -> None:
    """got is within K_NOISE times the distance that reordering the sums puts between
    single-device runs (`reordered` against `want`), plus a rounding floor (see K_NOISE)."""
    assert got.shape == want.shape and got.dtype == want.dtype, \
        f"{what}: {got.dtype}{list(got.shape)} != {want.dtype}{list(want.shape)}"

    def norm(t: torch.Tensor) -> float:
        return float(torch.linalg.vector_norm(t.double()))
    noise = max(norm(r - want) for r in reordered)
    err, bound = norm(got - want), K_NOISE * noise + STEPS * EPS * norm(want)
    assert err <= bound, (
        f"{what}: parallel and single-device runs differ by {err:.3g} (L2; |reference| "
        f"{norm(want):.3g}), more than {K_NOISE:g} x the {noise:.3g} that reordering the sums "
        f"on one device makes (bound {bound:.3g})")


def train(policy: str, plan: int, runtime: int, v: Variant, savedir: str):
    n_units = runtime // plan
    unit = dist.get_rank() // plan
    cfg = nncompile.ComputeConfig(plan, runtime, use_async_reducer=v.use_async_reducer,
                                  reducer_bucket_cap_mb=v.bucket_mb, use_zero=v.use_zero,
                                  offload_optimizer=v.offload, offload_params=v.offload_params,
                                  parallel={"recompute_modules": ["Block"]} if v.recompute
                                  else {})
    name = f"gpt_{policy}_{plan}x{runtime}" + (f"_z{int(v.use_zero)}" if v.use_zero else "") + \
        ("_off" if v.offload_params else "") + ("_rc" if v.recompute else "")
    pm = nncompile.parallelize(models.build("gpt"), unit_batch(0, 0, 0, n_units), cfg,
                               pas_policy=policy, gen_savedir=savedir, instance_name=name)
    if v.use_zero == 3 or v.offload_params:
        assert pm.zero is not None and all(p.dim() == 1 for p in pm.stored_parameters()) \
            and not any(n.startswith("zero_") for n, _ in pm.named_parameters()), \
            "ZeRO-3 stores flat pieces and shows the local parameters"
    if v.use_zero and not v.plain_opt or v.offload:
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
        reducer = pm._reducer      # None when no gradient needs reducing (tp over all ranks)
        if v.use_async_reducer and v.bucket_mb < 0.001 and reducer is not None:
            assert reducer.overlapped >= len(reducer.buckets) // 2 and \
                len(reducer.buckets) > 4, \
                f"async reducer overlapped {reducer.overlapped} of {len(reducer.buckets)} buckets"
        if v.clip is not None:
            nncompile.clip_grad_norm_(pm, v.clip)
        grad_bytes = sum(_nbytes(g) for g in _grads(pm, opt))
        opt.step()
        if step == STEPS - 1:
            pm.persistent = persistent_bytes(pm, opt, grad_bytes)
        opt.zero_grad()
        dist.all_reduce(total)                  # each unit's loss counted `plan` times
        losses.append(float(total) / runtime)
    return pm, opt, losses


def _nbytes(t) -> int:
    """Bytes this rank holds for `t` (a DTensor: its local tensor's)."""
    if isinstance(t, DTensor):
        t = t.to_local()
    return t.numel() * t.element_size() if torch.is_tensor(t) else 0


def _grads(pm, opt) -> list:
    """The gradients a rank holds between backward and the step (ZeRO-2: its pieces)."""
    out = [p.grad for p in pm.stored_parameters() if p.grad is not None]
    return out + [s.grad for s in getattr(opt, "shards", []) if s.grad is not None]


def persistent_bytes(pm, opt, grad_bytes: int) -> dict[str, int]:
    """Device bytes of parameters, gradients and optimizer state on this rank, counted from
    the tensors (optimizer state: its state tensors and the flat pieces it steps when they are
    copies); offloaded (host) bytes apart."""
    host = torch.device("cpu") if pm.memory.offload_optimizer else None
    params = sum(_nbytes(p) for p in pm.stored_parameters())
    state = [t for st in opt.state.values() for t in st.values() if torch.is_tensor(t)]
    state += [s.param for s in getattr(opt, "shards", []) if s.param is not s.flat]
    offloaded = sum(_nbytes(t) for t in state) if host is not None else 0
    if pm.memory.offload_params:
        offloaded += params + grad_bytes
        params = grad_bytes = 0
    optimizer = 0 if host is not None else sum(_nbytes(t) for t in state)
    return {"params": params, "grads": grad_bytes, "optimizer": optimizer,
            "total": params + grad_bytes + optimizer, "host": offloaded}


def single_device_bytes() -> int:
    """Parameters + gradients + AdamW state of the model on one device."""
    model = models.build("gpt")
    numel = sum(p.numel() * p.element_size() for p in model.parameters())
    return 4 * numel + 4 * len(list(model.parameters()))        # + AdamW's step counters


def check(policy: str, plan: int, runtime: int, v: Variant, savedir: str) -> str:
    what = f"{policy} {plan}x{runtime} [{v.name}]"
    pm, opt, losses = train(policy, plan, runtime, v, savedir)
    (ref_losses, ref_sd, ref_opt_sd, clipped), *others = references(v)
    if v.clip is not None:
        assert clipped >= STEPS // 2, f"{what}: clipping must bite (it did {clipped} times)"
    assert_near(f"{what} losses", torch.tensor(losses), ref_losses, [o[0] for o in others])
    # the merged weights and optimizer state equal the single-device ones, and load into it
    sds = [None] * dist.get_world_size()
    dist.all_gather_object(sds, (pm.local_state_dict(), opt.state_dict()))
    model_sd, opt_sd = nncompile.merge_state_dicts([s[0] for s in sds], [s[1] for s in sds])
    assert set(model_sd) == set(ref_sd), sorted(set(model_sd) ^ set(ref_sd))
    for k, want in ref_sd.items():
        assert_near(f"{what} merged weight {k}", model_sd[k], want, [o[1][k] for o in others])
    ref_state = ref_opt_sd["state"]
    assert set(opt_sd["state"]) == set(ref_state), (sorted(opt_sd["state"]), sorted(ref_state))
    for i, st in ref_state.items():
        for key, want in st.items():
            got = opt_sd["state"][i][key]
            if want.dim() == 0:     # the step count
                assert torch.equal(got, want), f"{what} merged optimizer {i}.{key}: {got}"
                continue
            assert_near(f"{what} merged optimizer {i}.{key}", got, want,
                        [o[2]["state"][i][key] for o in others])
    fresh = models.build("gpt", seed=1)
    fresh.load_state_dict(model_sd)
    torch.optim.AdamW(fresh.parameters(), lr=LR).load_state_dict(opt_sd)
    line = f"ok train {what}: final loss {losses[-1]:.5f}"
    if args_zero[0]:
        mine = pm.persistent
        totals = [None] * dist.get_world_size()
        dist.all_gather_object(totals, mine["total"])
        ratio = max(totals) / single_device_bytes()
        line += (f"; persistent bytes per rank {max(totals)} (params {mine['params']}, grads "
                 f"{mine['grads']}, optimizer {mine['optimizer']}, host {mine['host']}) = "
                 f"{ratio:.3f} of one device")
        if v.use_zero == 3 and policy == "dp" and runtime == 4 and not v.offload_params:
            assert ratio <= 0.27, f"{what}: ZeRO-3 at dp 4 keeps {ratio:.3f} of one device"
        if v.offload_params:
            assert mine["total"] == 0 and mine["host"] > 0, mine
    return line


args_zero = [False]


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


def check_against_ddp(savedir: str) -> str:
    """The reducer's gradients equal DistributedDataParallel's after every backward of a
    sequence that exercises its triggers (dp over all ranks, MLP, sync and async reducer with
    several buckets): plain steps, accumulation without and with no_sync, a forward with no
    backward, and torch.autograd.grad for the input only (which reduces nothing)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    batches = [models.batch("mlp", 10 * rank + i) for i in range(4)]
    ddp = torch.nn.parallel.DistributedDataParallel(models.build("mlp"), bucket_cap_mb=0.001)
    for async_ in (False, True):
        cfg = nncompile.ComputeConfig(1, world, use_async_reducer=async_,
                                      reducer_bucket_cap_mb=0.002)
        pm = nncompile.parallelize(models.build("mlp"), batches[0], cfg, pas_policy="dp",
                                   gen_savedir=savedir, instance_name="mlp_vs_ddp")
        what = "async" if async_ else "sync"
        assert len(pm._reducer.buckets) > 2, what
        names = [n for n, _ in models.build("mlp").named_parameters()]
        local = {row.fqn: row.name for row in param_rows(pm)}

        def compare(step: str) -> None:
            for n, p in zip(names, ddp.module.parameters()):
                got = getattr(pm, local[n]).grad
                torch.testing.assert_close(got, p.grad, msg=lambda m: f"{what} {step} {n}: {m}")

        def both(batch, sync: bool = True) -> None:
            for m in (pm, ddp):
                with (contextlib.nullcontext() if sync else m.no_sync()):
                    m(**batch).backward()

        both(batches[0])
        compare("step")
        assert pm._reducer.overlapped == (len(pm._reducer.buckets) if async_ else 0), what
        both(batches[1])                        # accumulate, reducing each backward
        compare("accumulated without no_sync")
        for m in (pm, ddp):
            m.zero_grad(set_to_none=True)
        both(batches[2], sync=False)            # accumulate locally, reduce with the last
        both(batches[3])
        compare("accumulated with no_sync")
        for m in (pm, ddp):
            m.zero_grad(set_to_none=True)
        pm(**batches[1])                        # a forward without backward changes nothing
        x = batches[0]["x"].clone().requires_grad_()
        torch.autograd.grad(pm(x, batches[0]["y"]), x)          # reduces nothing
        assert all(p.grad is None for p in pm.parameters()), what
        both(batches[2])
        compare("after a forward alone and autograd.grad")
        ddp.zero_grad(set_to_none=True)
    return f"ok train reducer equals DDP (sync, async) on {world} ranks"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--savedir", default="./.nncompile/train")
    ap.add_argument("--variants", default=None)
    ap.add_argument("--zero", action="store_true", help="the ZeRO-2/3, offload variants")
    args = ap.parse_args()
    nncompile.init_distributed("gloo", timeout_s=300)
    torch.manual_seed(0)
    variants = ZERO_VARIANTS if args.zero else VARIANTS
    args_zero[0] = args.zero
    wanted = args.variants.split(",") if args.variants else [v.name for v in variants]
    plans = (ZERO_PLANS if args.zero else PLANS)[dist.get_world_size()]
    for policy, plan, runtime in plans:
        for v in variants:
            if v.name in wanted:
                line = check(policy, plan, runtime, v, args.savedir)
                if dist.get_rank() == 0:
                    print(line, flush=True)
    if args.zero:
        dist.barrier()
        dist.destroy_process_group()
        return
    for line in (check_fp32_reduce(args.savedir), check_against_ddp(args.savedir)):
        if dist.get_rank() == 0:
            print(line, flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
