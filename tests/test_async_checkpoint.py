"""save_checkpoint(..., format="dcp", async_save=True) (runtime/checkpoints/async_checkpoint.py; workers in
tests/workers/async_checkpoint.py, tp 2 on 2 ranks): the checkpoint written while training
goes on holds the weights of the moment it was called, the next save and the end of the
program wait for it, and a rank killed during the write leaves the previous checkpoint as
the one latest_checkpoint finds, loadable."""
import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, torchrun
from rank_launch import free_port

import models
import nncompile
from nncompile.runtime.checkpoints.checkpoint import merged_checkpoint

WORKER = "tests/workers/async_checkpoint.py"


def test_a_background_save_holds_the_weights_of_its_call_and_finishes_at_the_end(tmp_path):
    torchrun(WORKER, 2, str(tmp_path), "--check", timeout=300)      # asserts inside
    ckpt = tmp_path / "ckpt"
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_1", "step_2", "step_3"]
    assert nncompile.latest_checkpoint(ckpt).name == "step_3"       # finished at exit
    merged = merged_checkpoint([ckpt / "step_3"])
    want = torch.load(tmp_path / "step_3.pt", weights_only=True)
    assert merged["extra"] == {"step": 3} and want.keys() <= merged["model"].keys()
    assert all(torch.equal(merged["model"][k], want[k]) for k in want)


def test_a_rank_killed_during_the_write_leaves_the_previous_checkpoint(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
           f"--master_port={free_port()}", os.path.join(ROOT, WORKER), str(tmp_path), "--kill"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "NNCOMPILE_QUIET": "1"})
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "SIGKILL" in out, out[-3000:]
    assert "was not killed" not in out
    ckpt = tmp_path / "ckpt"
    partial = ckpt / ".step_2.partial"
    assert partial.is_dir() and any(partial.glob("*.distcp"))      # killed mid-save
    assert not (ckpt / "step_2").exists()
    assert nncompile.latest_checkpoint(ckpt) == (ckpt / "step_1").absolute()
    merged = merged_checkpoint([ckpt / "step_1"])
    want = torch.load(tmp_path / "step_1.pt", weights_only=True)
    assert merged["extra"] == {"step": 1}
    assert all(torch.equal(merged["model"][k], want[k]) for k in want)
    with pytest.raises(nncompile.CheckpointError, match="is not a complete nncompile"):
        nncompile.load_checkpoint(ckpt / "step_2", None)


def test_async_save_needs_dcp_and_a_process_group(tmp_path):
    pm = nncompile.parallelize(models.build("mlp"), models.batch("mlp", 0),
                               nncompile.ComputeConfig(1), pas_policy="dp",
                               gen_savedir=tmp_path / "gen")
    with pytest.raises(nncompile.CheckpointError, match='pass format="dcp"'):
        nncompile.save_checkpoint(tmp_path / "a", pm, format="sharded", async_save=True)
    with pytest.raises(nncompile.CheckpointError, match="needs torch.distributed"):
        nncompile.save_checkpoint(tmp_path / "a", pm, format="dcp", async_save=True)
    assert not (tmp_path / "a").exists() and not (tmp_path / ".a.partial").exists()





def test_finish_completes_the_save_in_flight_before_the_group_goes(tmp_path):
    """nncompile.finish() (what a script calls before torch's destroy_process_group, which
    waits for nothing) returns once the background save is in place: one gloo rank in this
    process, the save's directory complete right after finish(). (Simulated ranks do not
    run background saves reliably: DCP's upload thread is none of theirs.)"""
    import torch.distributed as dist
    assert not dist.is_initialized()
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        pm = nncompile.parallelize(models.build("mlp"), models.batch("mlp", 0),
                                   nncompile.ComputeConfig(1), pas_policy="dp",
                                   gen_savedir=tmp_path / "gen")
        opt = nncompile.build_optimizer(pm, torch.optim.AdamW, lr=1e-2)
        pm(**models.batch("mlp", 0)).backward()
        opt.step()
        pending = nncompile.save_checkpoint(tmp_path / "ckpt" / "step_1", pm, opt,
                                            format="dcp", async_save=True)
        nncompile.finish()
        assert pending.done()
        assert nncompile.latest_checkpoint(tmp_path / "ckpt") == \
            (tmp_path / "ckpt" / "step_1").absolute()
    finally:
        dist.destroy_process_group()
