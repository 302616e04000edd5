import os
import socket
import subprocess
import sys
import tempfile
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("NNCOMPILE_QUIET", "1")
if os.environ.get("PYTEST_XDIST_WORKER"):      # one of two workers: one intra-op thread each,
    import torch                               # as the torchrun tests' ranks run
    torch.set_num_threads(1)


# ---- workers: python -m pytest -n auto --dist loadgroup (pytest-xdist) ---------------------------
# A test that launches ranks already runs 2-4 processes: on this project's 2-core CI machine the
# suite saturates both cores without workers (measured: the same test rate with two), so the
# default run has none; on more cores, `-n auto` takes one worker per two cores, or
# NNCOMPILE_TEST_WORKERS.
CHEAP_SHARED = {"matrix"}          # module fixtures fine to build once per worker


def pytest_xdist_auto_num_workers(config):
    return int(os.environ.get("NNCOMPILE_TEST_WORKERS", max(1, (os.cpu_count() or 2) // 2)))


@pytest.hookimpl(tryfirst=True)     # before xdist's worker reads the marks into node ids
def pytest_collection_modifyitems(config, items):
    """Tests of a module that share a module-scoped fixture (one compile, one torchrun launch
    whose results several tests check) run on one worker, so it is built once; the others
    spread over the workers one by one."""
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        defs = info.name2fixturedefs.items() if info is not None else ()
        if any(name not in CHEAP_SHARED and fds and fds[-1].scope in ("module", "package",
                                                                        "class")
               for name, fds in defs):
            item.add_marker(pytest.mark.xdist_group(item.path.name))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(script: str, nproc: int, *args: str, timeout: int = 540, cwd=None,
             launcher: tuple[str, ...] = ()) -> str:
    """Run `script` on nproc gloo ranks (from `cwd`, default the repository root; `launcher`:
    torchrun options, e.g. --max-restarts=1, which run it under torchrun itself); fail with
    the output's tail unless every rank exits 0."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NNCOMPILE_QUIET": "1"}
    if not launcher:
        code, out = _launch_ranks(script, nproc, args, env, cwd or ROOT, timeout)
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
               f"--master_port={_free_port()}", *launcher, os.path.join(ROOT, script), *args]
        proc = subprocess.run(cmd, cwd=cwd or ROOT, env=env, capture_output=True, text=True,
                              timeout=timeout)
        code, out = proc.returncode, proc.stdout + proc.stderr
    if code != 0:
        lines = [ln for ln in out.splitlines() if "Error" in ln or "assert" in ln.lower()]
        pytest.fail(f"{script} on {nproc} ranks exited {code}\n"
                    + "\n".join(lines[-20:]) + "\n---- tail ----\n" + out[-4000:])
    return out


def _launch_ranks(script, nproc, args, env, cwd, timeout) -> tuple[int, str]:
    """The ranks as torchrun starts them (its environment variables; rank 0 hosts the store,
    as env:// does without an agent), without torchrun's agent process: one interpreter less
    per launch. When a rank fails, the others get 30 s to fail on their own (their next
    collective breaks), then are stopped, as torchrun stops them. Returns (the first non-zero
    exit code or 0, every rank's output, rank by rank)."""
    port = _free_port()
    common = {**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
              "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0",
              "GROUP_WORLD_SIZE": "1", "ROLE_NAME": "default", "ROLE_WORLD_SIZE": str(nproc),
              "PYTHONUNBUFFERED": "1"}
    with tempfile.TemporaryDirectory() as logs:
        files = [open(os.path.join(logs, f"rank{r}.log"), "w+") for r in range(nproc)]
        procs = [subprocess.Popen([sys.executable, "-u", os.path.join(ROOT, script), *args],
                                  cwd=cwd, stdout=files[r], stderr=subprocess.STDOUT,
                                  env={**common, "RANK": str(r), "LOCAL_RANK": str(r),
                                       "ROLE_RANK": str(r)})
                 for r in range(nproc)]
        deadline, failed_at = time.monotonic() + timeout, None
        try:
            while any(p.poll() is None for p in procs):
                now = time.monotonic()
                if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
                    failed_at = now
                if now > deadline or (failed_at is not None and now - failed_at > 30):
                    break
                time.sleep(0.05)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        if time.monotonic() > deadline and failed_at is None:
            raise subprocess.TimeoutExpired(script, timeout)
        out = []
        for f in files:
            f.seek(0)
            out.append(f.read())
            f.close()
    codes = [p.returncode for p in procs]
    return next((c for c in codes if c != 0), 0), "".join(out)


@pytest.fixture
def run_ranks():
    return torchrun


@pytest.fixture(scope="module")
def gen(tmp_path_factory):
    """A generated-code directory shared by one test module's compiles."""
    return tmp_path_factory.mktemp("gen")


@pytest.fixture(scope="module")
def gpt():
    """The tests' small GPT (tests/models.py), built once per test module."""
    import models
    return models.build("gpt")
