"""A process that has imported torch, nncompile and transformers once, and forks the tests' ranks.

Each rank of a launch used to be a fresh interpreter that spent 3-6 s of CPU importing the same
libraries before its first line ran; on a 2-core machine that was a large part of the suite.
The launcher (rank_launch.py: the tests', and doc_runner.py's for a page's torchrun commands)
starts this server once per process and sends it one
JSON line per rank:

    {"id": ..., "script": ..., "args": [...], "env": {...}, "cwd": ..., "log": ...[, "err": ...]}

The server forks; the child becomes what `python -u script args...` would be (its environment,
working directory, argv, sys.path[0], stdout to `log` and stderr to `err` or else `log`, stdin
from /dev/null, fresh `random` state) and runs the script as `__main__`, ending as an interpreter ends (exit code,
traceback, atexit handlers, non-daemon threads joined). The server answers
{"started": id, "pid": pid} and, when the child ends, {"ended": id, "code": code} (a negative
code is the signal that ended it, as subprocess reports).

Only launches whose environment equals the server's (apart from the per-rank variables) come
here; the launcher starts the others as plain processes, so a variable read at import time is never
missed.
"""
from __future__ import annotations

import json
import os
import select
import sys
import time

import torch                                     # the libraries every rank imports

_FRESH_RNG = torch.get_rng_state()               # torch's default generator as a fresh process has it
import torch.distributed                          # noqa: E402,F401
import nncompile                                  # noqa: E402,F401
import nncompile.runtime                          # noqa: E402,F401
try:                                              # the Hugging Face models the tests build
    import transformers                           # noqa: F401
    from transformers.models.gpt2 import modeling_gpt2  # noqa: F401
    from transformers.models.llama import modeling_llama  # noqa: F401
except ImportError:                               # pragma: no cover - the scripts import it
    pass


def _become(req: dict) -> None:
    """In the child: turn into the rank process the request describes, then run it."""
    import random
    import runpy
    log = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    err = os.open(req["err"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644) \
        if req.get("err") else log
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(err, 2)
    os.close(log)
    if err != log:
        os.close(err)
    os.close(null)
    os.environ.clear()
    os.environ.update(req["env"])
    os.chdir(req["cwd"])
    random.seed()
    torch.set_rng_state(_FRESH_RNG)
    script = os.path.abspath(req["script"])
    sys.argv = [script, *req["args"]]
    sys.path[0] = os.path.dirname(script)
    runpy.run_path(script, run_name="__main__")


def main() -> None:
    children: dict[int, str] = {}
    out = sys.stdout

    def say(msg: dict) -> None:
        out.write(json.dumps(msg) + "\n")
        out.flush()

    say({"ready": os.getpid()})
    stdin, buf = sys.stdin.fileno(), b""
    while stdin is not None or children:
        if stdin is None:
            time.sleep(0.05)
        elif select.select([stdin], [], [], 0.05)[0]:
            chunk = os.read(stdin, 1 << 16)
            if not chunk:              # the tests are done: wait for what still runs
                stdin = None
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                req = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    _become(req)       # the child ends as the script's interpreter would
                    raise SystemExit(0)
                children[pid] = req["id"]
                say({"started": req["id"], "pid": pid})
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            say({"ended": children.pop(pid), "code": os.waitstatus_to_exitcode(status)})

if __name__ == "__main__":
    main()
