"""Loading a checkpoint never runs code from it: every file nncompile reads goes through
torch.load(weights_only=True), a crafted file is refused with a CheckpointError (and its code
does not run), extra= is checked at save time, and a missing path says it does not exist.
All in one process (one rank, no process group)."""
import copy
import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT

import models
import nncompile


class Payload:
    """Unpickling this creates the marker file: what an attacker's checkpoint would do."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.makedirs, (self.marker,))


def probe(x):
    return x


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 1-rank dp MLP after one step, with its optimizer."""
    d = tmp_path_factory.mktemp("safety")
    pm = nncompile.parallelize(models.build("mlp"), models.batch("mlp", 0),
                               nncompile.ComputeConfig(1), pas_policy="dp",
                               gen_savedir=d / "gen")
    opt = nncompile.build_optimizer(pm, torch.optim.AdamW, lr=1e-3)
    pm(**models.batch("mlp", 0)).backward()
    opt.step()
    return pm, opt


def refused(excinfo, path):
    msg = str(excinfo.value)
    assert str(path) in msg and "contains objects nncompile does not load" in msg, msg
    assert "posix.makedirs" in msg or "os.makedirs" in msg, msg      # what was refused


@pytest.mark.parametrize("fmt", ["sharded", "deduped"])
def test_crafted_rank_file_is_refused_without_running(trained, tmp_path, fmt):
    pm, opt = trained
    path = nncompile.save_checkpoint(tmp_path / "ck", pm, opt, format=fmt, extra={"step": 1})
    marker = tmp_path / "pwned"
    blob = torch.load(path / "rank0.pt", weights_only=True)
    blob["extra"] = Payload(marker)
    torch.save(blob, path / "rank0.pt")
    with pytest.raises(nncompile.CheckpointError) as e:
        nncompile.load_checkpoint(path, pm, opt)
    refused(e, path / "rank0.pt")
    with pytest.raises(nncompile.CheckpointError) as e:       # the merge path reads it too
        nncompile.merge_checkpoint([path], tmp_path / "merged.pt")
    refused(e, path / "rank0.pt")
    assert not marker.exists() and not (tmp_path / "merged.pt").exists()


def test_crafted_merged_file_is_refused_without_running(trained, tmp_path):
    pm, opt = trained
    path = nncompile.save_checkpoint(tmp_path / "ck", pm, opt, extra={"step": 1})
    merged = nncompile.merge_checkpoint([path], tmp_path / "merged.pt")
    nncompile.load_checkpoint(merged, pm, opt)                    # the genuine one loads
    marker = tmp_path / "pwned"
    torch.save({"model": Payload(marker)}, merged)
    with pytest.raises(nncompile.CheckpointError) as e:
        nncompile.load_checkpoint(merged, pm, opt)
    refused(e, merged)
    assert not marker.exists()


