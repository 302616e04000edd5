"""Edited generated code: `gencode{rank}.py` is meant to be read and tweaked.

manifest.json records each generated file's sha256 (`files`). Loading a file whose hash
differs warns once per process (EditedCodeWarning) and runs the edited code. Regenerating
(reuse="override", or "moo" when the model changed) keeps the edited version in
`<instance>/edited/`; reuse="match" never overwrites an edited file.
"""
from __future__ import annotations

import hashlib
import shutil
import warnings
from pathlib import Path

from .errors import EditedCodeWarning

_WARNED: set[tuple[str, str]] = set()


def file_sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def edited_files(outdir: Path, manifest: dict) -> list[str]:
    """Names of generated files in outdir whose content differs from what was generated."""
    recorded = manifest.get("files", {})
    return [name for name, sha in recorded.items()
            if (outdir / name).exists() and file_sha256(outdir / name) != sha]


def warn_if_edited(path: Path, manifest: dict) -> bool:
    """Warn (once per process and content) when `path` differs from the generated file."""
    recorded = manifest.get("files", {}).get(path.name)
    if recorded is None:
        return False
    current = file_sha256(path)
    if current == recorded:
        return False
    key = (str(path.resolve()), current)
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(f"{path} was edited after nncompile generated it (sha256 {recorded[:12]} "
                      f"-> {current[:12]}); running the edited file. "
                      "parallelize(..., reuse='override') regenerates it.",
                      EditedCodeWarning, stacklevel=4)
    return True


def keep_edited(outdir: Path, manifest: dict, staging: Path) -> list[str]:
    """Copy edited files (and earlier kept ones) of outdir into staging/edited/ before
    outdir is replaced; returns the names copied."""
    names = edited_files(outdir, manifest)
    previous = outdir / "edited"
    if not names and not previous.is_dir():
        return []
    keep = staging / "edited"
    if previous.is_dir():
        shutil.copytree(previous, keep, dirs_exist_ok=True)
    keep.mkdir(exist_ok=True)
    for name in names:
        shutil.copy2(outdir / name, keep / name)
    return names
