"""Training parity on gloo ranks: 20 AdamW steps under every runtime variant (sync / async
reducer, small buckets, gradient accumulation with and without no_sync, ZeRO-1, clipping)
equal single-device training, and the merged weights and optimizer state load into the
original module (tests/workers/train.py). The tolerance is measured per tensor: K_NOISE times
how far single-device runs that only reorder the same float32 sums drift apart."""
import pytest


@pytest.mark.parametrize("nproc", [2, 4])
def test_training_parity(run_ranks, tmp_path, nproc):
    out = run_ranks("tests/workers/train.py", nproc, "--savedir", str(tmp_path))
    plans = {2: ["dp 1x2", "tp 2x2"], 4: ["tp 2x4"]}[nproc]
    for plan in plans:
        assert out.count(f"ok train {plan} ") == 6, out[-3000:]
    assert "ok train fp32 reduction of bf16 grads" in out
