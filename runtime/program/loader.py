"""Load one rank's generated program: import `gencode{rank}.py` from a compile's output
directory and build its GenModel (a ParallelModule) from the original module's weights.

    pm = load_rank_module(Path(".nncompile/GPT"), rank, model)   # what parallelize returns
"""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import torch

from nncompile import rank_file
from nncompile.config import ComputeConfig
from nncompile.edits import warn_if_edited


def load_rank_module(outdir: Path, rank: int, module: torch.nn.Module | None, device=None,
                     compute_config: ComputeConfig | None = None):
    """Import `gencode{rank}.py` from outdir and build its GenModel from `module`'s weights."""
    path = outdir / f"gencode{rank}.py"
    manifest_path = outdir / "manifest.json"
    if manifest_path.exists():
        warn_if_edited(path, json.loads(manifest_path.read_text()))
    name = f"nncompile_gen_{abs(hash(str(outdir)))}_{rank}"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    rank_file.read(mod.GenModel, str(path))     # another schema version: refused, with the fix
    pm = mod.GenModel(module, device=device, compute_config=compute_config)
    pm.gencode_path = str(path)
    return pm
