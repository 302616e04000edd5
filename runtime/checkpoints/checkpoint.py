"""save_checkpoint / load_checkpoint: one directory per checkpoint, written atomically.

    save_checkpoint("ckpt/step100", pm, opt, format="dcp", extra={"step": 100})
    extra = load_checkpoint("ckpt/step100", pm, opt)

Formats (`checkpoint.json` in the directory says which):
    sharded  rank{r}.pt = {"model": pm.state_dict(), "optimizer": opt.state_dict(), "extra"}
             loads into a plan whose every rank holds the same shards (per parameter: full
             shape, placement, slices; same world size), wherever it was compiled
    deduped  rank{r}.pt, each distinct shard stored once across the job (dedup.py);
             same shards on load
    dcp      torch.distributed.checkpoint files (dcp.py); loads under any plan, policy,
             pipeline or world size
A merged file (`python -m nncompile merge`, or merge_state_dicts) loads under any plan too.
Under a pipeline every format holds each rank's stages; the ranks of all stages together hold
the model (merging needs every stage's files).

Every rank writes into `.<name>.partial/`; after a barrier rank 0 writes `checkpoint.json` and
renames the directory into place. A job that dies mid-save leaves the previous checkpoint
untouched and the partial directory without `checkpoint.json`, which load_checkpoint refuses.
"""
from __future__ import annotations

import collections
import contextlib
import json
import os
import pickle
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from nncompile.errors import CheckpointError
from nncompile.fileio import replace_dir, write_json

from .async_checkpoint import start as start_async, wait_pending
from .dcp import dcp_state, load_dcp, load_state, read_metadata, save_dcp, save_planner
from .dedup import deduped_state_dict, load_deduped_state_dict
from ..protocol.lockstep import meet
from .merge import load_merged_state_dict, merge_state_dicts, merged_optimizer
from .resume_state import gather, restore
from nncompile.rows import param_rows
from .state import (GROUP_FQNS, describe, group_fqns, hyper, plan_mismatch, state_like_params,
                    with_members, without_members)
from ..store.holders import plan_info
from ..optim.adoption import adopt
from ..protocol.outcomes import agree_on_outcome

FORMATS = ("sharded", "deduped", "dcp")
META = "checkpoint.json"


def _rank_world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def save_torch(obj: Any, path: Path) -> None:
    """torch.save to a temporary name in the same directory, then rename (the temporary file
    is removed if either fails)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def load_torch(path: str | os.PathLike, map_location=None) -> Any:
    """torch.load with weights_only=True: tensors, numbers, strings, bools, None and
    lists/tuples/dicts of them (what every nncompile format stores) load; anything else in the
    file is refused with a CheckpointError instead of being run, so a checkpoint or merged file
    from someone else cannot execute code."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path} does not exist")
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(
            f"{path} contains objects nncompile does not load ({_why(e)}); nncompile loads "
            "checkpoints with torch.load(weights_only=True), which only accepts tensors, "
            "numbers, strings, bools, None and lists/tuples/dicts of them, so loading never "
            "runs code from the file. Only if you trust the file, load it yourself with "
            "torch.load(..., weights_only=False)") from e
    except (RuntimeError, OSError, EOFError, ValueError) as e:
        raise CheckpointError(f"{path} is truncated or corrupted ({type(e).__name__}: "
                              f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}); "
                              "load an earlier checkpoint") from e


def load_on_every_rank(path: Path, map_location=None) -> Any:
    """load_torch of this rank's file; if any rank's file fails, every rank raises the same
    CheckpointError naming each failed file (no rank goes on alone into a collective)."""
    error, blob = None, None
    try:
        blob = load_torch(path, map_location=map_location)
    except CheckpointError as e:
        error = str(e)
    if dist.is_initialized() and dist.get_world_size() > 1:
        errors: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
    else:
        errors = [error]
    failed = [(r, msg) for r, msg in enumerate(errors) if msg is not None]
    if failed:
        raise CheckpointError("loading the checkpoint failed on "
                              + "; ".join(f"rank {r}: {msg}" for r, msg in failed))
    return blob


