"""`torchrun --nproc_per_node=N script.py args...` for the documentation pages' bash blocks
(tests/doc_runner.py puts tests/shims first on their PATH): the ranks start as torchrun starts
them, forked from a process that has imported torch and nncompile once (tests/rank_launch.py)
instead of an agent and N fresh interpreters. doc_runner runs the launch and hands back the
ranks' standard output and error and whether they all exited 0 (exit status 1 otherwise, as
torchrun's). Any other torchrun option (--max-restarts, --nnodes, -m, ...) runs the real
torchrun, as does a launch where doc_runner's launcher is not there.
"""
from __future__ import annotations

import json
import os
import socket
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from rank_launch import recv_line  # noqa: E402  (stdlib only: no torch import here)


def plain_launch(argv: list[str]) -> tuple[int, str, list[str]] | None:
    """(N, script, its args) of `--nproc_per_node=N [--standalone] script args...`, else
    None."""
    nproc, i = 1, 0
    while i < len(argv):
        a = argv[i]
        if a.startswith(("--nproc_per_node=", "--nproc-per-node=")):
            value = a.split("=", 1)[1]
        elif a in ("--nproc_per_node", "--nproc-per-node") and i + 1 < len(argv):
            i += 1
            value = argv[i]
        elif a == "--standalone":
            i += 1
            continue
        elif a.startswith("-"):
            return None
        else:
            return nproc, a, argv[i + 1:]
        if not value.isdigit():
            return None
        nproc = int(value)
        i += 1
    return None


def main() -> None:
    argv = sys.argv[1:]
    found = plain_launch(argv)
    where = os.environ.get("NNCOMPILE_DOC_LAUNCHER")
    if found is None or not where or not os.path.exists(where):
        os.execv(sys.executable, [sys.executable, "-m", "torch.distributed.run", *argv])
    nproc, script, args = found
    env = {k: v for k, v in os.environ.items()}
    if nproc > 1:
        env.setdefault("OMP_NUM_THREADS", "1")        # as torchrun sets it
    req = {"nproc": nproc, "script": os.path.abspath(script), "args": args,
           "cwd": os.getcwd(), "env": env}
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(where)
        s.sendall((json.dumps(req) + "\n").encode())
        reply = json.loads(recv_line(s))
    sys.stdout.write(reply["stdout"])
    sys.stdout.flush()
    sys.stderr.write(reply["stderr"])
    sys.stderr.flush()
    sys.exit(1 if reply["code"] else 0)


if __name__ == "__main__":
    main()
