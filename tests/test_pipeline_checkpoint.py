"""Pipelined plans' state on 4 gloo ranks, in one launch (tests/workers/pipeline_checkpoint.py):
gather_params / gather_grads and clip_grad_norm_ under pp 2 x tp 2 equal a single device's;
sharded, deduped, dcp and merged checkpoints resume equal to uninterrupted training and merge to
the single-device state; DCP reshards pp 2 x tp 2 <-> tp 4, -> dp 4 (ZeRO-1) and -> pp 2 x dp 2
(ZeRO-1), whose own checkpoints resume and merge too."""
from conftest import torchrun

EXPECTED = (
    "ok clip pp 2 x tp 2 norm_type 2.0", "ok clip pp 2 x tp 2 norm_type inf",
    "ok gather_params pp 2 x tp 2",
    "ok merged pp: sharded, deduped, dcp equal the reference at step 2",
    "ok pp 2 x tp 2 steps 2-3 vs single device",
    "ok resume sharded pp 2 x tp 2", "ok resume deduped pp 2 x tp 2",
    "ok resume dcp pp 2 x tp 2", "ok resume merged pp 2 x tp 2",
    "ok dcp pp 2 x tp 2 -> tp 4", "ok dcp pp 2 x tp 2 -> dp 4 zero1",
    "ok dcp tp 4 -> pp 2 x tp 2", "ok dcp pp 2 x tp 2 -> pp 2 x dp 2 zero1",
    "ok merged ppdp: sharded, deduped, dcp equal the reference at step 3",
    "ok resume sharded pp 2 x dp 2 zero1", "ok resume deduped pp 2 x dp 2 zero1",
    "ok resume dcp pp 2 x dp 2 zero1", "ok merge refuses one stage's files",
)


def test_pipelined_state_gather_clip_and_every_checkpoint_format(tmp_path):
    out = torchrun("tests/workers/pipeline_checkpoint.py", 4, "--dir", str(tmp_path))
    missing = [line for line in EXPECTED if line not in out]
    assert not missing, f"missing {missing}\n" + out[-3000:]