def _why(e: Exception) -> str:
    """The line of a weights_only UnpicklingError that names what was refused (its first line
    is a generic note about torch's default)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    named = [ln for ln in lines if "global" in ln.lower() or "unsupported" in ln.lower()]
    return (named or lines or [type(e).__name__])[0]


ALLOWED_EXTRA = "tensors, numbers, strings, bools, None and lists/tuples/dicts of them"


def check_extra(extra: Any, where: str = "extra") -> None:
    """Raise CheckpointError naming the first value in `extra` that load_torch would refuse."""
    if extra is None or type(extra) in (bool, int, float, complex, str):
        return
    if isinstance(extra, torch.Tensor) and type(extra) in (torch.Tensor, torch.nn.Parameter):
        return
    if type(extra) in (list, tuple, torch.Size):
        for i, v in enumerate(extra):
            check_extra(v, f"{where}[{i}]")
        return
    if type(extra) in (dict, collections.OrderedDict):
        for k, v in extra.items():
            if not (k is None or type(k) in (bool, int, float, str)):
                raise CheckpointError(
                    f"{where} has a key {k!r} of type {type(k).__qualname__}; checkpoint "
                    f"extra= keys must be strings or numbers")
            check_extra(v, f"{where}[{k!r}]")
        return
    raise CheckpointError(
        f"{where} is a {type(extra).__module__}.{type(extra).__qualname__}; checkpoint extra= "
        f"may only hold {ALLOWED_EXTRA} (checkpoints load with torch.load(weights_only=True), "
        "which never runs code from the file). Store it as one of those, e.g. a number, a "
        "string or a tensor" + ("; a DTensor (an EMA of pm's parameters) as its local shard, "
                                "x.to_local(), in a sharded checkpoint (each rank keeps its own; "
                                "DTensor.from_local(shard, p.device_mesh, p.placements) rebuilds "
                                "it), or whole as x.full_tensor()"
                                if isinstance(extra, DTensor) else ""))




def _os_error(e: OSError) -> str:
    return f"{e.strerror or type(e).__name__}: {e.filename}" if e.filename else str(e)


def _make_staging(target: Path, staging: Path) -> str | None:
    """Rank 0 creates the empty staging directory next to `target`; what went wrong, in words
    with the fix, or None."""
    if target.exists() and not target.is_dir():
        return (f"{target} exists and is not a directory; pass a new path or a checkpoint "
                "directory to replace")
    blocker = next((p for p in target.parents if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        return (f"{blocker} is a file, not a directory, so no directory can be created under "
                "it; pass a path whose parents are directories")
    try:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        with open(staging / ".probe", "wb"):
            pass
        (staging / ".probe").unlink()
    except OSError as e:
        shutil.rmtree(staging, ignore_errors=True)
        return (f"cannot create and write the directory {staging} ({_os_error(e)}); pass a "
                "path in a directory you can write to")
    return None


@contextlib.contextmanager
def staged_directory(directory: str | os.PathLike, pm, meta: dict):
    """Every rank writes into the yielded `.<name>.partial/`; once all have, rank 0 adds
    checkpoint.json (`meta` plus the world size and the plan) and renames it to `directory`.

    Each step ends with `agree_on_outcome` (outcomes.py) instead of a barrier: a directory rank 0 cannot create, a
    rank's write that fails, or a failed rename is the same CheckpointError on every rank at
    once (not a raw OSError on one rank while the others wait out the timeout), and the
    staging directory is removed, so `directory` and any checkpoint there stay untouched."""
    rank, world = _rank_world()
    target = Path(directory).absolute()
    staging = target.with_name(f".{target.name}.partial")
    what = f"cannot save a checkpoint to {target}"
    agree_on_outcome(_make_staging(target, staging) if rank == 0 else None, what)
    error, cause = None, None
    try:
        yield staging
    except Exception as e:  # noqa: BLE001 - told to every rank below, then raised
        error, cause = f"{type(e).__name__}: {e}", e
    try:
        agree_on_outcome(error, f"saving the checkpoint {target} failed")
    except CheckpointError as e:
        if rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
        if cause is not None and not isinstance(cause, OSError):
            raise cause             # this rank's own error as it was; the others name it
        raise e from cause
    error = None
    if rank == 0:
        try:
            put_in_place(staging, target, pm, meta, world)
        except OSError as e:
            shutil.rmtree(staging, ignore_errors=True)
            error = (f"moving the finished checkpoint into place failed ({_os_error(e)}); "
                     "the previous contents of the path are unchanged")
    agree_on_outcome(error, what)


def put_in_place(staging: Path, target: Path, pm, meta: dict, world: int) -> None:
    """Rank 0, once every rank has written `staging`: checkpoint.json (`meta`, the world size,
    the plan), then the rename that makes the checkpoint visible."""
    info = plan_info(pm)
    write_json(staging / META, {
        **meta, "world_size": world,
        "plan": {k: info[k] for k in ("policy", "plan_ngpus", "runtime_ngpus", "pipe_ranks",
                                      "fingerprint")}})
    replace_dir(staging, target)


def _start_async_save(directory, pm, optimizer, meta: dict, side: dict):
    """The async_save=True path of save_checkpoint (async_checkpoint.py)."""
    rank, world = _rank_world()
    if not dist.is_initialized():
        raise CheckpointError("async_save=True writes through torch.distributed.checkpoint's "
                              "async_save, which needs torch.distributed: launch with torchrun "
                              "and init_distributed() first, or save synchronously")
    target = Path(directory).absolute()
    staging = target.with_name(f".{target.name}.partial")
    agree_on_outcome(_make_staging(target, staging) if rank == 0 else None,
          f"cannot save a checkpoint to {target}")
    state = dcp_state(pm, optimizer, snapshot_buffers=True)

    def finish() -> None:
        save_torch(side, staging / "extra.pt")
        put_in_place(staging, target, pm, meta, world)
    return start_async(target, staging, state, save_planner(), finish if rank == 0 else None)


def save_checkpoint(directory: str | os.PathLike, pm, optimizer=None, *, format: str = "sharded",
                    extra: dict | None = None, data=None, rng: bool = True,
                    async_save: bool = False):
    """Save `pm` (and its optimizer) under `directory`; every rank calls it. `extra` (a step
    count, ...) comes back from load_checkpoint. Every rank's random-number state (rng=True)
    and the state of `data` (a DataParallelSampler, a StatefulDataLoader) go in too, and
    load_checkpoint puts them back (resume_state.py). Returns the directory; with
    async_save=True (format="dcp") it returns once the state is copied, and the
    AsyncCheckpoint it returns is written in the background (async_checkpoint.py)."""
    if format not in FORMATS:
        raise CheckpointError(f"format={format!r}; choose one of {FORMATS}")
    if async_save and format != "dcp":
        raise CheckpointError(f"async_save=True writes through torch.distributed.checkpoint: "
                              f"pass format=\"dcp\" (not {format!r}), or async_save=False")
    check_extra(extra)
    wait_pending()                      # one save in flight at a time
    meet(pm, "save_checkpoint")         # a rank still evaluating alone: its forwards first
    resume = gather(data, rng)
    check_extra(resume, "data.state_dict()")
    rank, _ = _rank_world()
    meta = {"format": format, "has_optimizer": optimizer is not None,
            **(_optimizer_layout(pm, optimizer) if optimizer is not None else {})}
    if async_save:
        groups = _all_members(pm, optimizer) if optimizer is not None else []
        side = {"param_groups": groups, "extra": extra, "plan": plan_info(pm), "resume": resume}
        return _start_async_save(directory, pm, optimizer, meta, side)
    with staged_directory(directory, pm, meta) as staging:
        if format == "sharded":
            save_torch({"model": pm.local_state_dict(),
                        "optimizer": with_members(pm, optimizer, optimizer.state_dict())
                        if optimizer is not None else None,
                        "extra": extra, "resume": resume}, staging / f"rank{rank}.pt")
        elif format == "deduped":
            model, opt = deduped_state_dict(pm, optimizer)
            save_torch({"model": model, "optimizer": opt, "extra": extra, "resume": resume},
                       staging / f"rank{rank}.pt")
        else:
            save_dcp(str(staging), pm, optimizer)
            groups = _all_members(pm, optimizer) if optimizer is not None else []  # collective
            if rank == 0:
                save_torch({"param_groups": groups, "extra": extra, "plan": plan_info(pm),
                            "resume": resume}, staging / "extra.pt")
    return Path(directory).absolute()


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint directory under `root`, or None when there is none.

    Complete: save_checkpoint finished it (it has checkpoint.json and is no `.NAME.partial`
    staging directory), its checkpoint.json parses, and the files it names are there and not
    empty (every rank's rank{r}.pt; a dcp checkpoint's .metadata and extra.pt); an
    interrupted or damaged save is skipped. Newest: the largest number at the end of the name
    (step_900 < step_1000); among names without one, the last completed (checkpoint.json's
    time). A resume script calls it on every rank:

        path = nncompile.latest_checkpoint("ckpt")
        extra = nncompile.load_checkpoint(path, pm, opt) if path else None
    """
    root = Path(root)
    if not root.is_dir():
        return None
    done = [d for d in root.iterdir()
            if d.is_dir() and not d.name.startswith(".") and _complete(d)]
    if not done:
        return None

    def order(d: Path) -> tuple:
        m = re.search(r"(\d+)$", d.name)
        return (m is not None, int(m[1]) if m else 0, (d / META).stat().st_mtime_ns, d.name)
    return max(done, key=order).absolute()


