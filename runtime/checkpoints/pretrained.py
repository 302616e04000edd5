"""Hugging Face checkpoints in and out of any plan: safetensors files by original names.

    nncompile.save_pretrained(pm, "out")     # every rank: what model.save_pretrained("out")
                                             # writes, from tp / ZeRO-3 / pipeline shards
    nncompile.load_pretrained(pm, "ckpt")    # every rank reads only its slices

Saving walks the layout (nncompile/pretrained_layout.py) group by group: each group's full
tensors are gathered on every rank (a collective: plan all-gather, ZeRO-3 units holding them,
the expert axis, the pipeline broadcast), the model's weight conversions are reverted on
them, and the rank writing that file streams them in (SafetensorsWriter). File k of n is
written by rank k mod world size. No rank holds more than its shards plus one group.

Loading checks the whole checkpoint first on every rank (architecture, names, shapes, dtypes,
truncated files: the same error everywhere, before any weight changes), then reads each of this
rank's shards with safetensors' lazy slicing (`get_slice(name)[rows, cols]`), a converted group
(one layer's fused experts) whole and then sliced. Under ZeRO-3 only the rows holding the
elements of this rank's flat piece are read, straight into it.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from nncompile.errors import CheckpointError
from nncompile.fileio import write_text
from nncompile.log import log
from nncompile.pretrained_layout import (INDEX, WEIGHTS, Layout, config_files, converted_values,
                                         pretrained_models, plan_layout, reverter,
                                         stale_shards, weights_dtype)
from nncompile.rows import BufferRow, ParamRow, buffer_rows, param_rows, take
from nncompile.ir.placement import Shard
from nncompile.safetensors_file import SafetensorsWriter, read_header

from ..protocol.lockstep import meet
from .state import share_over_pipeline
from ..store.zero import all_gather_along

_SOURCE = "_nnc_pretrained_source"


def remember_pretrained(pm, module: torch.nn.Module | None) -> None:
    """Record the Hugging Face models inside `module` [(prefix, model)] on pm, for a caller
    that drops the module's children afterwards (the Lightning strategy)."""
    pm.__dict__[_SOURCE] = pretrained_models(module)


def pretrained_sources(pm) -> list[tuple[str, Any]]:
    """[(FQN prefix, Hugging Face model)] that pm was built from (outermost ones)."""
    if _SOURCE in pm.__dict__:
        return pm.__dict__[_SOURCE]
    return pretrained_models(pm.module)


def _rank_world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _all(obj: Any, local: bool = False) -> list[Any]:
    """obj of every rank (a collective when distributed and not `local`)."""
    rank, world = _rank_world()
    if world == 1 or local:
        return [obj]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj)
    return out


def _raise_if_any(error: str | None, what: str, local: bool = False) -> None:
    """Every rank raises the same CheckpointError if any rank failed (none goes on alone)."""
    failed = [(r, e) for r, e in enumerate(_all(error, local)) if e is not None]
    if failed and (local or _rank_world()[1] == 1):
        raise CheckpointError(failed[0][1])
    if failed:
        raise CheckpointError(f"{what} failed on " + "; ".join(f"rank {r}: {e}"
                                                               for r, e in failed))


# ---- the module's state: full shapes and dtypes -------------------------------------------
def _dtypes(pm) -> dict[str, torch.dtype]:
    """{local name: dtype} of this rank's parameters and buffers (under ZeRO-3 its unit's)."""
    out = {row.name: getattr(pm, row.name).dtype for row in buffer_rows(pm)}
    if pm.zero is not None:
        out.update({n: pm.zero.flat(u).dtype for u in pm.zero.units for n in u.layout.names})
    else:
        out.update({row.name: getattr(pm, row.name).dtype for row in param_rows(pm)})
    return out


