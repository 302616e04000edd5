"""Ranks that stop agreeing say where each one is (runtime/protocol/hang_report.py; tests/workers/
hang.py): under tp 2, rank 0 evaluating alone waits in the generated code's all_reduce while
rank 1 waits in a barrier; both fail within the timeout + 5 s, and the error of each names
both ranks, the collective each waits in, rank 0's generated-code and source line and each
rank's line of the script; an exception of the script on rank 0 is named in rank 1's error."""
import json
import os
import subprocess
import sys

from conftest import ROOT
from rank_launch import free_port

WORKER = "tests/workers/hang.py"
TIMEOUT_S = 8                           # the worker's


def test_every_rank_reports_where_each_rank_waits(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
           f"--master_port={free_port()}", os.path.join(ROOT, WORKER), str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "NNCOMPILE_QUIET": "1"})
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "did not fail" not in out, out[-3000:]
    assert out.count("nncompile: the ranks stopped agreeing") == 2, out[-3000:]  # each rank
    for rank in (0, 1):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["error"] - got["diverged"] <= TIMEOUT_S + 5, got
        lines = got["report"].splitlines()
        assert lines[0].startswith("nncompile: the ranks stopped agreeing"), got["report"]
        zero, one = lines[1], lines[2]
        assert zero.startswith("  rank 0: all_reduce, ") and "forward call #2 (eval)" in zero, zero
        assert "gencode0.py:" in zero and "comm.all_reduce(" in zero, zero
        assert "source examples/gpt.py:" in zero and "hang.py:" in zero, zero
        assert one.startswith("  rank 1: barrier, ") and "`dist.barrier()" in one, one
        # torch's Flight Recorder: each one's collective and its number on its group
        assert "flight recorder: gloo:all_reduce #" in zero, zero
        assert "flight recorder: gloo:barrier #" in one and "(default_pg)" in one, one


def test_an_error_of_the_script_on_one_rank_is_named_on_the_others(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
           f"--master_port={free_port()}", os.path.join(ROOT, WORKER), str(tmp_path), "--raise"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "NNCOMPILE_QUIET": "1"})
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "did not fail" not in out, out[-3000:]
    got = json.loads((tmp_path / "rank1.json").read_text())
    assert got["error"] - got["diverged"] <= TIMEOUT_S + 5, got        # not only at the timeout
    assert "rank 0: raised ValueError: a bad batch on rank 0" in got["report"], got["report"]


EXIT_SCRIPT = '''
import atexit, threading
import torch.distributed as dist
import nncompile

def after_nncompile_exit_handlers():      # registered first, so atexit runs it last
    alive = [t.name for t in threading.enumerate() if t.name == "nncompile-hang-watch"]
    print(f"rank {dist.get_rank()} watch threads alive at exit: {alive}", flush=True)

atexit.register(after_nncompile_exit_handlers)
nncompile.init_distributed("gloo", timeout_s=60)
assert any(t.name == "nncompile-hang-watch" for t in threading.enumerate())
dist.barrier()
'''


def test_the_watch_ends_before_the_interpreter(tmp_path, run_ranks):
    """A daemon watch still inside a store call when Python finalizes is ended by
    pthread_exit, which aborts the process after the script has finished (SIGABRT,
    "terminate called without an active exception"): the watch is stopped and joined at
    exit, so none is left when the interpreter ends."""
    script = tmp_path / "exit.py"
    script.write_text(EXIT_SCRIPT)
    out = run_ranks(str(script), 2)
    for rank in (0, 1):
        assert f"rank {rank} watch threads alive at exit: []" in out, out[-2000:]
    assert "terminate called" not in out, out[-2000:]
