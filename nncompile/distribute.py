"""Generated files reach every node, whether or not the nodes share a disk.

Only rank 0 compiles into `<gen_savedir>/<instance>/`; every rank then imports its own
`gencode{rank}.py` from that path, resolved against its own working directory. On nodes without
a shared disk the path is missing (or stale), so `share_generated` runs after rank 0 compiled
or reused:

1. rank 0 broadcasts the sha256 of each generated file (gencode*.py, manifest.json, plan.json,
   plan_report.txt, graphs/*): a few hundred bytes;
2. every rank checks whether it sees exactly those files and all-gathers (sees?, node key); the
   node key is (GROUP_RANK, hostname, resolved directory), so two torchrun "nodes" on one host
   with different working directories count as two;
3. if every rank sees them (a shared disk, or a copy from an earlier run) nothing is sent.
   Otherwise rank 0 sends the files' bytes and sha256s point to point to one writer per node
   that lacks them (the node's lowest rank, its LOCAL_RANK 0), which checks each sha256 and
   writes a staging directory renamed into place (fileio.staged_dir); the node's other ranks
   wait at the barrier of step 4;
4. every rank looks for its own file again; if any rank still cannot see it, every rank raises
   the same NNCompileError (so none is left waiting in a later collective).
"""
from __future__ import annotations

import hashlib
import json
import os
import socket
import warnings
from pathlib import Path

import torch.distributed as dist

from .edits import keep_edited
from .errors import EditedCodeWarning, NNCompileError
from .fileio import staged_dir
from .log import log

TOP_LEVEL = ("manifest.json", "plan.json", "plan_report.txt")


def generated_files(outdir: Path) -> list[str]:
    """The files of an instance directory that travel, as paths relative to it."""
    names = [p.name for p in outdir.glob("gencode*.py")] + \
        [n for n in TOP_LEVEL if (outdir / n).is_file()]
    names += [f"graphs/{p.name}" for p in (outdir / "graphs").glob("*") if p.is_file()]
    return sorted(names)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _sees(outdir: Path, digest: dict[str, str]) -> bool:
    """Does this process see exactly rank 0's files (same names, same bytes)?"""
    try:
        return all(_sha256((outdir / name).read_bytes()) == sha for name, sha in digest.items())
    except OSError:
        return False


def _node_key(outdir: Path) -> tuple[str, str, str]:
    return (os.environ.get("GROUP_RANK", ""), socket.gethostname(), str(outdir.resolve()))


def _write(outdir: Path, files: dict[str, tuple[bytes, str]]) -> None:
    """Write the received files into outdir atomically (staging directory, then rename)."""
    for name, (data, sha) in files.items():
        if _sha256(data) != sha:
            raise NNCompileError(f"{name} arrived corrupted (sha256 mismatch)")
    with staged_dir(outdir) as staging:
        for name, (data, _) in files.items():
            (staging / name).parent.mkdir(parents=True, exist_ok=True)
            (staging / name).write_bytes(data)
            os.chmod(staging / name, 0o644)
        old = outdir / "manifest.json"
        try:
            kept = keep_edited(outdir, json.loads(old.read_text()), staging) \
                if old.is_file() else []
        except (OSError, ValueError):
            kept = []
    if kept:
        warnings.warn(f"rank 0's generated code replaced edited file(s) {', '.join(kept)} in "
                      f"{outdir} on {socket.gethostname()}; the edited versions are kept in "
                      f"{outdir / 'edited'}. Edit the files on rank 0's node.",
                      EditedCodeWarning, stacklevel=3)


def missing_rank_file(outdir: Path, rank: int) -> str | None:
    """Why this rank cannot load its generated file, or None when it is there."""
    path = outdir / f"gencode{rank}.py"
    if path.is_file():
        return None
    return (f"rank {rank} on host {socket.gethostname()!r} cannot find its generated file "
            f"{path}. Rank 0 generates the files and sends them to each node's local rank 0, "
            f"which writes them there: use a gen_savedir that every node shares, or check that "
            f"local rank 0 of this node can write to {outdir.parent}.")


def require_rank_file(outdir: Path, rank: int) -> Path:
    """The path of `gencode{rank}.py` in outdir; NNCompileError naming host and path if absent."""
    problem = missing_rank_file(outdir, rank)
    if problem:
        raise NNCompileError(problem)
    return outdir / f"gencode{rank}.py"


def share_generated(outdir: Path) -> None:
    """Make rank 0's generated files visible at `outdir` on every rank (a collective)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    box = [None]
    if rank == 0:
        box[0] = {name: _sha256((outdir / name).read_bytes())
                  for name in generated_files(outdir)}
    dist.broadcast_object_list(box, src=0)
    digest: dict[str, str] = box[0]
    status: list = [None] * world
    dist.all_gather_object(status, (_sees(outdir, digest), _node_key(outdir)))
    if all(sees for sees, _ in status):
        return                                  # shared, or already identical: nothing sent
    lacking = {key for sees, key in status if not sees} - {status[0][1]}
    writers = sorted(min(r for r, (_, k) in enumerate(status) if k == key) for key in lacking)
    problem = None
    if rank == 0 and writers:
        files = {name: (outdir / name).read_bytes() for name in digest}
        log(f"sending {len(files)} generated files "
            f"({sum(map(len, files.values())) / 1e3:.0f} KB) to {len(writers)} node(s)")
        payload = [{name: (data, digest[name]) for name, data in files.items()}]
        for dst in writers:
            dist.send_object_list(payload, dst=dst)
    elif rank in writers:
        box = [None]
        dist.recv_object_list(box, src=0)
        try:
            _write(outdir, box[0])
            log(f"wrote {len(box[0])} generated files from rank 0 to {outdir}")
        except (OSError, NNCompileError) as e:
            if not _sees(outdir, digest):      # (another writer to the same disk may have won)
                problem = (f"rank {rank} on host {socket.gethostname()!r} could not write the "
                           f"generated files to {outdir}: {e}")
    dist.barrier()                              # the node's other ranks wait for its writer
    problems: list = [None] * world
    dist.all_gather_object(problems, problem or missing_rank_file(outdir, rank))
    problems = [p for p in problems if p]
    if problems:
        raise NNCompileError("generated files are missing on some nodes:\n  - "
                             + "\n  - ".join(problems))
