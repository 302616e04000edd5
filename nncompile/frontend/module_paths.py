"""Module paths as torch.export records them, mapped to the module's own names.

torch.export names the module of each op by the path its call went through. For a module held
once that is its FQN; a module called from two places (one experts block applied twice, its
weights shared) is named by its access path at the second call:

    before: module_stack path "model.layers.slice(None, 2, None).1.mlp.experts"
    after:  trace_info.module_aliases maps it to "model.layers.0.mlp.experts"

so passes that look for a module's ops (fuse_moe_layers) find every call of it.
"""
from __future__ import annotations

import re

import torch


def aliases(module: torch.nn.Module, graph) -> dict[str, str]:
    """{access path: FQN} for the module paths of `graph`'s ops that name no submodule of
    `module` (torch.export names a shared module's calls by how they reached it, as
    "layers.slice(None, 2, None).1.mlp"), resolved by walking the path to the module."""
    names = {id(m): n for n, m in module.named_modules()}
    known = set(names.values())
    out: dict[str, str] = {}
    for op in graph.ops:
        for path, _ in op.module_stack:
            if path in known or path in out:
                continue
            target = _walk(module, path)
            if target is not None and id(target) in names:
                out[path] = names[id(target)]
    return out


def _walk(module: torch.nn.Module, path: str):
    obj = module
    for part in re.findall(r"slice\([^)]*\)|[^.]+", path):
        try:
            if part.startswith("slice("):
                obj = obj[slice(*(None if a.strip() == "None" else int(a)
                                  for a in part[6:-1].split(",")))]
            elif part.isdigit() and not hasattr(obj, part):
                obj = obj[int(part)]
            else:
                obj = getattr(obj, part)
        except (AttributeError, IndexError, KeyError, TypeError, ValueError):
            return None
    return obj if isinstance(obj, torch.nn.Module) else None
