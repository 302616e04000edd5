"""Lightning: NnCompileStrategy + NnCompilePrecision against Lightning's own training on the
nanoGPT example (CPU config, --deterministic): per-step losses, resume, merge, ZeRO stages and
offload, bad input and the loss-curve PNG. Each run is a fresh `train.py` process (torchrun
for 2 ranks)."""
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, torchrun

EXAMPLE = "examples/nanogpt/train.py"
STEPS = 30
RTOL = 1e-5
# bf16-mixed: bfloat16 keeps 8 significant bits (relative rounding up to 2**-8); the two runs
# round partial sums in different orders, measured up to 3.4e-4 apart in 30 steps
RTOL_BF16 = 2e-3


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    out = tmp_path_factory.mktemp("shakespeare")
    subprocess.run([sys.executable, "examples/nanogpt/prepare.py", "--out", str(out)],
                   cwd=ROOT, check=True, capture_output=True)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return tmp_path_factory.mktemp("runs")


def train(data, runs, name, nproc=1, *args):
    log = runs / f"{name}.jsonl"
    if log.exists():
        log.unlink()
    argv = ["--data_dir", str(data), "--out_dir", str(runs / name), "--max_iters", str(STEPS),
            "--deterministic", "true", "--eval_interval", "15", "--loss_log", str(log), *args]
    if nproc == 1:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "NNCOMPILE_QUIET": "1"}
        proc = subprocess.run([sys.executable, EXAMPLE, *argv], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    else:
        torchrun(EXAMPLE, nproc, *argv)
    return [json.loads(line) for line in log.read_text().splitlines()]


def losses(records, after_step=-1):
    return [(r["step"], "train_loss" in r, r.get("train_loss", r.get("val_loss")))
            for r in records if r["step"] > after_step]


def same(got, want, rtol=RTOL):
    assert len(got) == len(want) and got, (len(got), len(want))
    for (s1, t1, a), (s2, t2, b) in zip(got, want):
        assert (s1, t1) == (s2, t2)
        assert abs(a - b) <= rtol * abs(b), f"step {s1}: {a} vs {b}"


def test_one_rank_and_tensor_parallel_match_lightning(data, runs):
    plain = train(data, runs, "plain1")
    assert len(losses(plain)) == STEPS + 2                        # 30 train + 2 val
    same(losses(train(data, runs, "nnc1")), losses(plain))
    same(losses(logged(data, runs, "tp2", 2, *TP2)), losses(plain))


def test_data_parallel_with_accumulation_matches_ddp(data, runs):
    ddp = train(data, runs, "ddp2", 2, "--use_nncompile", "false", "--accumulate", "2")
    ours = train(data, runs, "dp2", 2, "--plan_ngpus", "1", "--accumulate", "2")
    assert len(losses(ddp)) == 2 * STEPS + 2                      # a record per micro-batch
    same(losses(ours), losses(ddp))


def test_bf16_mixed_with_accumulation_matches_lightning(data, runs):
    args = ("--precision", "bf16-mixed", "--accumulate", "2")
    plain = train(data, runs, "plain_bf16", 1, "--use_nncompile", "false", *args)
    ours = train(data, runs, "tp2_bf16", 2, "--plan_ngpus", "2", "--policy", "tp", *args)
    same(losses(ours), losses(plain), RTOL_BF16)


TP2 = ("--plan_ngpus", "2", "--policy", "tp")


def logged(data, runs, name, *args):
    """The records of a run, trained once per module."""
    if not (runs / f"{name}.jsonl").exists():
        return train(data, runs, name, *args)
    return [json.loads(x) for x in (runs / f"{name}.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def stopped(data, runs):
    """tp plan 2 stopped after 15 of 30 steps, with its step-15 checkpoint."""
    first = train(data, runs, "stop15", 2, *TP2, "--ckpt_interval", "15", "--max_iters", "15")
    assert max(r["step"] for r in first) == 15
    ckpt = runs / "stop15" / "ckpt" / "step=15.ckpt"
    assert (ckpt / "checkpoint.json").exists() and (ckpt / "rank1.pt").exists()
    return ckpt


def test_resume_continues_at_the_saved_step(data, runs, stopped):
    full = logged(data, runs, "tp2", 2, *TP2)
    resumed = train(data, runs, "stop15", 2, *TP2, "--ckpt_interval", "15",
                    "--init_from", "resume")
    assert min(r["step"] for r in resumed) == 16, "resume must continue at step 16, not 0"
    same(losses(resumed), losses(full, after_step=15))


def test_merged_checkpoint_loads_under_plan_1_and_plain_lightning(data, runs, stopped):
    merged = runs / "merged.ckpt"
    proc = subprocess.run([sys.executable, "-m", "nncompile", "merge", str(stopped), "-o",
                           str(merged)], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    want = losses(logged(data, runs, "tp2", 2, *TP2), after_step=15)
    for name, extra in (("merged_plan1", ()), ("merged_plain", ("--use_nncompile", "false"))):
        got = train(data, runs, name, 1, "--init_from", str(merged), "--max_iters", "16",
                    *extra)
        assert min(r["step"] for r in got) == 16
        same(losses(got)[:1], want[:1])


# ZeRO over the 2 data-parallel ranks of plan 1, against plain Lightning DDP on the same
# batches (the "ddp2" run: accumulate 2, so each record is one micro-batch). The runs go
# through tests/workers/lightning_zero.py, which also checks inside the run that the
# optimizer is a ZeroOptimizer of that stage, that the lr it steps with is the scheduler's at
# every step (the example's warmup changes it every step) and that clipping ran
# nncompile.clip_grad_norm_ once per step.
DP2 = ("--plan_ngpus", "1", "--policy", "dp", "--accumulate", "2")
ZSTOP, ZEND = 8, 12          # ZeRO-3 stops (with a checkpoint) at step 8; resumes to step 12


def train_zero(data, runs, name, stage, *args, offload=False):
    """A 2-rank run of the example through the ZeRO checking worker: (records, output)."""
    log = runs / f"{name}.jsonl"
    if log.exists():
        log.unlink()
    argv = ["--data_dir", str(data), "--out_dir", str(runs / name), "--max_iters", str(STEPS),
            "--deterministic", "true", "--eval_interval", "15", "--loss_log", str(log),
            "--use_zero", str(stage), *DP2, *args]
    out = torchrun("tests/workers/lightning_zero.py", 2, "--expect_zero", str(stage),
                   *(["--expect_offload"] if offload else []), "--", *argv)
    assert "ok zero optimizer" in out and "ok lr follows the scheduler" in out and \
        "ok clip" in out, out[-3000:]
    return [json.loads(line) for line in log.read_text().splitlines()], out


@pytest.fixture(scope="module")
def zero3_stopped(data, runs):
    """ZeRO-3 from scratch to step ZSTOP, with its checkpoint there."""
    first, out = train_zero(data, runs, "zero3", 3, "--max_iters", str(ZSTOP),
                            "--ckpt_interval", str(ZSTOP))
    assert "ok zero optimizer: stage 3" in out
    ckpt = runs / "zero3" / "ckpt" / f"step={ZSTOP}.ckpt"
    assert (ckpt / "checkpoint.json").exists() and (ckpt / "rank1.pt").exists()
    return first, ckpt


def test_zero3_matches_ddp_and_resumes(data, runs, zero3_stopped):
    """ZeRO-3 (flat parameter pieces, LR schedule, clipping, accumulation) equals DDP step by
    step, and resuming from its sharded checkpoint continues exactly like the uninterrupted
    DDP run."""
    ddp = losses(logged(data, runs, "ddp2", 2, "--use_nncompile", "false", "--accumulate", "2"))
    first, _ = zero3_stopped
    assert len(losses(first)) == 2 * ZSTOP
    resumed, out = train_zero(data, runs, "zero3", 3, "--ckpt_interval", "1000",
                              "--init_from", "resume", "--max_iters", str(ZEND))
    assert f"from step {ZSTOP}" in out, "resume must continue at the saved step"
    assert min(r["step"] for r in resumed) == ZSTOP
    got = losses(first) + losses(resumed)
    assert len(got) == 2 * ZEND
    same(got, ddp[:len(got)])


def test_zero3_checkpoint_merges_and_resumes_under_zero2_offload(data, runs, zero3_stopped):
    """The merged ZeRO-3 checkpoint (weights and AdamW state from the flat pieces) is an
    ordinary Lightning checkpoint: ZeRO-2 with the optimizer offloaded resumes from it and
    continues like DDP (the steps after the first depend on the merged AdamW moments)."""
    _, ckpt = zero3_stopped
    merged = runs / "zero3_merged.ckpt"
    proc = subprocess.run([sys.executable, "-m", "nncompile", "merge", str(ckpt), "-o",
                           str(merged)], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    ddp = losses(logged(data, runs, "ddp2", 2, "--use_nncompile", "false", "--accumulate", "2"))
    got, out = train_zero(data, runs, "zero2_offload", 2, "--offload_optimizer", "true",
                          "--init_from", str(merged), "--max_iters", str(ZEND), offload=True)
    assert "ok zero optimizer: stage 2, offload True" in out
    got = losses(got)
    assert got[0][0] == ZSTOP and len(got) == 2 * (ZEND - ZSTOP)
    same(got, ddp[2 * ZSTOP:2 * ZEND])


def test_bad_lightning_setups_get_clear_errors(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NNCOMPILE_QUIET": "1"}
    proc = subprocess.run([sys.executable, "tests/workers/lightning_errors.py", "--savedir",
                           str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    for what in ("two optimizers", "no dummy args", "clip by value", "zero auto tp",
                 "lightning precision plugin"):
        assert f"ok error {what}" in proc.stdout, proc.stdout
    for precision in ("16-true", "bf16-true", "16-mixed", "bf16-mixed"):
        assert f"ok precision {precision}" in proc.stdout, proc.stdout
    assert "ok error zero sharded checkpoint under another stage" in proc.stdout, proc.stdout
    for zero in ("zero1 16-mixed", "zero1 offload", "zero3 built by build_optimizer",
                 "zero3 offload_optimizer offload_params",
                 "zero3 deduped checkpoint resumes under zero1",
                 "zero1 two param groups + LambdaLR", "zero3 two param groups + LambdaLR",
                 "zero3 two param groups: merged checkpoint resumes under plain Lightning",
                 "zero1 optimizer over a subset"):
        assert f"ok {zero}" in proc.stdout, proc.stdout
    assert "ok default precision" in proc.stdout, proc.stdout


def test_loss_curve_png(data, runs, tmp_path):
    logged(data, runs, "nnc1", 1)
    logged(data, runs, "plain1", 1, "--use_nncompile", "false")
    png = tmp_path / "curves.png"
    proc = subprocess.run([sys.executable, "examples/nanogpt/plot_losses.py",
                           str(runs / "nnc1.jsonl"), str(runs / "plain1.jsonl"), "--labels",
                           "nncompile", "lightning", "-o", str(png)],
                          cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert png.stat().st_size > 10_000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "final val loss" in proc.stdout


def test_pipelined_plan_trains_through_train_step(tmp_path):
    """A pipelined plan (pp 2, 1F1B, 4 micro-batches) under NnCompileStrategy trains an
    unchanged training_step through pm.train_step like one device accumulating over the same
    micro-batches (AdamW, LambdaLR, clipping), resumes from its checkpoint, autocasts the
    stages under bf16-mixed; a microbatches-only plan trains too; validation on the pipelined
    plan equals one device's eval loss; validation on the microbatches-only plan,
    accumulate_grad_batches, 16-mixed, a changed loss and two forwards get clear errors. One
    2-rank torchrun launch (tests/workers/lightning_pipeline.py)."""
    out = torchrun("tests/workers/lightning_pipeline.py", 2, "--savedir", str(tmp_path),
                   timeout=300)
    for what in ("pp2 1f1b", "pp2 resumed from its step-2 checkpoint", "pp2 bf16-mixed",
                 "dp2 microbatches 4", "validation pp2", "error validation", "error accumulate",
                 "error 16-mixed",
                 "error changed loss", "error forward twice", "lightning pipeline: all checks"):
        assert f"ok {what}" in out, out[-3000:]