def state_specs(pm, prefix: str) -> tuple[dict[str, tuple[tuple, torch.dtype]], dict[str, str],
                                          int]:
    """({state key without `prefix`: (full shape, dtype)}, {tied key: the key it shares}, the
    number of parameter elements, each tied weight once) for every key of the original
    module's state_dict() under `prefix`; every rank gets all of them (a pipeline rank holds
    only its stages': the ranks exchange theirs)."""
    dtypes = _dtypes(pm)
    mine = {row.source: (tuple(row.source_shape), str(dtypes[row.name]).split(".")[1],
                         isinstance(row, ParamRow))
            for row in [*param_rows(pm), *buffer_rows(pm)]}
    specs: dict[str, tuple] = {}
    for theirs in _all(mine):
        specs.update(theirs)
    state, aliases, unheld, counted = {}, {}, [], {}
    for key, canon in pm.STATE_KEYS:
        if not key.startswith(prefix):
            continue
        if canon not in specs:
            unheld.append(key)
            continue
        shape, dtype, is_param = specs[canon]
        state[key[len(prefix):]] = (shape, getattr(torch, dtype))
        if is_param:
            counted[canon] = math.prod(shape)
        if canon != key and canon.startswith(prefix):
            aliases[key[len(prefix):]] = canon[len(prefix):]
    if unheld:
        raise CheckpointError(f"the parallel module holds no tensor for the state keys "
                              f"{unheld[:3]}; they cannot be saved or loaded")
    return state, aliases, sum(counted.values())


def _source(pm, prefix: str | None) -> tuple[str, Any]:
    """(prefix, Hugging Face model) to save or load: the one model inside pm's module, the
    one at `prefix`, or an error when there are several and no prefix says which."""
    found = pretrained_sources(pm)
    if prefix is None:
        if len(found) > 1:
            trains = {p: any(q.requires_grad for q in m.parameters()) for p, m in found}
            listed = ", ".join(f"{p[:-1]!r} ({type(m).__name__}, "
                               f"{'trained' if trains[p] else 'frozen'})" for p, m in found)
            raise CheckpointError(
                f"the module holds {len(found)} Hugging Face models: {listed}; pass "
                f"prefix= to say which one to save or load, e.g. prefix="
                f"{next((p for p, _ in found if trains[p]), found[0][0])!r}")
        return (found[0] if found else ("", None))
    model = next((m for p, m in found if p == prefix), None)
    return prefix, model


def _layout(pm, prefix, max_shard_size="50GB") -> tuple[str, Any, dict, Layout]:
    prefix, model = _source(pm, prefix)
    state, aliases, nparams = state_specs(pm, prefix)
    if not state:
        raise CheckpointError(f"the module has no state keys under the prefix {prefix!r}")
    return prefix, model, state, plan_layout(state, aliases, model, max_shard_size, nparams)


# ---- out ----------------------------------------------------------------------------------
def rows_by_source(pm) -> dict[str, list]:
    """{original FQN: this rank's parameter rows (its parts) or buffer row of it}."""
    out: dict[str, list] = {}
    for row in [*param_rows(pm), *buffer_rows(pm)]:
        out.setdefault(row.source, []).append(row)
    return out


def gather_state(pm, fqns, by_source: dict[str, list] | None = None
                 ) -> dict[str, torch.Tensor]:
    """{FQN: full tensor} of the parameters and persistent buffers `fqns` on every rank (a
    collective: every rank of the job calls it with the same FQNs); under ZeRO-3 only these
    tensors' elements travel, not their units. A whole tensor may be pm's own (read it).
    `by_source`: rows_by_source(pm), computed once for many calls."""
    by_source = rows_by_source(pm) if by_source is None else by_source
    mine = [r for f in fqns for r in by_source.get(f, [])]
    rows = [r for r in mine if not isinstance(r, BufferRow)]
    if pm.zero is not None:
        local = {r.name: pm.zero.local_tensor(r.name) for r in rows}
    else:
        local = {r.name: getattr(pm, r.name).detach() for r in rows}
    full = pm._gather(local, rows, copy=False)
    buffers = {}
    for row in mine:
        if isinstance(row, BufferRow):
            t = getattr(pm, row.name).detach()
            if isinstance(row.placement, Shard) and pm.plan_group is not None:
                t = all_gather_along(t, row.placement.dim, pm.PLAN_NGPUS, pm.plan_group)
            buffers[row.fqn] = t
    full.update(share_over_pipeline(pm, buffers))
    return full


