"""Running conformance cells (tests/conformance.py): the torchrun launches of the process
cells, one cell's matrix row, the matrix as text, and the command line

    python tests/conformance.py --matrix [--cells a,b]     # every cell (or those), printed
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from conformance import BY_NAME, CELLS, HERE, PRETRAINED, ROOT, Cell, _short, run_plan
from conformance_reference import (FEATURES, Mismatch, _cell_text, compare, format_row,
                                   merged_on_one_device, pretrained_on_one_device)


def format_matrix(rows: dict[str, dict], times: dict[str, float] | None = None) -> str:
    """plan x feature -> max abs error (ERR: the first line of what raised)."""
    short = {"resume:sharded": "r:sharded", "resume:deduped": "r:deduped", "resume:dcp": "r:dcp",
             "resume:merged": "r:merged", "resume:pretrained": "r:hf"}
    heads = ["cell"] + [short.get(f, f) for f in FEATURES] + (["s"] if times else [])
    lines, errors = [], []
    for name, row in rows.items():
        cells = [name]
        for f in FEATURES:
            if isinstance(row.get(f), str):
                errors.append(f"  {name} {f}: {row[f]}")
            cells.append(_cell_text(row, f))
        first = row.get("first mismatch", "")
        if first and not any(first.endswith(e.split(": ", 1)[1]) for e in errors):
            errors.append(f"  {name} first mismatch: {first}")
        if times:
            cells.append(f"{times.get(name, 0):.1f}")
        lines.append(cells)
    width = [max(len(r[i]) for r in [heads] + lines) for i in range(len(heads))]
    fmt = lambda r: " ".join(c.ljust(w) for c, w in zip(r, width))  # noqa: E731
    notes = ["(max |parallel - one device|; ! out of tolerance; - not applicable" +
             (f"; s: seconds, {sum(times.values()):.0f} in all" if times else "") + ")"]
    return "\n".join([fmt(heads)] + [fmt(r) for r in lines] + notes +
                     (["errors:"] + list(dict.fromkeys(errors)) if errors else []))


# ---- the torchrun launch ----------------------------------------------------------------------
def launch(workdir: Path, names: list[str], timeout: int = 600, ranks=None
           ) -> tuple[dict, str]:
    """Run the process cells, one launch per world size (their runtime ranks), cell `name` in
    workdir / name; ({cell: [records per rank]}, the launches' output). `ranks(script, nproc,
    *args, timeout=)` starts the ranks and returns (exit code, output): the test suite's
    launcher (tests/conftest.py, ranks forked from a server), else torchrun."""
    results, outs = {}, []
    for world in sorted({BY_NAME[n].runtime for n in names}):
        got, out = _launch(workdir, [n for n in names if BY_NAME[n].runtime == world], world,
                           timeout, ranks or _torchrun)
        results.update(got)
        outs.append(out)
    return results, "\n".join(outs)


def _torchrun(script: str, nproc: int, *args: str, timeout: int) -> tuple[int, str]:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           f"--master_port={port}", script, *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NNCOMPILE_QUIET": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr


def _launch(workdir: Path, names: list[str], world: int, timeout: int, ranks
            ) -> tuple[dict, str]:
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        _, out = ranks(str(HERE / "workers" / "conformance.py"), world, "--workdir",
                       str(workdir), "--cells", ",".join(names), timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out = f"timed out after {timeout}s\n{e.stdout or ''}{e.stderr or ''}"
    results = {}
    for name in names:
        files = sorted((workdir / name).glob("records.rank*.pt"))
        results[name] = [torch.load(f, weights_only=False) for f in files]
    return results, out


def run_cell(cell: Cell, workdir: Path, launched: dict | None = None) -> tuple[dict, float]:
    """(matrix row, seconds) of one cell; raises Mismatch or what the plan raised."""
    t0 = time.time()
    if cell.process:
        records = (launched or {}).get(cell.name) or []
        errors = [r["error"] for r in records if "error" in r]
        if errors or len(records) != cell.runtime:
            raise RuntimeError(f"{cell.name}: " + (errors[0] if errors else
                                                   f"{len(records)} ranks reported"))
    else:
        records = run_plan(cell, workdir)
    merged = merged_on_one_device(cell, workdir) if "merged" in cell.loop.formats else None
    pretrained = pretrained_on_one_device(cell, workdir) \
        if PRETRAINED in cell.loop.formats else None
    return compare(cell, records, merged, pretrained), time.time() - t0


def main() -> None:
    import argparse
    import tempfile
    import conformance
    ap = argparse.ArgumentParser(description=conformance.__doc__.split("\n")[0])
    ap.add_argument("--matrix", action="store_true", help="run every cell, print the matrix")
    ap.add_argument("--cells", default="", help="comma-separated cell names (default: all)")
    args = ap.parse_args()
    os.environ.setdefault("NNCOMPILE_QUIET", "1")
    torch.set_num_threads(1)
    names = [n for n in args.cells.split(",") if n] or [c.name for c in CELLS]
    rows, times = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        procs = [n for n in names if BY_NAME[n].process]
        t0 = time.time()
        launched, out = launch(tmp, procs) if procs else ({}, "")
        if procs:
            times["(torchrun launch)"] = time.time() - t0
            if not all(launched.values()):
                print(out[-3000:], file=sys.stderr)
        for name in names:
            cell = BY_NAME[name]
            t0 = time.time()
            try:
                rows[name], _ = run_cell(cell, tmp / name, launched)
            except Mismatch as e:
                rows[name] = e.row
            except Exception as e:                         # noqa: BLE001 - reported
                rows[name] = {"train": _short(e)}
            times[name] = time.time() - t0
            print(format_row(name, rows[name]), file=sys.stderr, flush=True)
    print(format_matrix(rows, times))
    if procs:
        print(f"the process cells ran in torchrun launches (one per world size) of "
              f"{times['(torchrun launch)']:.0f}s (in the total)")
