"""Pipelined plans' state on 4 gloo ranks: gather_params / gather_grads, clip_grad_norm_ and
every checkpoint format under pp 2 x tp 2, and DCP resharding between pipelined and other plans.
A single-device GPT(n_layer=4) trained on the same micro-batches is the reference throughout.

    pp 2 x tp 2 (AdamW)   steps 0-1 with clipping (2-norm, inf-norm): losses, gathered grads
                          before and after clipping, gathered params equal the reference's;
                          save sharded / deduped / dcp at step 2; each merged equals the
                          reference's model and optimizer state; steps 2-3 uninterrupted
    resume                each format (and the merged file) into the zeroed module with a new
                          optimizer: steps 2-3 equal the uninterrupted ones
    reshard               that dcp checkpoint under tp 4 and dp 4 (ZeRO-1): steps 2-3 equal;
                          tp 4's dcp checkpoint at step 3 back under pp 2 x tp 2: steps 3-4
    pp 2 x dp 2 (ZeRO-1)  loads the pp 2 x tp 2 dcp checkpoint; its sharded / deduped / dcp
                          checkpoints at step 3 resume equal and merge to the reference's state

    torchrun --nproc_per_node=4 tests/workers/pipeline_checkpoint.py --dir DIR
"""
from __future__ import annotations

import argparse
import copy
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "..", "examples"))
import models  # noqa: E402
from gpt import GPT  # noqa: E402

import nncompile  # noqa: E402

M, BATCH, LR = 4, 8, 1e-2
RTOL, ATOL = 1e-5, 1e-6
# AdamW moves an element by ~LR * g / (|g| + eps): where |g| is near eps, summation-order noise
# in g moves it by up to ~1e-5 here; a wrong shard, stage or step is off by ~LR or more
PARAM_ATOL = 1e-4
FORMATS = ("sharded", "deduped", "dcp")
T0 = time.time()


def gpt() -> torch.nn.Module:
    torch.manual_seed(0)
    return GPT(n_layer=4).train()


def batch(step: int) -> dict[str, torch.Tensor]:
    return models.batch("gpt", step, batch_size=BATCH)


def say(msg: str) -> None:
    if dist.get_rank() == 0:
        print(f"{msg} [{time.time() - T0:.1f}s]", flush=True)


def close(got, want, what: str, rtol: float = RTOL, atol: float = ATOL) -> None:
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


class Reference:
    """The single-device model, accumulating (loss_m / M).backward() over the M micro-batches."""

    def __init__(self):
        self.model = gpt()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=LR)
        self.losses: dict[int, float] = {}
        self.saved: dict[int, tuple[dict, dict]] = {}

    def backward(self, step: int) -> float:
        total = 0.0
        for i in range(M):
            loss = self.model(**{k: v.chunk(M)[i] for k, v in batch(step).items()})
            (loss / M).backward()
            total += float(loss) / M
        self.losses[step] = total
        return total

    def grads(self) -> dict[str, torch.Tensor]:
        return {k: p.grad.clone() for k, p in self.model.named_parameters()}

    def step(self, step: int) -> None:
        self.opt.step()
        self.opt.zero_grad()
        self.saved[step + 1] = (copy.deepcopy(self.model.state_dict()),
                                copy.deepcopy(self.opt.state_dict()))

    def run(self, step: int) -> None:
        self.backward(step)
        self.step(step)


def build(d: Path, name: str, plan: int, pas: dict, zero: int = 0):
    """A 4-rank plan of the tp policy and its optimizer (build_optimizer: ZeRO under zero)."""
    units = 4 // plan
    dummy = {k: v.chunk(units)[0] for k, v in batch(0).items()}
    pm = nncompile.parallelize(gpt(), dummy, nncompile.ComputeConfig(plan, 4, parallel=pas,
                                                                     use_zero=zero),
                               pas_policy="tp", gen_savedir=d / "gen", instance_name=name)
    return pm, optimizer(pm)


def optimizer(pm):
    return nncompile.build_optimizer(pm, torch.optim.AdamW, lr=LR)


def train(pm, opt, step: int) -> float:
    """One step on this rank's unit's rows of the global batch; the mean loss over units."""
    units = 4 // (pm.PLAN_NGPUS * pm.PIPE_RANKS)
    unit = dist.get_rank() // (pm.PLAN_NGPUS * pm.PIPE_RANKS)
    loss = pm.train_step(**{k: v.chunk(units)[unit] for k, v in batch(step).items()})
    opt.step()
    opt.zero_grad()
    total = loss.detach().float().clone()
    dist.all_reduce(total)
    return float(total) / 4