def save_pretrained(pm, out_dir: str | os.PathLike, config: Any = None, *,
                    max_shard_size: int | str = "50GB", prefix: str | None = None) -> Path:
    """Write what `model.save_pretrained(out_dir)` writes for the model pm was built from:
    `model.safetensors` (or `model-0000k-of-0000n.safetensors` + the index) by the original
    names, tied weights once, dtypes kept, the model's weight conversions reverted, and
    `config.json` (+ `generation_config.json`) for a Hugging Face model or when `config` (a
    config object or a dict) is given. Every rank calls it; each file appears complete or not
    at all. `prefix`: the FQN prefix of the saved model inside pm's module (found for a
    Hugging Face model; "" otherwise)."""
    meet(pm, "save_pretrained")         # a rank still evaluating alone: its forwards first
    prefix, model, state, layout = _layout(pm, prefix, max_shard_size)
    by_source = rows_by_source(pm)
    return write_pretrained(Path(out_dir), layout, model, (config, weights_dtype(state)),
                            lambda fqns: gather_state(pm, [prefix + k for k in fqns],
                                                      by_source), prefix)


def write_pretrained(out: Path, layout: Layout, model, config: tuple, full_of,
                     prefix: str = "", local: bool = False) -> Path:
    """The files of `layout` in `out`: file k written by rank k mod world size, from the full
    tensors `full_of(state keys)` returns group by group (on every rank: a collective for
    save_pretrained), then config.json ((config, dtype): config_files) and the index by
    rank 0, stale shards removed. local: this process alone writes every file (export, also
    inside a distributed job)."""
    rank, world = (0, 1) if local else _rank_world()
    error = None
    if rank == 0:
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            error = f"cannot create {out} ({e.strerror or e})"
    _raise_if_any(error, f"save_pretrained to {out}", local)
    where = {n: f for f, names in layout.files.items() for n in names}
    writers: dict[str, SafetensorsWriter] = {}
    try:
        for i, (f, names) in enumerate(layout.files.items()):
            if i % world == rank and error is None:
                try:
                    writers[f] = SafetensorsWriter(out / f, {n: layout.specs[n] for n in names},
                                                   {"format": "pt"})
                except OSError as e:
                    error = f"cannot write {out / f} ({e.strerror or e})"
        error = _write_groups(layout, model, full_of, prefix, writers, where) or error
    except BaseException:
        for w in writers.values():
            w.abort()
        raise
    if error is not None:
        for w in writers.values():
            w.abort()
    _raise_if_any(error, f"save_pretrained to {out}", local)
    for f, w in writers.items():
        try:
            w.commit()
        except (OSError, CheckpointError) as e:
            error = f"{out / f}: {e}"
    _raise_if_any(error, f"save_pretrained to {out}", local)
    if rank == 0:
        for name, text in config_files(model, *config).items():
            write_text(out / name, text)
        if layout.index is not None:
            write_text(out / INDEX, json.dumps(layout.index, indent=2, sort_keys=True) + "\n")
        else:
            (out / INDEX).unlink(missing_ok=True)
        for name in stale_shards(os.listdir(out), layout.files):
            (out / name).unlink(missing_ok=True)
        log(f"save_pretrained: {len(layout.specs)} tensors in {len(layout.files)} file(s) -> "
            f"{out}")
    if world > 1:
        dist.barrier()
    return out


def _write_groups(layout: Layout, model, full_of, prefix: str, writers, where) -> str | None:
    """Each group's full tensors (full_of: with every rank) reverted to the saved names, and
    the tensors of this rank's files written; the first write error stops the writing, not
    the gathering (the other ranks are in collectives)."""
    revert, error = reverter(model), None
    for i, group in enumerate(layout.groups):
        full = full_of(group.fqns)
        tensors = {k: full[prefix + k] for k in group.fqns}
        saved = revert(tensors) if group.converted else \
            {n: tensors[k] for n, k in group.renamed.items()}
        for name in group.saved:
            w = writers.get(where[name])
            if w is not None and error is None:
                try:
                    w.write(name, saved[name])
                except (OSError, CheckpointError) as e:
                    error = f"writing {name!r} to {w.path}: {e}"
        del full, tensors, saved
        _progress("save_pretrained", i, len(layout.groups))
    return error