def read_meta(directory: Path) -> dict:
    meta = directory / META
    partial = directory.with_name(f".{directory.name}.partial")
    if not directory.exists() and not partial.exists():
        raise CheckpointError(f"{directory} does not exist")
    if not meta.exists():
        hint = f" ({partial} is an unfinished save)" if partial.exists() else ""
        raise CheckpointError(f"{directory} is not a complete nncompile checkpoint: it has no "
                              f"{META}{hint}; load an earlier checkpoint")
    try:
        info = json.loads(meta.read_bytes())
    except ValueError as e:                 # JSONDecodeError, UnicodeDecodeError
        raise CheckpointError(f"{meta} is not valid JSON ({e}): the file is truncated or "
                              f"corrupted, so {directory} is not a complete checkpoint; load "
                              "an earlier one (nncompile.latest_checkpoint skips it)") from e
    if not isinstance(info, dict) or not {"format", "world_size"} <= info.keys():
        raise CheckpointError(f"{meta} does not describe an nncompile checkpoint (it has no "
                              "'format' and 'world_size'); load an earlier checkpoint")
    return info


def _complete(directory: Path) -> bool:
    """Whether `directory` holds a finished save: its checkpoint.json parses and the files it
    names are there and not empty (checked by name and size, nothing is read)."""
    if not (directory / META).is_file():
        return False
    try:
        meta = read_meta(directory)
    except CheckpointError:
        return False
    if meta["format"] == "dcp":
        files = [".metadata", "extra.pt"]
    elif isinstance(meta["world_size"], int):
        files = [f"rank{r}.pt" for r in range(meta["world_size"])]
    else:
        return False
    return all((directory / f).is_file() and (directory / f).stat().st_size > 0 for f in files)


