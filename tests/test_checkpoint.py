"""Checkpoints: resume in new processes (sharded, deduped, dcp, merged), plan and world-size
changes through dcp, crash recovery, the merge command, and clear errors
(tests/workers/checkpoint.py does the multi-rank work)."""
import os
import socket
import subprocess
import sys
import time

import pytest
import torch

from conftest import ROOT, torchrun

import models
import nncompile

WORKER = "tests/workers/checkpoint.py"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """10 steps of tp plan 2 on 2 ranks saved in every format, plus 20 uninterrupted losses."""
    d = tmp_path_factory.mktemp("ckpt")
    torchrun(WORKER, 2, "--phase", "save", "--dir", str(d))
    return d


def test_resume_every_format_in_new_processes(saved):
    out = torchrun(WORKER, 2, "--phase", "resume", "--dir", str(saved))
    for what in ("resume sharded", "resume deduped", "resume dcp", "merged file tp 2x2 -> dp"):
        assert f"ok {what}" in out, out[-3000:]


def test_dcp_loads_under_other_plans_and_world_size(saved):
    out = torchrun(WORKER, 4, "--phase", "reshard", "--dir", str(saved))
    for what in ("-> data 2x4 zero (next step)", "-> dp 1x4 zero (next step)",
                 "-> tp 2x4 (next step)", "zero sharded round trip", "zero deduped round trip"):
        assert what in out, out[-3000:]


def test_zero3_checkpoints_every_format_and_across_stages(saved):
    """ZeRO-3 on the hybrid tp 2x4 loads a tp 2x2 dcp checkpoint; its sharded, deduped and dcp
    checkpoints resume equal to uninterrupted training; its merged file and its dcp checkpoint
    load under ZeRO-1 and ZeRO-2 dp 1x4."""
    out = torchrun(WORKER, 4, "--phase", "zero3", "--dir", str(saved))
    for what in ("dcp tp 2x2 -> tp 2x4 zero3", "zero3 tp 2x4 vs uninterrupted",
                 "zero3 sharded resume", "zero3 deduped resume", "zero3 dcp resume",
                 "z3_merged.pt (zero3 tp 2x4) -> dp 1x4 zero1",
                 "z3_dcp (zero3 tp 2x4) -> dp 1x4 zero1", "z3_dcp (zero3 tp 2x4) -> dp 1x4 zero2"):
        assert f"ok {what}" in out, out[-3000:]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _crash(d, timeout: int, *extra: str):
    """Launch the crash phase on 2 ranks without torchrun (which would kill the survivor
    itself); returns (outputs, return codes, seconds the survivor took after rank 1 went)."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_port()),
           "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1", "NNCOMPILE_TIMEOUT_S": str(timeout)}
    procs = [subprocess.Popen([sys.executable, os.path.join(ROOT, WORKER), "--phase", "crash",
                               "--dir", str(d), "--die-at", "9", *extra], cwd=ROOT,
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    try:
        if "--hang" in extra:     # wait until rank 1 has stopped itself
            while not (procs[1].stdout.readline() or "").startswith("rank 1: SIGSTOP"):
                assert procs[1].poll() is None, "rank 1 exited before stopping"
        else:
            procs[1].wait(timeout=300)
        gone = time.monotonic()
        procs[0].wait(timeout=timeout + 60)
        survivor_s = time.monotonic() - gone
    finally:
        for p in procs:
            p.kill()
            p.wait()
    return [p.stdout.read() for p in procs], [p.returncode for p in procs], survivor_s


def test_crash_fails_survivors_and_last_checkpoint_resumes(saved, tmp_path):
    d = tmp_path / "crash"
    d.mkdir()
    (d / "losses.json").write_text((saved / "losses.json").read_text())
    timeout = 30
    (out0, out1), codes, survivor_s = _crash(d, timeout)
    assert codes[1] == -9, out1[-2000:]
    assert codes[0] != 0, "the survivor must fail, not finish:\n" + out0[-2000:]
    assert survivor_s < timeout + 15, f"the survivor took {survivor_s:.0f}s to fail"
    assert "Error" in out0, out0[-2000:]
    assert (d / "step6" / "checkpoint.json").exists() and not (d / "step9").exists()
    out = torchrun(WORKER, 2, "--phase", "recover", "--dir", str(d), "--die-at", "9")
    assert "ok recover from step 6 after the crash" in out, out[-3000:]


def test_merge_command_gives_a_checkpoint_the_original_module_loads(saved, tmp_path):
    for source in ("sharded", "deduped", "dcp"):
        out = tmp_path / f"{source}.pt"
        proc = subprocess.run([sys.executable, "-m", "nncompile", "merge",
                               str(saved / source), "-o", str(out)],
                              capture_output=True, text=True, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr
        merged = torch.load(out, weights_only=False)
        model = models.build("gpt", seed=3)
        model.load_state_dict(merged["model"])            # strict: every key, tied ones too
        opt = torch.optim.AdamW(model.parameters())
        opt.load_state_dict(merged["optimizer"])
        assert merged["extra"] == {"step": 10}
        assert opt.param_groups[0]["lr"] == 1e-2 and opt.param_groups[0]["weight_decay"] == 0.1
        if source == "sharded":
            first = merged
        else:
            for k, v in first["model"].items():
                torch.testing.assert_close(merged["model"][k], v, rtol=0, atol=0)
            for i, st in first["optimizer"]["state"].items():
                for key, v in st.items():
                    torch.testing.assert_close(merged["optimizer"]["state"][i][key], v,
                                               rtol=0, atol=0)


def test_merge_needs_every_slice(saved, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "nncompile", "merge",
                           str(saved / "sharded" / "rank0.pt"), "-o", str(tmp_path / "m.pt")],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2
    assert "do not cover every slice" in proc.stderr and "all ranks" in proc.stderr
    assert not (tmp_path / "m.pt").exists()


def test_incomplete_checkpoint_and_bad_format_are_refused(tmp_path):
    pm = nncompile.parallelize(models.build("mlp"), models.batch("mlp", 0),
                               nncompile.ComputeConfig(1), pas_policy="dp",
                               gen_savedir=tmp_path / "gen")
    (tmp_path / ".ck.partial").mkdir()
    (tmp_path / "ck").mkdir()
    with pytest.raises(nncompile.CheckpointError, match="not a complete nncompile checkpoint"):
        nncompile.load_checkpoint(tmp_path / "ck", pm)
    with pytest.raises(nncompile.CheckpointError, match="choose one of"):
        nncompile.save_checkpoint(tmp_path / "ck2", pm, format="pickle")
    opt = nncompile.build_optimizer(pm, torch.optim.AdamW, lr=1e-3)
    pm(**models.batch("mlp", 0)).backward()
    opt.step()
    path = nncompile.save_checkpoint(tmp_path / "ok", pm, opt, format="sharded", extra={"a": 1})
    assert sorted(p.name for p in path.iterdir()) == ["checkpoint.json", "rank0.pt"]
    assert not list(tmp_path.glob(".ok*")), "no staging directory left behind"
    with pytest.raises(nncompile.CheckpointError, match="saved without optimizer state"):
        nncompile.save_checkpoint(tmp_path / "noopt", pm)
        nncompile.load_checkpoint(tmp_path / "noopt", pm, opt)
    assert nncompile.load_checkpoint(path, pm, opt) == {"a": 1}


def test_runtime_options_reuse_generated_code(tmp_path):
    model, batch = models.build("mlp"), models.batch("mlp", 0)
    for cfg in (nncompile.ComputeConfig(1), nncompile.ComputeConfig(
            1, use_async_reducer=True, reducer_bucket_cap_mb=1, use_zero=True)):
        nncompile.parallelize(model, batch, cfg, pas_policy="dp", gen_savedir=tmp_path)
    with pytest.raises(nncompile.ConfigError, match="zero_ngroups=3 does not divide"):
        nncompile.ComputeConfig(1, 4, use_zero=True, zero_ngroups=3)
    with pytest.raises(nncompile.ConfigError, match="needs a torch.optim.Optimizer class"):
        nncompile.build_optimizer(nncompile.parallelize(model, batch, nncompile.ComputeConfig(1),
                                                        pas_policy="dp", gen_savedir=tmp_path),
                                  "adamw")


def test_a_hung_rank_fails_the_others_within_the_timeout(saved, tmp_path):
    """A rank that stops responding (SIGSTOP: its sockets stay open) in the middle of a step:
    the survivor's tensor-parallel collective gives up after NNCOMPILE_TIMEOUT_S."""
    timeout = 8
    (out0, _), codes, survivor_s = _crash(tmp_path, timeout, "--hang")
    assert codes[0] != 0, out0[-2000:]
    assert timeout - 1 < survivor_s < timeout + 20, f"failed after {survivor_s:.1f}s"
    assert "Timed out" in out0 or "timeout" in out0.lower(), out0[-2000:]