def _progress(what: str, i: int, n: int) -> None:
    """A line every tenth of the way for a long save or load (rank 0)."""
    if n >= 50 and _rank_world()[0] == 0 and (i + 1) % max(1, n // 10) == 0:
        log(f"{what}: {i + 1}/{n} tensor groups")


# ---- in -----------------------------------------------------------------------------------
def checkpoint_files(path: str | os.PathLike) -> tuple[dict[str, Path], dict[str, tuple]]:
    """({saved name: file}, {saved name: (shape, dtype)}) of a Hugging Face checkpoint: a
    directory with `model.safetensors` or an index and its shards, or one .safetensors file."""
    path = Path(path)
    if path.is_file():
        files = {path: None}
    elif (path / INDEX).is_file():
        try:
            weight_map = json.loads((path / INDEX).read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{path / INDEX} is not a safetensors index ({e})") from None
        files = {}
        for name, f in weight_map.items():
            files.setdefault(path / f, []).append(name)
    elif (path / WEIGHTS).is_file():
        files = {path / WEIGHTS: None}
    elif path.is_dir():
        found = sorted(p.name for p in path.iterdir())[:8]
        raise CheckpointError(f"{path} has neither {WEIGHTS} nor {INDEX} (it has {found}); "
                              "pass a directory written by save_pretrained (a PyTorch .bin "
                              "checkpoint: load it with transformers and save it again)")
    else:
        raise CheckpointError(f"{path} does not exist")
    where, specs = {}, {}
    for f, listed in files.items():
        if not f.is_file():
            raise CheckpointError(f"{f.name} is listed in {path / INDEX} but is not in {path}; "
                                  "copy or download it too")
        header = read_header(f)
        for name in listed or header:
            if name not in header:
                raise CheckpointError(f"{path / INDEX} puts {name!r} in {f.name}, which does "
                                      "not hold it; the checkpoint is inconsistent")
            where[name], specs[name] = f, header[name]
    return where, specs


def _check_architecture(path: Path, model) -> None:
    """A config.json beside the weights that names another architecture than `model`'s."""
    cfg_file = (path if path.is_dir() else path.parent) / "config.json"
    if model is None or not cfg_file.is_file():
        return
    try:
        saved = json.loads(cfg_file.read_text())
    except ValueError:
        return
    mine = getattr(model.config, "model_type", None)
    theirs = saved.get("model_type")
    if theirs and mine and theirs != mine:
        raise CheckpointError(
            f"{path} holds a {'/'.join(saved.get('architectures') or [theirs])} checkpoint "
            f"(model_type {theirs!r}) but the module is a {type(model).__name__} (model_type "
            f"{mine!r}); load a checkpoint of the same architecture")


def _check_names(path: Path, layout: Layout, specs: dict[str, tuple]) -> None:
    missing = [n for n in layout.specs if n not in specs]
    extra = [n for n in specs if n not in layout.specs]
    if missing:
        raise CheckpointError(f"{path} has no {missing[0]!r}"
                              f"{f' (and {len(missing) - 1} more missing)' if len(missing) > 1 else ''}"
                              f" that the model has; load a checkpoint of the same model and "
                              f"config")
    if extra:
        raise CheckpointError(f"{path} has {extra[0]!r}"
                              f"{f' (and {len(extra) - 1} more)' if len(extra) > 1 else ''}, "
                              f"which the model does not have; load a checkpoint of the same "
                              f"model and config")
    for n, (shape, dtype) in layout.specs.items():
        if tuple(specs[n][0]) != tuple(shape) or specs[n][1] != dtype:
            raise CheckpointError(f"{path}: {n!r} is {list(specs[n][0])} {specs[n][1]} in the "
                                  f"checkpoint but {list(shape)} {dtype} in the model; load a "
                                  f"checkpoint of the same config (and dtype: build the model "
                                  f"in {specs[n][1]})")


def load_pretrained(pm, path: str | os.PathLike, *, prefix: str | None = None) -> None:
    """Load a Hugging Face checkpoint (`model.save_pretrained`'s directory, or one
    .safetensors file) into pm's shards: every rank reads only its slices, so a model built on
    `meta` and compiled for tp, ZeRO-3 or a pipeline loads with memory of its shard. The
    whole checkpoint is checked first (architecture, every name, shape and dtype, truncated
    files); an error names the key and changes no weight. Every rank calls it."""
    path = Path(path)
    error, found = None, None
    try:
        prefix, model, state, layout = _layout(pm, prefix)
        _check_architecture(path, model)
        found = checkpoint_files(path)
        _check_names(path, layout, found[1])
    except CheckpointError as e:
        error = str(e)
    _raise_if_any(error, f"load_pretrained from {path}")
    from safetensors import safe_open
    where = found[0]
    rows = rows_by_source(pm)
    pieces = zero_pieces(pm)
    for i, group in enumerate(layout.groups):
        mine = [r for k in group.fqns for r in rows.get(prefix + k, [])]
        if not mine:
            continue
        if group.converted:
            saved = {}
            for name in group.saved:
                with safe_open(where[name], framework="pt") as f:
                    saved[name] = f.get_tensor(name)
            full = converted_values(model, group, saved, state)
            del saved
            for r in mine:
                _put(pm, pieces, r, lambda a, b, r=r: take(r, full[r.source[len(prefix):]])
                     .reshape(-1)[a:b])
            del full
        else:
            for name, k in group.renamed.items():
                with safe_open(where[name], framework="pt") as f:
                    for r in rows.get(prefix + k, []):
                        _put(pm, pieces, r, lambda a, b, r=r: _read(f, name, r, a, b))
        _progress("load_pretrained", i, len(layout.groups))


def zero_pieces(pm) -> dict[str, list[tuple[torch.Tensor, int, int, int]]]:
    """Under ZeRO-3: {local name: [(flat piece, offset in it, start, stop)]}, the elements
    [start, stop) of the flattened local tensor this rank's piece holds (layout.runs)."""
    out: dict[str, list] = {}
    for unit in (pm.zero.units if pm.zero is not None else []):
        flat = pm.zero.flat(unit)
        for name, (at, start, stop) in zip(unit.layout.names, unit.layout.runs()):
            if start < stop:
                out.setdefault(name, []).append((flat, at, start, stop))
    return out


@torch.no_grad()
def _put(pm, pieces: dict, row, elements) -> None:
    """Write `elements(start, stop)` (the flattened local tensor's elements) into pm: under
    ZeRO-3 only the span this rank's flat piece holds, else the whole local tensor."""
    if pm.zero is not None and row.name in pieces:
        for flat, at, start, stop in pieces[row.name]:
            flat.data[at:at + stop - start].copy_(elements(start, stop))
        return
    if pm.zero is not None and not isinstance(row, BufferRow):
        return                          # this rank's ZeRO-3 piece holds none of it
    n = int(torch.Size(row.local_shape).numel())
    getattr(pm, row.name).copy_(elements(0, n).view(row.local_shape))


def _read(f, name: str, row, start: int, stop: int) -> torch.Tensor:
    """Elements [start, stop) of this rank's local tensor of saved tensor `name`, reading
    only the rows of the file that hold them (a part of a fused parameter: the tensor, then
    its rows)."""
    shape = row.local_shape
    if row.part is not None or not shape:
        return take(row, f.get_tensor(name)).reshape(-1)[start:stop]
    inner = int(torch.Size(shape[1:]).numel())
    r0, r1 = start // inner, -(-stop // inner)
    first = row.slices[0][0]
    index = (slice(first + r0, first + r1), *(slice(a, b) for a, b in row.slices[1:]))
    return f.get_slice(name)[index].reshape(-1)[start - r0 * inner:stop - r0 * inner]


# ---- export: any checkpoint format -> Hugging Face files ------------------------------------
def export_pretrained(paths: list[str | os.PathLike], out_dir: str | os.PathLike,
                      config: str | os.PathLike | None = None, *, prefix: str | None = None,
                      max_shard_size: int | str = "50GB") -> Path:
    """`python -m nncompile export CKPT -o DIR`: a checkpoint of any format (save_checkpoint's
    directory, a merged file, a Lightning checkpoint, a plain state_dict file) -> what
    save_pretrained writes. `config`: a directory holding config.json (or the file) of the
    Hugging Face model the weights belong to (default: config.json beside the checkpoint);
    without one the names are the module's own. Runs in one process, holding the merged
    model in host memory."""
    from nncompile.pretrained_layout import reference_model
    state_dict = _checkpoint_state(paths)
    config_path = _config_path(paths, config)
    model, hf_config = None, None
    if config_path is not None:
        from transformers import AutoConfig
        hf_config = AutoConfig.from_pretrained(config_path.parent if config_path.is_file()
                                               else config_path)
        model = reference_model(hf_config)
    if prefix is None:
        prefix = _prefix_of(state_dict, model)
    state, aliases, first = {}, {}, {}
    for k, t in state_dict.items():
        if k.startswith(prefix) and torch.is_tensor(t):
            key = k[len(prefix):]
            state[key] = (tuple(t.shape), t.dtype)
            canon = first.setdefault((t.data_ptr(), t.dtype, tuple(t.shape)), key) \
                if t.numel() else key
            if canon != key:
                aliases[key] = canon
    if not state:
        raise CheckpointError(f"the checkpoint has no tensors under the prefix {prefix!r}")
    layout = plan_layout(state, aliases, model, max_shard_size)
    return write_pretrained(Path(out_dir), layout, model, (hf_config, weights_dtype(state)),
                            lambda fqns: {prefix + k: state_dict[prefix + k] for k in fqns},
                            prefix, local=True)


def _checkpoint_state(paths: list[str | os.PathLike]) -> dict[str, torch.Tensor]:
    """The original module's state dict from any checkpoint: rank files and directories are
    merged (checkpoint.merged_checkpoint); a merged file or a plain state dict is read."""
    from .checkpoint import load_torch, merged_checkpoint
    if len(paths) == 1 and Path(paths[0]).is_file():
        blob = load_torch(paths[0], map_location="cpu")
        inner = blob.get("model", blob.get("state_dict")) if isinstance(blob, dict) else None
        if isinstance(inner, dict) and "_extra_state" not in inner:
            return inner                                 # merged, or plain Lightning
        if isinstance(blob, dict) and blob and all(torch.is_tensor(v) for v in blob.values()):
            return blob                                  # torch.save(model.state_dict())
    merged = merged_checkpoint(paths)
    return merged.get("model") or merged["state_dict"]


def _config_path(paths, config) -> Path | None:
    if config is not None:
        path = Path(config)
        if not path.exists():
            raise CheckpointError(f"--config {path} does not exist; pass the directory of the "
                                  "model's config.json (or the file)")
        return path
    for p in map(Path, paths):
        here = p if p.is_dir() else p.parent
        if (here / "config.json").is_file():
            return here / "config.json"
    return None


def _prefix_of(state_dict: dict, model) -> str:
    """The prefix under which `model`'s state keys sit in `state_dict` ("model." for a
    LightningModule holding it as self.model); "" without a model."""
    if model is None:
        return ""
    names = list(model.state_dict())
    best, hits = "", -1
    for k in state_dict:
        if k.endswith(names[0]):
            p = k[:len(k) - len(names[0])]
            n = sum(p + r in state_dict for r in names)
            if n > hits:
                best, hits = p, n
    if hits <= 0:
        raise CheckpointError(f"the checkpoint's keys (e.g. {list(state_dict)[:3]}) do not "
                              f"hold a {type(model).__name__} (e.g. {names[:2]}); pass the "
                              "config of the model that was trained, or --prefix")
    return best