def run(pm, opt, start: int, stop: int) -> list[float]:
    return [train(pm, opt, i) for i in range(start, stop)]


def same(got: list[float], want: list[float], what: str) -> None:
    close(torch.tensor(got), torch.tensor(want), what)
    say(f"ok {what}: {len(got)} losses equal, last {got[-1]:.6f}")


def wipe(pm) -> None:
    """Zero every parameter, so a load that misses one shows in the losses."""
    with torch.no_grad():
        for p in pm.parameters():
            p.zero_()


def check_merged(path: Path, ref: Reference, step: int, what: str) -> dict:
    """A merged file equals the reference's model and optimizer state after `step` steps, and
    the original module loads it."""
    merged = torch.load(path, weights_only=True)
    model_sd, opt_sd = ref.saved[step]
    assert set(merged["model"]) == set(model_sd), sorted(set(merged["model"]) ^ set(model_sd))
    for k, v in model_sd.items():
        close(merged["model"][k], v, f"{what} merged {k}", atol=PARAM_ATOL)
    assert set(merged["optimizer"]["state"]) == set(opt_sd["state"])
    for i, st in opt_sd["state"].items():
        for key, v in st.items():          # exp_avg_sq as its root: on the scale of grads
            got = merged["optimizer"]["state"][i][key]
            if key == "exp_avg_sq":
                got, v = got.sqrt(), v.sqrt()
            close(got, v, f"{what} merged optimizer {i}.{key}", rtol=1e-4, atol=1e-7)
    module = GPT(n_layer=4)
    module.load_state_dict(merged["model"])           # strict: every key, the tied one too
    torch.optim.AdamW(module.parameters(), lr=LR).load_state_dict(merged["optimizer"])
    return merged


def merge_all(d: Path, prefix: str, ref: Reference, step: int) -> None:
    """Ranks 0-2 each merge one format of checkpoint `prefix` (in parallel): each equals the
    reference's state, and they agree bit for bit; rank 3 counts what the deduped one stores."""
    rank = dist.get_rank()
    if rank < len(FORMATS):
        fmt = FORMATS[rank]
        out = nncompile.merge_checkpoint([d / f"{prefix}_{fmt}"], d / f"{prefix}_{fmt}.pt")
        check_merged(out, ref, step, f"{prefix} {fmt}")
    else:
        blobs = [torch.load(d / f"{prefix}_deduped" / f"rank{r}.pt", weights_only=True)
                 for r in range(4)]
        stored = sum(v.numel() for b in blobs for v in b["model"].values() if torch.is_tensor(v))
        moments = sum(st["exp_avg"].numel() for b in blobs
                      for st in b["optimizer"]["state"].values())
        numel = sum(p.numel() for p in ref.model.parameters())      # the tied weight once
        assert stored == moments == numel, f"deduped stores {stored}, {moments} of {numel}"
    dist.barrier()
    if rank == 0:
        merged = [torch.load(d / f"{prefix}_{fmt}.pt", weights_only=True) for fmt in FORMATS]
        for fmt, other in zip(FORMATS[1:], merged[1:]):
            for k, v in merged[0]["model"].items():
                close(other["model"][k], v, f"{prefix} {fmt} vs sharded {k}", rtol=0, atol=0)
        say(f"ok merged {prefix}: sharded, deduped, dcp equal the reference at step {step}; "
            f"deduped stores each element once")


def phase_pp_tp(d: Path, ref: Reference) -> tuple:
    pas = {"pp": 2, "schedule": "1f1b", "microbatches": M}
    pm, opt = build(d, "gpt_pp2_tp2", 4, pas)
    assert (pm.PIPE_RANKS, pm.PLAN_NGPUS) == (2, 2)
    for step, (max_norm, norm_type) in enumerate(((1.0, 2.0), (0.05, math.inf))):
        loss = pm.train_step(**batch(step))
        ref_loss = ref.backward(step)
        close(float(loss), ref_loss, f"loss {step}")
        grads = pm.gather_grads()
        ref_grads = ref.grads()
        assert set(grads) == set(ref_grads) - {"lm_head.weight"}, sorted(grads)
        for k, g in grads.items():
            close(g, ref_grads[k], f"step {step} gathered grad {k}")
        norm = nncompile.clip_grad_norm_(pm, max_norm, norm_type)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.model.parameters(), max_norm, norm_type)
        close(norm, ref_norm, f"step {step} norm_type {norm_type} norm")
        assert float(ref_norm) > max_norm, "the test must actually clip"
        for k, g in pm.gather_grads().items():
            close(g, ref.grads()[k], f"step {step} clipped grad {k}")
        say(f"ok clip pp 2 x tp 2 norm_type {norm_type}: {float(norm):.6f}")
        opt.step()
        opt.zero_grad()
        ref.step(step)
    params = pm.gather_params()
    for k, p in ref.model.named_parameters():
        close(params[k], p.detach(), f"gathered param {k}", atol=PARAM_ATOL)
    say(f"ok gather_params pp 2 x tp 2: {len(params)} parameters equal the reference")
    for fmt in FORMATS:
        nncompile.save_checkpoint(d / f"pp_{fmt}", pm, opt, format=fmt, extra={"step": 2})
    merge_all(d, "pp", ref, 2)
    want = run(pm, opt, 2, 4)
    ref.run(2)
    ref.run(3)
    same(want, [ref.losses[2], ref.losses[3]], "pp 2 x tp 2 steps 2-3 vs single device")
    for src in (*FORMATS, "merged"):
        wipe(pm)
        opt = optimizer(pm)
        path = d / "pp_sharded.pt" if src == "merged" else d / f"pp_{src}"
        extra = nncompile.load_checkpoint(path, pm, opt)
        assert src == "merged" or extra == {"step": 2}, extra
        same(run(pm, opt, 2, 4), want, f"resume {src} pp 2 x tp 2")
    return pm, want