def load_checkpoint(path: str | os.PathLike, pm, optimizer=None, *, data=None,
                    rng: bool = True) -> dict | None:
    """Load a checkpoint directory (any format) or a merged file into `pm` and its optimizer;
    returns the `extra` it was saved with. Every rank calls it. A checkpoint directory also
    restores each rank's random-number state (rng=True) and `data`'s position
    (resume_state.py); a merged file holds neither."""
    wait_pending()                      # a save in flight finishes before state changes
    path = Path(path).absolute()
    if path.is_file():
        if data is not None:
            raise CheckpointError(f"{path} is a merged checkpoint, which holds no data state; "
                                  "load the checkpoint directory to restore data=")
        merged = load_torch(path, map_location="cpu")
        if not isinstance(merged, dict) or "model" not in merged:
            raise CheckpointError(f"{path} is not a merged checkpoint (no 'model' entry); "
                                  "make one with: python -m nncompile merge DIR -o FILE")
        load_merged_state_dict(pm, merged["model"], optimizer,
                               merged.get("optimizer") if optimizer is not None else None)
        return merged.get("extra")
    meta = read_meta(path)
    rank, world = _rank_world()
    if optimizer is not None and not meta.get("has_optimizer"):
        raise CheckpointError(f"{path} was saved without optimizer state; pass optimizer=None")
    if meta["format"] == "dcp":
        if not dist.is_initialized():
            raise CheckpointError(
                f"{path} is a dcp checkpoint, which loads through torch.distributed: launch "
                "with torchrun (also for one rank) and init_distributed() first, or merge it "
                "with `python -m nncompile merge DIR -o FILE` and load the merged file")
        load_dcp(str(path), pm, optimizer)
        side = load_torch(path / "extra.pt", map_location="cpu")
        if optimizer is not None:
            for group, saved in zip(optimizer.param_groups, side["param_groups"]):
                group.update(hyper(saved))
        restore(side.get("resume"), meta["plan"], plan_info(pm), data, rng, str(path))
        return side["extra"]
    if meta["world_size"] != world:
        _refuse(path, meta, pm, f"it was saved by {meta['world_size']} ranks")
    where = "cpu" if pm.device.type == "cpu" else pm.device     # torch.load refuses "cpu:0"
    blob = load_on_every_rank(path / f"rank{rank}.pt", map_location=where)
    saved_info = blob["model"].get("_extra_state") or {}
    check_shards(path, meta, pm, saved_info)
    if meta["format"] == "sharded" and optimizer is not None:
        _check_optimizer_layout(path, meta, saved_info, blob["optimizer"], pm, optimizer)
    if meta["format"] == "sharded":
        pm.load_local_state_dict(blob["model"])          # checks the plan first
        if optimizer is not None:
            adopt(optimizer)                             # (one built before parallelize)
            optimizer.load_state_dict(without_members(blob["optimizer"]))
            state_like_params(optimizer)
    else:
        load_deduped_state_dict(pm, blob["model"], optimizer, blob["optimizer"])
    restore(blob.get("resume"), meta["plan"], plan_info(pm), data, rng, str(path))
    return blob["extra"]