def test_merge_command_refuses_a_crafted_file(tmp_path):
    marker = tmp_path / "pwned"
    evil = tmp_path / "rank0.pt"
    torch.save({"model": Payload(marker)}, evil)
    proc = subprocess.run([sys.executable, "-m", "nncompile", "merge", str(evil), "-o",
                           str(tmp_path / "m.pt")], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode != 0
    assert "contains objects nncompile does not load" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert not marker.exists() and not (tmp_path / "m.pt").exists()


def test_a_dtensor_in_extra_says_how_to_store_it():
    """An EMA of pm's DTensor parameters put in extra=: the error names the local shard and
    the whole tensor as what to store instead."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    from nncompile.runtime.checkpoints.checkpoint import check_extra
    from nncompile.tools.simulate import run_ranks

    def fn(rank):
        x = distribute_tensor(torch.ones(2), init_device_mesh("cpu", (1,)), [Replicate()])
        with pytest.raises(nncompile.CheckpointError,
                           match=r"extra\['ema'\]\[0\] is a .*DTensor.*x\.to_local\(\).*"
                                 r"x\.full_tensor\(\)"):
            check_extra({"ema": [x]})
    run_ranks(1, fn)


def test_extra_must_be_plain_data(trained, tmp_path):
    pm, opt = trained
    with pytest.raises(nncompile.CheckpointError, match=r"extra\['cb'\] is a .*function"):
        nncompile.save_checkpoint(tmp_path / "bad", pm, opt, extra={"step": 3, "cb": probe})
    with pytest.raises(nncompile.CheckpointError, match=r"extra\['rng'\]\[1\] is a .*Payload"):
        nncompile.save_checkpoint(tmp_path / "bad", pm, opt,
                                  extra={"rng": (1, Payload(tmp_path / "x"))})
    assert not (tmp_path / "bad").exists() and not list(tmp_path.glob(".bad*"))
    extra = {"step": 3, "lr": 0.1, "tags": ["a"], "done": False, "note": None,
             "nested": {"t": torch.arange(3), "pair": (1, "b")}, "rng": torch.get_rng_state()}
    for fmt in ("sharded", "deduped"):
        path = nncompile.save_checkpoint(tmp_path / fmt, pm, opt, format=fmt, extra=extra)
        got = nncompile.load_checkpoint(path, pm, opt)
        assert got.keys() == extra.keys()
        assert (got["step"], got["lr"], got["tags"], got["done"], got["note"]) == \
            (3, 0.1, ["a"], False, None)
        assert got["nested"]["pair"] == (1, "b")
        assert torch.equal(got["nested"]["t"], torch.arange(3))
        assert torch.equal(got["rng"], extra["rng"])
        merged = nncompile.merge_checkpoint([path], tmp_path / f"{fmt}.pt")
        assert nncompile.load_checkpoint(merged, pm, opt)["tags"] == ["a"]


def test_missing_path_says_it_does_not_exist(trained, tmp_path):
    pm, opt = trained
    for missing in (tmp_path / "nope", tmp_path / "nope.pt"):
        with pytest.raises(nncompile.CheckpointError, match="does not exist") as e:
            nncompile.load_checkpoint(missing, pm, opt)
        assert str(missing) in str(e.value)
        with pytest.raises(nncompile.CheckpointError, match="does not exist"):
            nncompile.merge_checkpoint([missing], tmp_path / "m.pt")
    path = nncompile.save_checkpoint(tmp_path / "ck", pm, opt)
    (path / "rank0.pt").unlink()                       # a directory missing its rank file
    with pytest.raises(nncompile.CheckpointError, match="rank0.pt does not exist"):
        nncompile.load_checkpoint(path, pm, opt)
    proc = subprocess.run([sys.executable, "-m", "nncompile", "merge", str(tmp_path / "nope"),
                           "-o", str(tmp_path / "m.pt")], capture_output=True, text=True,
                          cwd=ROOT)
    assert proc.returncode != 0 and "does not exist" in proc.stderr, proc.stderr


# ---- truncated and crafted files, every rank together ----------------------------------------
def _two_ranks(tmp_path, fmt, damage, load=True):
    """Save a tp plan-2 checkpoint on 2 simulated ranks, damage it, load it on both; returns
    each rank's CheckpointError message (None where loading succeeded)."""
    from nncompile.tools.simulate import run_ranks
    batch = models.batch("mlp", 0)
    model = models.build("mlp")
    ck = tmp_path / f"ck_{fmt}"

    def save(rank):
        pm = nncompile.parallelize(copy.deepcopy(model), batch, nncompile.ComputeConfig(2),
                                   pas_policy="tp",
                                   gen_savedir=tmp_path / "gen")
        opt = nncompile.build_optimizer(pm, torch.optim.AdamW, lr=1e-3)
        pm(**batch).backward()
        opt.step()
        nncompile.save_checkpoint(ck, pm, opt, format=fmt)
    run_ranks(2, save)
    damage(ck)

    def load(rank):
        pm = nncompile.parallelize(copy.deepcopy(model), batch, nncompile.ComputeConfig(2),
                                   pas_policy="tp",
                                   gen_savedir=tmp_path / "gen")
        opt = nncompile.build_optimizer(pm, torch.optim.AdamW, lr=1e-3)
        try:
            nncompile.load_checkpoint(ck, pm, opt)
        except nncompile.CheckpointError as e:
            return str(e)
        return None
    return run_ranks(2, load) if load else None


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])


@pytest.mark.parametrize("fmt", ["sharded", "deduped"])
def test_truncated_rank_file_fails_on_every_rank(tmp_path, fmt):
    msgs = _two_ranks(tmp_path, fmt, lambda ck: _truncate(ck / "rank1.pt"))
    for msg in msgs:                          # rank 0's own file is fine; it refuses too
        assert msg is not None
        assert "failed on rank 1" in msg and "rank1.pt is truncated or corrupted" in msg, msg


def test_truncated_dcp_checkpoint_is_a_checkpoint_error(tmp_path):
    def damage(ck):
        for f in ck.glob("*.distcp"):
            _truncate(f)
    for msg in _two_ranks(tmp_path, "dcp", damage):
        assert msg is not None and "could not read the dcp checkpoint" in msg, msg
        assert "truncated or corrupted" in msg


def test_truncated_dcp_metadata_is_a_checkpoint_error(tmp_path):
    for msg in _two_ranks(tmp_path, "dcp", lambda ck: _truncate(ck / ".metadata")):
        assert msg is not None and ".metadata is unreadable" in msg, msg


