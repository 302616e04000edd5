"""Checkpoint worker (gloo): resume, plan change and crash recovery give the same losses as
uninterrupted training. Phases (each a fresh set of processes):

    save      tp plan 2 on 2 ranks: 10 steps, save sharded / deduped / dcp, 10 more steps;
              write the 20 uninterrupted losses
    resume    new processes load each format (and a merged file, and the sharded one under
              another plan, which must fail clearly) and train steps 10..19
    reshard   4 ranks: load the 2-rank dcp checkpoint under `data` plan 2 and `dp` plan 1 with
              ZeRO, and `tp` plan 2; then a ZeRO sharded/deduped round trip
    zero3     4 ranks, ZeRO-3 tp 2x4: load that dcp checkpoint, save and resume every format,
              and load ZeRO-3's merged / dcp checkpoints under ZeRO-1/2 dp 1x4
    crash     like save, a checkpoint every 3 steps; rank 1 is SIGKILLed when saving step 9
              (or, with --hang, stops responding in the middle of training: SIGSTOP)
    recover   load the last complete checkpoint after the crash and train to step 12

    torchrun --nproc_per_node=2 tests/workers/checkpoint.py --phase save --dir DIR
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
import models  # noqa: E402
from train import LR, RTOL, ATOL, STEPS, WEIGHT_DECAY, unit_batch  # noqa: E402

import nncompile  # noqa: E402

FORMATS = ("sharded", "deduped", "dcp")


def build(policy: str, plan: int, savedir: str, use_zero: bool = False):
    runtime = dist.get_world_size()
    cfg = nncompile.ComputeConfig(plan, runtime, use_zero=use_zero)
    name = f"gpt_{policy}_{plan}x{runtime}" + ("_z3" if use_zero == 3 else "")
    pm = nncompile.parallelize(models.build("gpt"), unit_batch(0, 0, 0, runtime // plan), cfg,
                               pas_policy=policy, gen_savedir=savedir, instance_name=name)
    return pm, nncompile.build_optimizer(pm, torch.optim.AdamW, lr=LR, weight_decay=WEIGHT_DECAY)


def step(pm, opt, i: int) -> float:
    n_units = pm.RUNTIME_NGPUS // pm.PLAN_NGPUS
    loss = pm(**unit_batch(i, 0, pm.RANK // pm.PLAN_NGPUS, n_units))
    loss.backward()
    opt.step()
    opt.zero_grad()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return float(total) / pm.RUNTIME_NGPUS


def run(pm, opt, start: int, stop: int, on_step=None) -> list[float]:
    losses = []
    for i in range(start, stop):
        losses.append(step(pm, opt, i))
        if on_step:
            on_step(i + 1)
    return losses


def same(got: list[float], want: list[float], what: str) -> None:
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=RTOL, atol=ATOL,
                               msg=lambda m: f"{what}: {m}")
    if dist.get_rank() == 0:
        print(f"ok {what}: {len(got)} losses equal, last {got[-1]:.5f}", flush=True)


def phase_save(d: Path, savedir: str) -> None:
    pm, opt = build("tp", 2, savedir)

    def save(i):
        if i == STEPS // 2:
            for fmt in FORMATS:
                nncompile.save_checkpoint(d / fmt, pm, opt, format=fmt, extra={"step": i})
    losses = run(pm, opt, 0, STEPS, save)
    if dist.get_rank() == 0:
        (d / "losses.json").write_text(json.dumps(losses))
        nncompile.merge_checkpoint([d / "sharded"], d / "merged.pt")


def phase_resume(d: Path, savedir: str) -> None:
    want = json.loads((d / "losses.json").read_text())[STEPS // 2:]
    for fmt in FORMATS:
        pm, opt = build("tp", 2, savedir)
        extra = nncompile.load_checkpoint(d / fmt, pm, opt)
        assert extra == {"step": STEPS // 2}, extra
        same(run(pm, opt, extra["step"], STEPS), want, f"resume {fmt} tp 2x2")
    pm, opt = build("dp", 1, savedir)
    try:
        nncompile.load_checkpoint(d / "sharded", pm, opt)
    except nncompile.CheckpointError as e:
        msg = str(e)
        assert "policy 'tp', plan_ngpus 2" in msg and "policy 'dp', plan_ngpus 1" in msg, msg
        assert "format='dcp'" in msg and "nncompile merge" in msg, msg
    else:
        raise AssertionError("a sharded checkpoint loaded under another plan")
    nncompile.load_checkpoint(d / "merged.pt", pm, opt)
    same(run(pm, opt, STEPS // 2, STEPS), want, "merged file tp 2x2 -> dp 1x2")


def phase_reshard(d: Path, savedir: str) -> None:
    want = json.loads((d / "losses.json").read_text())[STEPS // 2:]
    for policy, plan, zero in (("data", 2, True), ("dp", 1, True), ("tp", 2, False)):
        pm, opt = build(policy, plan, savedir, use_zero=zero)
        nncompile.load_checkpoint(d / "dcp", pm, opt)
        what = f"dcp tp 2x2 -> {policy} {plan}x4{' zero' if zero else ''}"
        same(run(pm, opt, STEPS // 2, STEPS // 2 + 1), want[:1], f"{what} (next step)")
        same(run(pm, opt, STEPS // 2 + 1, STEPS), want[1:], f"{what} (9 more)")
    # ZeRO state through the per-rank formats, into fresh objects
    pm, opt = build("dp", 1, savedir, use_zero=True)
    nncompile.load_checkpoint(d / "dcp", pm, opt)
    run(pm, opt, STEPS // 2, STEPS // 2 + 3)
    for fmt in ("sharded", "deduped"):
        nncompile.save_checkpoint(d / f"zero_{fmt}", pm, opt, format=fmt)
    rest = run(pm, opt, STEPS // 2 + 3, STEPS)
    for fmt in ("sharded", "deduped"):
        pm2, opt2 = build("dp", 1, savedir, use_zero=True)
        nncompile.load_checkpoint(d / f"zero_{fmt}", pm2, opt2)
        same(run(pm2, opt2, STEPS // 2 + 3, STEPS), rest, f"zero {fmt} round trip dp 1x4")
    same(rest, want[3:], "zero dp 1x4 vs uninterrupted")


def phase_zero3(d: Path, savedir: str) -> None:
    """4 ranks, ZeRO-3 on the hybrid tp 2x4: load the 2-rank dcp checkpoint, save every format
    under ZeRO-3, resume each (and the merged file, and the dcp one under ZeRO-1/2 dp 1x4)."""
    want = json.loads((d / "losses.json").read_text())[STEPS // 2:]
    pm, opt = build("tp", 2, savedir, use_zero=3)
    nncompile.load_checkpoint(d / "dcp", pm, opt)
    same(run(pm, opt, STEPS // 2, STEPS // 2 + 3), want[:3], "dcp tp 2x2 -> tp 2x4 zero3")
    for fmt in FORMATS:
        nncompile.save_checkpoint(d / f"z3_{fmt}", pm, opt, format=fmt, extra={"step": 13})
    rest = run(pm, opt, STEPS // 2 + 3, STEPS)
    same(rest, want[3:], "zero3 tp 2x4 vs uninterrupted")
    for fmt in FORMATS:
        pm2, opt2 = build("tp", 2, savedir, use_zero=3)
        assert nncompile.load_checkpoint(d / f"z3_{fmt}", pm2, opt2) == {"step": 13}
        same(run(pm2, opt2, 13, STEPS), rest, f"zero3 {fmt} resume tp 2x4")
    if dist.get_rank() == 0:
        nncompile.merge_checkpoint([d / "z3_sharded"], d / "z3_merged.pt")
    dist.barrier()
    for src, zero in (("z3_merged.pt", 1), ("z3_dcp", 1), ("z3_dcp", 2)):
        pm2, opt2 = build("dp", 1, savedir, use_zero=zero)
        nncompile.load_checkpoint(d / src, pm2, opt2)
        same(run(pm2, opt2, 13, STEPS), rest, f"{src} (zero3 tp 2x4) -> dp 1x4 zero{zero}")


def phase_crash(d: Path, savedir: str, die_at: int, hang: bool = False) -> None:
    pm, opt = build("tp", 2, savedir)

    def maybe_save(i):
        if hang and i == die_at - 2 and dist.get_rank() == 1:
            print(f"rank 1: SIGSTOP after step {i}", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)
        if i == die_at and dist.get_rank() == 1:
            print(f"rank 1: SIGKILL at step {i}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if i % 3 == 0:
            nncompile.save_checkpoint(d / f"step{i}", pm, opt, format="sharded",
                                      extra={"step": i})
            print(f"rank {dist.get_rank()}: saved step {i}", flush=True)
    run(pm, opt, 0, STEPS, maybe_save)


def phase_recover(d: Path, savedir: str, die_at: int) -> None:
    want = json.loads((d / "losses.json").read_text())
    try:
        nncompile.load_checkpoint(d / f"step{die_at}", *build("tp", 2, savedir))
    except nncompile.CheckpointError as e:      # the survivor stopped at the save's start
        assert "not a complete nncompile checkpoint" in str(e) or "does not exist" in str(e), e
    else:
        raise AssertionError(f"the interrupted step{die_at} checkpoint loaded")
    last = max(i for i in range(3, die_at, 3) if (d / f"step{i}" / "checkpoint.json").exists())
    pm, opt = build("tp", 2, savedir)
    extra = nncompile.load_checkpoint(d / f"step{last}", pm, opt)
    assert extra["step"] == last == die_at - 3, (extra, last)
    same(run(pm, opt, last, die_at + 3), want[last:die_at + 3],
         f"recover from step {last} after the crash")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--phase", required=True,
                    choices=["save", "resume", "reshard", "zero3", "crash", "recover"])
    ap.add_argument("--dir", required=True)
    ap.add_argument("--savedir", default=None)
    ap.add_argument("--die-at", type=int, default=9)
    ap.add_argument("--hang", action="store_true")
    args = ap.parse_args()
    nncompile.init_distributed("gloo")         # timeout: $NNCOMPILE_TIMEOUT_S
    d = Path(args.dir)
    savedir = args.savedir or str(d / "gen")
    phase = args.phase
    if phase == "crash":
        phase_crash(d, savedir, args.die_at, args.hang)
    elif phase == "recover":
        phase_recover(d, savedir, args.die_at)
    else:
        globals()[f"phase_{phase}"](d, savedir)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
