"""What the benchmarks share when they record a run: the command line that reproduces it and
an atomic write of the results file."""
from __future__ import annotations

import sys
from pathlib import Path

from nncompile.fileio import write_text


def command(script: str, world: int) -> str:
    """The torchrun command line of this run, less the options that only say where to
    write."""
    argv, out = sys.argv[1:], []
    while argv:
        a = argv.pop(0)
        if a in ("--results-dir", "--json"):
            argv = argv[1:]
        elif not a.startswith(("--results-dir=", "--json=")):
            out.append(a)
    return " ".join([f"torchrun --nproc_per_node={world} {script}"] + out)


def write_atomic(path: str, text: str) -> None:
    """Write through a temporary name, then rename: never a half-written results file."""
    write_text(Path(path), text)