def check_shards(path: Path, meta: dict, pm, saved: dict) -> None:
    """Every rank compares the plan of its file's shards (`saved`, a plan_info) with its own
    (state.plan_mismatch); if any rank's differ, every rank raises, so none is left waiting in
    a collective. The plan fingerprint is not compared."""
    why = plan_mismatch(saved, plan_info(pm))
    whys = [why]
    if dist.is_initialized():
        whys = [None] * dist.get_world_size()
        dist.all_gather_object(whys, why)
    bad = next(((r, w) for r, w in enumerate(whys) if w is not None), None)
    if bad is not None:
        _refuse(path, meta, pm, f"rank {bad[0]}'s shards differ: {bad[1]}")


def _all_members(pm, optimizer) -> list[dict]:
    """The optimizer's groups' hyper-parameters with the members of every rank, by FQN in
    the module's parameter order (a collective)."""
    fqns = group_fqns(pm, optimizer)
    if fqns is not None:        # parts of a fused parameter: the original's FQN, once
        sources = {row.fqn: row.source for row in param_rows(pm)}
        fqns = [list(dict.fromkeys(sources.get(f, f) for f in g)) for g in fqns]
    every = [fqns]
    if dist.is_initialized():
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, fqns)
    order = {f: i for i, f in enumerate(pm.PARAM_ORDER)}
    groups = []
    for i, g in enumerate(optimizer.param_groups):
        out = hyper(g)
        if all(f is not None for f in every):
            members = {f for rank in every for f in rank[i]}
            out[GROUP_FQNS] = sorted(members, key=lambda f: order.get(f, len(order)))
        groups.append(out)
    return groups