def test_state_dict_of_another_plan_is_refused_before_any_tensor_changes(tmp_path):
    model, batch = models.build("mlp"), models.batch("mlp", 0)
    a = nncompile.parallelize(model, batch, nncompile.ComputeConfig(1), pas_policy="dp",
                              gen_savedir=tmp_path)
    b = nncompile.parallelize(model, batch, nncompile.ComputeConfig(1), pas_policy="data",
                              gen_savedir=tmp_path, instance_name="other")
    narrow = nncompile.parallelize(models.MLP(d_hidden=32), batch, nncompile.ComputeConfig(1),
                                   pas_policy="data", gen_savedir=tmp_path, instance_name="narrow")
    sd = a.local_state_dict()
    assert sd["_extra_state"]["policy"] == "dp"
    sd = {k: (v + 1 if torch.is_tensor(v) else v) for k, v in sd.items()}
    before = {k: v.clone() for k, v in narrow.local_state_dict().items() if torch.is_tensor(v)}
    with pytest.raises(nncompile.CheckpointError) as e:
        narrow.load_state_dict(sd)
    assert "policy 'dp', plan_ngpus 1" in str(e.value) and "policy 'data'" in str(e.value)
    assert "format='dcp'" in str(e.value)
    assert "parameter 'fc1.weight': full shape [64, 16] in the checkpoint, [32, 16] here" \
        in str(e.value)
    for k, v in narrow.local_state_dict().items():
        if torch.is_tensor(v):
            assert torch.equal(v, before[k]), f"{k} changed before the plan check"
    b.load_state_dict(sd)         # another policy, the same shards: shards decide, not plans
    for k, v in b.local_state_dict().items():
        if torch.is_tensor(v):
            assert torch.equal(v, sd[k]), k
    merged, _ = nncompile.merge_state_dicts([a.local_state_dict()])
    assert set(merged) == set(model.state_dict())
    nncompile.load_merged_state_dict(b, merged)          # a merged state dict loads anywhere
    for k, v in b.gather_params().items():
        torch.testing.assert_close(v, dict(model.named_parameters())[k].detach())