def test_crafted_dcp_metadata_is_refused_without_running(tmp_path):
    marker = tmp_path / "pwned"

    def craft(ck):
        import pickle
        (ck / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    msgs = _two_ranks(tmp_path, "dcp", craft)
    for msg in msgs:
        assert msg is not None and "makedirs is not checkpoint metadata" in msg, msg
    assert not marker.exists()
    with pytest.raises(nncompile.CheckpointError, match="not checkpoint metadata"):
        nncompile.merge_checkpoint([tmp_path / "ck_dcp"], tmp_path / "merged.pt")
    assert not marker.exists()


def test_latest_checkpoint_is_the_newest_complete_save(tmp_path):
    """latest_checkpoint skips an interrupted save (its staging directory, a directory
    without checkpoint.json) and orders by the number ending the name, else by completion."""
    torch.manual_seed(0)
    x = torch.randn(2, 4)
    pm = nncompile.parallelize(torch.nn.Linear(4, 4), {"input": x},
                               nncompile.ComputeConfig(1, 1), pas_policy="dp",
                               gen_savedir=str(tmp_path / "gen"))
    root = tmp_path / "ckpt"
    assert nncompile.latest_checkpoint(root) is None               # no directory yet
    root.mkdir()
    assert nncompile.latest_checkpoint(root) is None               # nothing saved
    for step in (2, 10, 9):                                         # step_10 > step_9 > step_2
        nncompile.save_checkpoint(root / f"step_{step}", pm, extra={"step": step})
    (root / ".step_11.partial").mkdir()                            # a save that was cut off
    (root / ".step_11.partial" / "rank0.pt").write_bytes(b"partial")
    (root / "step_12").mkdir()                                     # no checkpoint.json
    latest = nncompile.latest_checkpoint(root)
    assert latest == (root / "step_10").absolute()
    assert nncompile.load_checkpoint(latest, pm)["step"] == 10
    named = tmp_path / "named"
    for name in ("best", "last"):                                   # no numbers: the last done
        nncompile.save_checkpoint(named / name, pm, extra={"name": name})
    assert nncompile.latest_checkpoint(named).name == "last"


def test_damaged_checkpoint_is_skipped_by_latest_and_refused_by_load(tmp_path):
    """A checkpoint.json cut short (a full disk, a copy that stopped) is a CheckpointError
    naming the file, not a JSONDecodeError, and latest_checkpoint falls back to the previous
    complete checkpoint; likewise past one whose rank file is missing or empty, and past a
    dcp one without its .metadata."""
    torch.manual_seed(0)
    x = torch.randn(2, 4)
    pm = nncompile.parallelize(torch.nn.Linear(4, 4), {"input": x},
                               nncompile.ComputeConfig(1, 1), pas_policy="dp",
                               gen_savedir=str(tmp_path / "gen"))
    root = tmp_path / "ckpt"
    for step in range(1, 6):
        nncompile.save_checkpoint(root / f"step_{step}", pm, extra={"step": step})
    index = root / "step_5" / "checkpoint.json"
    _truncate(index)
    assert nncompile.latest_checkpoint(root) == (root / "step_4").absolute()
    with pytest.raises(nncompile.CheckpointError) as e:
        nncompile.load_checkpoint(root / "step_5", pm)
    msg = str(e.value)
    assert str(index) in msg and "not valid JSON" in msg and "truncated" in msg, msg
    assert "load an earlier one" in msg, msg
    index.write_text("[]")                                         # JSON, but not an index
    with pytest.raises(nncompile.CheckpointError, match="does not describe an nncompile"):
        nncompile.load_checkpoint(root / "step_5", pm)
    (root / "step_4" / "rank0.pt").write_bytes(b"")                # an empty rank file
    assert nncompile.latest_checkpoint(root) == (root / "step_3").absolute()
    (root / "step_3" / "rank0.pt").unlink()                        # a missing one
    assert nncompile.latest_checkpoint(root) == (root / "step_2").absolute()
    dcp_index = json.loads((root / "step_2" / "checkpoint.json").read_text())
    (root / "step_9").mkdir()                                      # a dcp save without .metadata
    (root / "step_9" / "extra.pt").write_bytes(b"x")
    (root / "step_9" / "checkpoint.json").write_text(json.dumps({**dcp_index, "format": "dcp"}))
    latest = nncompile.latest_checkpoint(root)
    assert latest == (root / "step_2").absolute()
    assert nncompile.load_checkpoint(latest, pm)["step"] == 2


def test_accumulation_steps_keep_the_global_batch():
    """Resuming on half the data-parallel units doubles the accumulation; what does not
    divide is a ConfigError saying so."""
    assert nncompile.accumulation_steps(32, 4, 4) == 2
    assert nncompile.accumulation_steps(32, 4, 2) == 4
    assert nncompile.accumulation_steps(32, 8, 4) == 1
    with pytest.raises(nncompile.ConfigError, match="does not split into micro-batches of 3"):
        nncompile.accumulation_steps(32, 3, 4)
    with pytest.raises(nncompile.ConfigError, match="dp_units=0 must be a positive integer"):
        nncompile.accumulation_steps(32, 4, 0)
