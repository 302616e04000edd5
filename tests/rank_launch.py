"""Start a job's ranks as torchrun starts them, forked from tests/rank_server.py (a process that
has imported torch, nncompile and transformers once) instead of fresh interpreters: the tests'
launcher (conftest.py) and the documentation pages' `torchrun` commands (doc_runner.py) use it.

    server = rank_server(env)          # one per process, started at its first launch
    code, out = launch(script, nproc, args, env, cwd, timeout)            # rank by rank
    code, out, err = launch(..., split_stderr=True)    # standard error apart (doc_runner)
"""
from __future__ import annotations

import atexit
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def recv_line(conn) -> bytes:
    """One newline-ended message from a socket (doc_runner's torchrun and its shim)."""
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(1 << 20)
        if not chunk:
            break
        data += chunk
    return data


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_PER_LAUNCH = {"MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
              "GROUP_WORLD_SIZE", "ROLE_NAME", "ROLE_WORLD_SIZE", "RANK", "LOCAL_RANK",
              "ROLE_RANK", "PYTHONUNBUFFERED", "PYTEST_CURRENT_TEST"}   # per rank or per test


# set by torch in the tests' own process once it compiles in-process (inductor's cache
# directory, a pointer its C++ wrappers read, Lightning's CUDA probe): read when used, not at
# import, so a rank forked with them in its environment behaves as a fresh one
_SET_BY_TORCH = {"TORCHINDUCTOR_CACHE_DIR", "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR",
                 "PYTORCH_NVML_BASED_CUDA_CHECK"}


def _job_env(env: dict) -> dict:
    """What a launch's environment shares with the server's: all but _PER_LAUNCH and
    _SET_BY_TORCH."""
    return {k: v for k, v in env.items() if k not in _PER_LAUNCH and k not in _SET_BY_TORCH}


class _Forked:
    """A rank forked by tests/rank_server.py, with the Popen calls _launch_ranks makes."""

    def __init__(self, server: "_RankServer", key: int, pid: int):
        self.server, self.key, self.pid, self.returncode = server, key, pid, None

    def poll(self):
        if self.returncode is None:
            self.returncode = self.server.code(self.key)
        return self.returncode

    def kill(self):
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def wait(self, timeout: float = 60):
        end = time.monotonic() + timeout
        while self.poll() is None and time.monotonic() < end:
            time.sleep(0.02)
        return self.returncode


class _RankServer:
    """The client of tests/rank_server.py: one server per pytest process, started at its
    first launch with that launch's environment; launches with another environment (a test
    that set a variable) start plain processes instead."""

    def __init__(self, env: dict):
        self.env = _job_env(env)
        self.proc = subprocess.Popen([sys.executable, "-u", os.path.join(ROOT, "tests",
                                                                         "rank_server.py")],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=ROOT,
                                     env={**env, "PYTHONUNBUFFERED": "1"})
        self.lock = threading.Condition()
        self.pids: dict[int, int] = {}
        self.codes: dict[int, int] = {}
        self.keys = itertools.count()
        self.dead = False                 # the server's output ended: its ranks are gone
        self.ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        if not self.ready.wait(180):
            self.proc.kill()
            raise RuntimeError("tests/rank_server.py did not start")

    def _read(self):
        for line in self.proc.stdout:
            msg = json.loads(line)
            with self.lock:
                if "ready" in msg:
                    self.ready.set()
                elif "started" in msg:
                    self.pids[msg["started"]] = msg["pid"]
                elif "ended" in msg:
                    self.codes[msg["ended"]] = msg["code"]
                self.lock.notify_all()
        with self.lock:
            self.dead = True
            self.lock.notify_all()

    def serves(self, env: dict) -> bool:
        return self.proc.poll() is None and _job_env(env) == self.env

    def code(self, key: int):
        with self.lock:
            if key not in self.codes and self.dead:
                return -signal.SIGKILL
            return self.codes.get(key)

    def start(self, script: str, args, env: dict, cwd: str, log: str,
              err: str | None = None) -> _Forked:
        key = next(self.keys)
        req = {"id": key, "script": str(script), "args": [str(a) for a in args], "env": env,
               "cwd": str(cwd), "log": str(log), **({"err": str(err)} if err else {})}
        with self.lock:
            self.proc.stdin.write((json.dumps(req) + "\n").encode())
            self.proc.stdin.flush()
            if not self.lock.wait_for(lambda: key in self.pids or self.dead, 60) \
                    or key not in self.pids:      # never a made-up pid: kill(-1) is everyone
                raise RuntimeError("tests/rank_server.py did not fork a rank")
        return _Forked(self, key, self.pids[key])

    def close(self):
        try:
            self.proc.stdin.close()
            self.proc.wait(60)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()


_SERVER: list = []


def rank_server(env: dict):
    """The server for a launch with this environment, or None (start plain processes)."""
    if os.environ.get("NNCOMPILE_TEST_FORK", "1") == "0":
        return None
    if not _SERVER:
        _SERVER.append(_RankServer(env))
        atexit.register(_SERVER[0].close)
    return _SERVER[0] if _SERVER[0].serves(env) else None


def launch(script, nproc, args, env, cwd, timeout, split_stderr: bool = False):
    """The ranks as torchrun starts them (its environment variables; rank 0 hosts the store,
    as env:// does without an agent), without torchrun's agent process, forked from a server
    that has imported torch and nncompile once (tests/rank_server.py; NNCOMPILE_TEST_FORK=0:
    fresh interpreters). When a rank fails, the others get 30 s to fail on their own (their
    next collective breaks), then are stopped, as torchrun stops them. Returns (the first
    non-zero exit code or 0, every rank's output, rank by rank), and with `split_stderr`
    every rank's standard error apart as a third item."""
    port = free_port()
    common = {**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
              "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0",
              "GROUP_WORLD_SIZE": "1", "ROLE_NAME": "default", "ROLE_WORLD_SIZE": str(nproc),
              "PYTHONUNBUFFERED": "1"}
    server = rank_server(common)
    with tempfile.TemporaryDirectory() as logs:
        names = [os.path.join(logs, f"rank{r}.log") for r in range(nproc)]
        errs = [os.path.join(logs, f"rank{r}.err") if split_stderr else None
                for r in range(nproc)]
        procs = []
        for r in range(nproc):
            rank_env = {**common, "RANK": str(r), "LOCAL_RANK": str(r), "ROLE_RANK": str(r)}
            if server is not None:
                procs.append(server.start(os.path.join(ROOT, script), args, rank_env, cwd,
                                          names[r], errs[r]))
            else:
                with open(names[r], "w") as f, open(errs[r] or os.devnull, "w") as e:
                    procs.append(subprocess.Popen(
                        [sys.executable, "-u", os.path.join(ROOT, script), *args], cwd=cwd,
                        stdout=f, stderr=e if split_stderr else subprocess.STDOUT,
                        env=rank_env))
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
        out, err = [], []
        for name, ename in zip(names, errs):
            with open(name) as f:
                out.append(f.read())
            if ename and os.path.exists(ename):
                with open(ename) as f:
                    err.append(f.read())
    codes = [p.returncode for p in procs]
    code = next((c for c in codes if c != 0), 0)
    return (code, "".join(out), "".join(err)) if split_stderr else (code, "".join(out))
