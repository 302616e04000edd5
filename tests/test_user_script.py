"""A user's own training loop as the client: examples/nanogpt/train_loop.py, written the way
nanoGPT's train.py is (configure_optimizers' two AdamW groups, estimate_loss() under
model.eval(), gradient accumulation, GradScaler, clip_grad_norm_, lr warmup + cosine,
checkpoints and init_from='resume'), prints the same losses with nncompile in place of DDP.

Which runs are compared, and why they are exact:
- DDP vs nncompile `dp` and `dp` + ZeRO-3, 2 ranks, float16 autocast with a GradScaler
  (each rank computes what its DDP rank computes; only the gradient average is shared, in
  float32). nanoGPT seeds rank r with 1337 + r (seed_offset = ddp_rank // plan_ngpus = r),
  so each rank draws its own batches and dropout masks from its own generator in both runs;
  DDP and parallelize both start every rank from rank 0's weights.
  gradient_accumulation_steps=4 is divided by the 2 data-parallel ranks: 2 micro-steps per
  rank, a global batch of 4 micro-batches per iteration in both.
- One process (no torchrun) vs nncompile `tp` over 2 ranks (one plan unit), float32 (a
  split matmul sums its partial products in another order). Both ranks seed 1337
  (seed_offset = ddp_rank // 2 = 0), as the one process does: the same initial weights,
  batches and dropout masks (a dropout on a shard draws the full tensor's mask). With one
  data-parallel unit the 4 accumulation micro-steps are not divided: the same global batch.
- Resume: both of those runs continue from their last checkpoint with init_from='resume'.
  nanoGPT reseeds on resume (its checkpoint holds no generator state), so a resumed run is
  compared with the other resumed run, not with an uninterrupted one: their losses are equal
  only if weights, both optimizer groups' state and the step count came back.

Iterations are few on purpose: at this learning rate two runs whose weights differ in the
last bits (another summation order) drift apart visibly after about 10 iterations (to 1.6e-4
at iteration 12, tp vs one process, uninterrupted).

Losses print with 4 decimals (nanoGPT's format); two runs that differ only in summation order
(DDP reduces the summed micro-batch gradients once, nncompile under ZeRO-3 each micro-batch's)
may round a last digit apart, so values are compared to 1e-4. Wrong grouping, unsynchronized
replicas, dropout left on in eval or a local gradient norm move them by far more within 8 iterations
(weight decay 0.5 applied to the norms' weights as well moves them by up to 1.2e-3).
"""
from __future__ import annotations

import os
import pickle
import re
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT, torchrun

SCRIPT = "examples/nanogpt/train_loop.py"
VOCAB = 32
ARGS = ["--max_iters=8", "--eval_interval=4", "--log_interval=1", "--eval_iters=2",
        "--learning_rate=0.01", "--warmup_iters=2", "--weight_decay=0.5",
        "--gradient_accumulation_steps=4", "--dropout=0.1", "--grad_clip=0.5"]
FP16 = "--dtype=float16"       # autocast + GradScaler (data-parallel runs: no partial sums)
TOL = 1.01e-4


def corpus(rng, n: int) -> np.ndarray:
    """Tokens following a fixed recurrence, restarted at random: learnable in a few steps."""
    out = np.empty(n, dtype=np.uint16)
    a, b = 1, 2
    for i in range(n):
        if rng.random() < 0.05:
            a, b = (int(v) for v in rng.integers(0, VOCAB, 2))
        a, b = b, (a + 3 * b + 1) % VOCAB
        out[i] = b
    return out


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    rng = np.random.default_rng(0)
    for split, n in (("train", 20_000), ("val", 2_000)):
        corpus(rng, n).tofile(d / f"{split}.bin")
    with open(d / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": VOCAB}, f)
    return d


def run(data, out_dir, nproc: int, *args: str) -> list[tuple]:
    """The script's printed losses in order: ("step", n, train, val) and ("iter", n, loss)."""
    args = (*ARGS, f"--dataset={data}", f"--out_dir={out_dir}", *args)
    if nproc == 1:          # one process, no torchrun: nanoGPT's single-device path
        proc = subprocess.run([sys.executable, os.path.join(ROOT, SCRIPT), *args],
                              cwd=ROOT, capture_output=True, text=True, timeout=300,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, out[-4000:]
    else:
        out = torchrun(SCRIPT, nproc, *args, timeout=300)
    rows = []
    for line in out.splitlines():
        if m := re.fullmatch(r"step (\d+): train loss ([0-9.]+), val loss ([0-9.]+)", line):
            rows.append(("step", int(m[1]), float(m[2]), float(m[3])))
        elif m := re.match(r"iter (\d+): loss ([0-9.]+), time", line):
            rows.append(("iter", int(m[1]), float(m[2])))
    assert rows, out[-4000:]
    return rows


def assert_same(got: list[tuple], want: list[tuple], what: str) -> None:
    assert [r[:2] for r in got] == [r[:2] for r in want], (what, got, want)
    worst = max(abs(a - b) for g, w in zip(got, want) for a, b in zip(g[2:], w[2:]))
    assert worst <= TOL, f"{what}: printed losses differ by up to {worst:.4f}\n" + "\n".join(
        f"  {g}   vs   {w}" for g, w in zip(got, want) if g != w)


@pytest.fixture(scope="module")
def ddp(data, tmp_path_factory):
    return run(data, tmp_path_factory.mktemp("ddp"), 2, FP16)


@pytest.fixture(scope="module")
def one_device(data, tmp_path_factory):
    out = tmp_path_factory.mktemp("one")
    return out, run(data, out, 1)


@pytest.mark.parametrize("zero", [0, 3])
def test_dp_prints_what_ddp_prints(data, ddp, tmp_path, zero):
    got = run(data, tmp_path, 2, FP16, "--nncompile_policy=dp", f"--use_zero={zero}")
    assert [r[:2] for r in ddp].count(("step", 8)) == 1 and len(ddp) == 12
    assert_same(got, ddp, f"nncompile dp, ZeRO-{zero} vs DDP")


def test_tp_prints_what_one_device_prints_and_resumes(data, one_device, tmp_path):
    one_dir, want = one_device
    got = run(data, tmp_path, 2, "--nncompile_policy=tp", "--plan_ngpus=2")
    assert_same(got, want, "nncompile tp on 2 ranks vs one process")
    # both continue from the checkpoint each wrote at iteration 8, evaluating at 8 and 10
    resume = ("--init_from=resume", "--max_iters=10", "--eval_interval=2")
    want = run(data, one_dir, 1, *resume)
    got = run(data, tmp_path, 2, "--nncompile_policy=tp", "--plan_ngpus=2", *resume)
    assert [r[:2] for r in want] == [("step", 8), ("iter", 8), ("iter", 9), ("step", 10),
                                     ("iter", 10)], want
    assert_same(got, want, "resumed nncompile tp vs resumed one process")