def phase_reshard(d: Path, ref: Reference, pp, want: list[float]) -> None:
    tp, opt = build(d, "gpt_tp4", 4, {"microbatches": M})
    try:
        nncompile.load_checkpoint(d / "pp_sharded", tp, opt)
    except nncompile.CheckpointError as e:
        assert "2 pipeline ranks" in str(e) and "format='dcp'" in str(e), str(e)
    else:
        raise AssertionError("a pipelined sharded checkpoint loaded under tp 4")
    nncompile.load_checkpoint(d / "pp_dcp", tp, opt)
    got = [train(tp, opt, 2)]
    nncompile.save_checkpoint(d / "tp_dcp", tp, opt, format="dcp", extra={"step": 3})
    got.append(train(tp, opt, 3))
    same(got, want, "dcp pp 2 x tp 2 -> tp 4")
    dp, opt = build(d, "gpt_dp4", 1, {}, zero=1)
    nncompile.load_checkpoint(d / "pp_dcp", dp, opt)
    same(run(dp, opt, 2, 4), want, "dcp pp 2 x tp 2 -> dp 4 zero1")
    ref.run(4)
    wipe(pp)
    opt = optimizer(pp)
    assert nncompile.load_checkpoint(d / "tp_dcp", pp, opt) == {"step": 3}
    same(run(pp, opt, 3, 5), [want[1], ref.losses[4]], "dcp tp 4 -> pp 2 x tp 2")


def phase_pp_dp(d: Path, ref: Reference) -> None:
    pas = {"pp": 2, "schedule": "1f1b", "microbatches": M // 2}
    pm, opt = build(d, "gpt_pp2_dp2", 2, pas, zero=1)
    assert (pm.PIPE_RANKS, pm.PLAN_NGPUS, type(opt).__name__) == (2, 1, "ZeroOptimizer")
    nncompile.load_checkpoint(d / "pp_dcp", pm, opt)
    got = [train(pm, opt, 2)]
    for fmt in FORMATS:
        nncompile.save_checkpoint(d / f"ppdp_{fmt}", pm, opt, format=fmt, extra={"step": 3})
    got += run(pm, opt, 3, 5)
    same(got, [ref.losses[i] for i in (2, 3, 4)], "dcp pp 2 x tp 2 -> pp 2 x dp 2 zero1")
    merge_all(d, "ppdp", ref, 3)
    for fmt in FORMATS:
        wipe(pm)
        opt = optimizer(pm)
        assert nncompile.load_checkpoint(d / f"ppdp_{fmt}", pm, opt) == {"step": 3}
        same(run(pm, opt, 3, 5), got[1:], f"resume {fmt} pp 2 x dp 2 zero1")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    args = ap.parse_args()
    nncompile.init_distributed("gloo")
    d = Path(args.dir)
    ref = Reference()
    pp, want = phase_pp_tp(d, ref)
    phase_reshard(d, ref, pp, want)
    phase_pp_dp(d, ref)
    if dist.get_rank() == 0:
        sds = [torch.load(d / "pp_sharded" / f"rank{r}.pt", weights_only=True)["model"]
               for r in (0, 1)]
        try:
            nncompile.merge_state_dicts(sds)
        except nncompile.CheckpointError as e:
            assert "pipeline ranks [1] are missing" in str(e), str(e)
        else:
            raise AssertionError("one stage's files merged")
        print("ok merge refuses one stage's files", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
