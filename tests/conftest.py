import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rank_launch import free_port, launch  # noqa: E402
os.environ.setdefault("NNCOMPILE_QUIET", "1")
if os.environ.get("PYTEST_XDIST_WORKER"):      # one of two workers: one intra-op thread each,
    import torch                               # as the torchrun tests' ranks run
    torch.set_num_threads(1)


# ---- workers: pyproject's addopts run `-n auto --dist loadgroup` (pytest-xdist) -------------------
# Two workers even on 2 cores: a rank launch leaves a core idle while rank 0 compiles and the
# others wait, and the other worker's tests fill it (README gives the suite's time both ways).
# On more cores one worker per two cores, or NNCOMPILE_TEST_WORKERS; `-n 0` runs everything in
# this process.
CHEAP_SHARED = {"matrix"}          # module fixtures fine to build once per worker


def pytest_xdist_auto_num_workers(config):
    return int(os.environ.get("NNCOMPILE_TEST_WORKERS", max(2, (os.cpu_count() or 2) // 2)))


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


def torchrun(script: str, nproc: int, *args: str, timeout: int = 540, cwd=None,
             launcher: tuple[str, ...] = ()) -> str:
    """Run `script` on nproc gloo ranks (from `cwd`, default the repository root; `launcher`:
    torchrun options, e.g. --max-restarts=1, which run it under torchrun itself); fail with
    the output's tail unless every rank exits 0."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NNCOMPILE_QUIET": "1"}
    if not launcher:
        code, out = launch_ranks(script, nproc, *args, timeout=timeout, cwd=cwd)
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
               f"--master_port={free_port()}", *launcher, os.path.join(ROOT, script), *args]
        proc = subprocess.run(cmd, cwd=cwd or ROOT, env=env, capture_output=True, text=True,
                              timeout=timeout)
        code, out = proc.returncode, proc.stdout + proc.stderr
    if code != 0:
        lines = [ln for ln in out.splitlines() if "Error" in ln or "assert" in ln.lower()]
        pytest.fail(f"{script} on {nproc} ranks exited {code}\n"
                    + "\n".join(lines[-20:]) + "\n---- tail ----\n" + out[-4000:])
    return out


def launch_ranks(script: str, nproc: int, *args: str, timeout: int = 540, cwd=None
                 ) -> tuple[int, str]:
    """`script` on nproc gloo ranks as torchrun starts them (below); (the first non-zero exit
    code or 0, every rank's output), whatever the ranks did."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NNCOMPILE_QUIET": "1"}
    return launch(script, nproc, args, env, cwd or ROOT, timeout)


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