def _optimizer_layout(pm, optimizer) -> dict[str, Any]:
    """How the optimizer state of a sharded checkpoint is cut: the ZeRO stage and whether a
    ZeroOptimizer (pieces of flattened tensors) or a plain optimizer holds it."""
    from ..optim.optimizer import ZeroOptimizer
    memory = getattr(pm, "memory", None)
    return {"zero": getattr(memory, "zero", 0) if pm.zero is None else 3,
            "zero_optimizer": isinstance(optimizer, ZeroOptimizer)}


def _check_optimizer_layout(path: Path, meta: dict, saved_info: dict, saved_opt: Any, pm,
                            optimizer) -> None:
    """A sharded checkpoint's optimizer state is each rank's own, cut for the ZeRO layout it
    was saved under; under another layout it cannot load (torch's own load_state_dict would
    fail with a ValueError about parameter groups, or load state into the wrong tensors).
    Refused before any tensor changes, on every rank alike (the layout is the job's)."""
    if "zero" in meta:
        saved = {"zero": meta["zero"], "zero_optimizer": meta["zero_optimizer"]}
    else:                           # saved before checkpoint.json recorded it
        saved = {"zero": 3 if "zero3" in saved_info else None,
                 "zero_optimizer": isinstance(saved_opt, dict) and "nncompile_zero" in saved_opt}
    mine = _optimizer_layout(pm, optimizer)
    if (saved["zero"] == 3) == (mine["zero"] == 3) and \
            saved["zero_optimizer"] == mine["zero_optimizer"]:
        return
    raise CheckpointError(
        f"{path} is a sharded checkpoint whose optimizer state was saved under "
        f"{_describe_layout(saved)}, but this module and optimizer run "
        f"{_describe_layout(mine)}. The sharded format is tied to its ZeRO layout: each "
        f"rank's file holds the optimizer state as that rank held it, so it only loads under "
        f"the same ZeRO layout. To change ZeRO stage, save in "
        f"a format that reshards: format='deduped' or format='dcp', or a merged file "
        f"(python -m nncompile merge {path} -o merged.pt, then load merged.pt); or load only "
        f"the model weights: load_checkpoint(path, pm) without the optimizer")


def _describe_layout(layout: dict) -> str:
    z = layout["zero"]
    if z == 3:
        return "ZeRO-3 (state of flat pieces of the parameters)"
    if layout["zero_optimizer"]:
        name = f"ZeRO-{z}" if z else ("offload_optimizer" if z == 0 else "ZeRO-1/2")
        return f"{name} (each rank's piece of the flattened parameters)"
    return "no ZeRO (state of whole parameters)"


def _refuse(path: Path, meta: dict, pm, why: str) -> None:
    fmt = meta["format"]
    raise CheckpointError(
        f"{path} is a {fmt} checkpoint of plan [{describe(meta['plan'])}] on "
        f"{meta['world_size']} ranks, but this module runs plan [{describe(plan_info(pm))}] "
        f"on {_rank_world()[1]} ranks; {why}. {fmt} checkpoints only load into a plan whose "
        f"ranks hold the same shards. Save with format='dcp' to load under another plan, or "
        f"merge it (python -m nncompile merge {path} -o merged.pt) and load merged.pt")


def rank_files(paths: list[str | os.PathLike]) -> list[Path]:
    """Expand checkpoint directories into their per-rank files, in rank order."""
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted(p.glob("rank*.pt"), key=lambda f: int(f.stem[4:] or 0))
            if not found and not (p / ".metadata").exists():
                raise CheckpointError(f"{p} has no rank*.pt files")
            files += found if found else [p]
        elif p.exists():
            files.append(p)
        else:
            raise CheckpointError(f"{p} does not exist")
    return files


