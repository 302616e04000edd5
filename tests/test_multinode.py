"""Nodes without a shared disk: rank 0's generated files are sent to every node that lacks them
(nncompile/distribute.py), and a rank that still cannot find its file gets an NNCompileError
naming the host and the path."""
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

import models
import nncompile
from nncompile.distribute import require_rank_file
from rank_launch import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "workers", "multinode.py")
INSTANCE = "gpt_tp"         # tests/workers/multinode.py's instance_name
TIMEOUT_S = 420          # two agents and four ranks, also beside another test worker


def _launch_two_nodes(tmp_path) -> list[str]:
    """Two torchrun "nodes" on this host, each in its own cwd (tmp/node0, tmp/node1)."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NNCOMPILE_QUIET": "1"}
    procs = []
    for k in range(2):
        cwd = tmp_path / f"node{k}"
        cwd.mkdir()
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2",
               "--nproc_per_node=2", f"--node_rank={k}", "--master_addr=127.0.0.1",
               f"--master_port={port}", WORKER]
        procs.append(subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True,
                                      start_new_session=True))
    outs, deadline = [], time.monotonic() + TIMEOUT_S
    try:
        for p in procs:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            outs.append(out)
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:            # torchrun and its workers: one session each
                os.killpg(p.pid, signal.SIGKILL)
                p.communicate()
    if len(outs) < 2 or any(p.returncode != 0 for p in procs):
        report = "\n".join(f"---- node {k} (exit {p.returncode}) ----\n{o[-4000:]}"
                           for k, (p, o) in enumerate(zip(procs, outs + ["(timed out)"] * 2)))
        pytest.fail(f"two-node run failed or took over {TIMEOUT_S}s\n{report}")
    return outs


def test_two_nodes_without_shared_disk(tmp_path):
    outs = _launch_two_nodes(tmp_path)
    for k, out in enumerate(outs):
        for rank in (2 * k, 2 * k + 1):
            assert f"ok rank {rank} node {k}:" in out, out[-3000:]
    node0 = tmp_path / "node0" / "gen" / INSTANCE
    node1 = tmp_path / "node1" / "gen" / INSTANCE
    names = sorted(str(p.relative_to(node0)) for p in node0.rglob("*") if p.is_file())
    assert {f"gencode{r}.py" for r in range(4)} | {"manifest.json", "plan.json"} <= set(names)
    assert any(n.startswith("graphs/") for n in names)
    for name in names:          # byte for byte: copied from node 0, not compiled on node 1
        assert (node1 / name).read_bytes() == (node0 / name).read_bytes(), name
    assert '"compile_seconds"' in (node1 / "manifest.json").read_text()
    assert not list((tmp_path / "node1" / "gen").glob(".*")), "staging left behind"


def test_missing_rank_file_names_host_and_path(tmp_path):
    with pytest.raises(nncompile.NNCompileError) as e:
        require_rank_file(tmp_path, 3)
    msg = str(e.value)
    assert socket.gethostname() in msg and str(tmp_path / "gencode3.py") in msg, msg
    assert "every node shares" in msg and "local rank 0" in msg, msg


def test_parallelize_raises_when_rank_file_is_missing(tmp_path, monkeypatch):
    """parallelize checks for the file before importing it (no raw FileNotFoundError)."""
    import nncompile.api as api
    monkeypatch.setattr(api, "compile_module", lambda *a, **k: None)   # "rank 0 wrote nothing"
    with pytest.raises(nncompile.NNCompileError, match=socket.gethostname()) as e:
        nncompile.parallelize(models.build("mlp"), models.batch("mlp", 0),
                              nncompile.ComputeConfig(1, 1), pas_policy="dp",
                              gen_savedir=tmp_path, instance_name="Missing")
    assert str(tmp_path / "Missing" / "gencode0.py") in str(e.value)


def test_received_files_written_atomically_keeping_local_edits(tmp_path):
    """A node's writer checks each sha256, replaces a stale copy and keeps local edits."""
    import hashlib
    import json

    from nncompile.distribute import _write, generated_files
    from nncompile.errors import EditedCodeWarning
    outdir = tmp_path / "gen" / "Net"
    (outdir / "graphs").mkdir(parents=True)
    (outdir / "gencode0.py").write_text("edited locally\n")
    (outdir / "manifest.json").write_text(json.dumps(
        {"files": {"gencode0.py": hashlib.sha256(b"old\n").hexdigest()}}))
    new = {"gencode0.py": b"new\n", "manifest.json": b"{}\n", "graphs/00_trace.py": b"g\n"}
    files = {k: (v, hashlib.sha256(v).hexdigest()) for k, v in new.items()}
    with pytest.raises(nncompile.NNCompileError, match="corrupted"):
        _write(outdir, {**files, "plan.json": (b"x", "0" * 64)})
    assert (outdir / "gencode0.py").read_text() == "edited locally\n"     # untouched
    with pytest.warns(EditedCodeWarning, match="gencode0.py"):
        _write(outdir, files)
    assert generated_files(outdir) == sorted(new)
    assert all((outdir / k).read_bytes() == v for k, v in new.items())
    assert (outdir / "edited" / "gencode0.py").read_text() == "edited locally\n"
    assert [p.name for p in (tmp_path / "gen").iterdir()] == ["Net"]      # no staging left