def merge_lightning_checkpoints(ckpts: list[dict]) -> dict:
    """The rank files of one NnCompileStrategy checkpoint -> an ordinary Lightning checkpoint:
    the LightningModule's own state_dict keys, the optimizer indexed like its parameters()."""
    if any("state_dict" not in c or "_extra_state" not in c["state_dict"] for c in ckpts):
        raise CheckpointError("merge_checkpoint takes the rank files of an NnCompileStrategy "
                              "checkpoint (each with a state_dict carrying its plan)")
    opts = [c["optimizer_states"][0] for c in ckpts] if all(
        c.get("optimizer_states") for c in ckpts) else None
    model, opt = merge_state_dicts([c["state_dict"] for c in ckpts], opts)
    merged = {**ckpts[0], "state_dict": model}
    if opt is not None:
        merged["optimizer_states"] = [opt]
    return merged


def merge_checkpoint(paths: list[str | os.PathLike], output: str | os.PathLike) -> Path:
    """Per-rank files or checkpoint directories (sharded, deduped or dcp) -> one merged file
    {"model", "optimizer", "extra"} that the original module, or any plan, loads. A Lightning
    checkpoint of NnCompileStrategy becomes an ordinary Lightning checkpoint. Runs in a single
    process."""
    merged = merged_checkpoint(paths)
    out = Path(output).absolute()
    blocker = next((p for p in out.parents if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise CheckpointError(f"cannot write the merged checkpoint {out}: {blocker} is a file, "
                              "not a directory; pass an output path whose parents are "
                              "directories")
    if out.is_dir():
        raise CheckpointError(f"cannot write the merged checkpoint {out}: it is a directory; "
                              "pass a file path (e.g. merged.pt)")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        save_torch(merged, out)
    except OSError as e:
        raise CheckpointError(f"cannot write the merged checkpoint {out} ({_os_error(e)}); "
                              "pass a path in a directory you can write to") from e
    return out


def merged_checkpoint(paths: list[str | os.PathLike]) -> dict:
    """Per-rank files or checkpoint directories (sharded, deduped or dcp) -> the merged
    checkpoint in memory: {"model", "optimizer", "extra"}, or an ordinary Lightning checkpoint
    for an NnCompileStrategy one."""
    files = rank_files(paths)
    if len(files) == 1 and files[0].is_dir():
        merged = _merge_dcp(files[0])
    else:
        blobs = [load_torch(f, map_location="cpu") for f in files]
        if all(isinstance(b, dict) and "pytorch-lightning_version" in b for b in blobs):
            merged = merge_lightning_checkpoints(blobs)
        else:
            for f, b in zip(files, blobs):
                if not isinstance(b, dict) or "model" not in b:
                    raise CheckpointError(f"{f} is not an nncompile rank file (no 'model' "
                                          "entry)")
            opts = [b.get("optimizer") for b in blobs]
            model, opt = merge_state_dicts([b["model"] for b in blobs],
                                           opts if all(o is not None for o in opts) else None)
            merged = {"model": model, "optimizer": opt, "extra": blobs[0].get("extra")}
    return merged


def _merge_dcp(directory: Path) -> dict:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    side = load_torch(directory / "extra.pt", map_location="cpu")
    metadata = read_metadata(directory)
    flat = {k: torch.zeros(tuple(md.size), dtype=md.properties.dtype)
            for k, md in metadata.items() if isinstance(md, TensorStorageMetadata)}
    nested: dict[str, dict] = {"model": {}, "optim": {}}
    for key, t in flat.items():
        kind, rest = key.split(".", 1)
        if kind == "model":
            nested["model"][rest] = t
        else:
            fqn, entry = rest.rsplit(".", 1)
            nested["optim"].setdefault(fqn, {})[entry] = t
    with warnings.catch_warnings():     # loading in one process is the point here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        load_state(nested, directory, no_dist=True)
    info = side["plan"]
    model = {key: nested["model"][canon] for key, canon in info["state_keys"]
             if canon in nested["model"]}
    optimizer = None
    if nested["optim"]:
        optimizer = merged_optimizer(info["param_order"], nested["optim"],
                                     side["param_groups"])
    return {"model": model, "optimizer": optimizer, "extra": side["extra"]}
