"""A size only the data decides, refused at lowering with the op and the user's line.

    before: tok, slot = torch.where(idx == i)    # torch.export traces size u0 (unbacked)
    after:  TraceError: ... aten.where.default at model.py:15 ... gives [[u0], [u0]] ...
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx

from ..errors import TraceError
from .function_watch import user_frame_from_text


def refuse_data_dependent(module: torch.nn.Module, node: torch.fx.Node, val: Any) -> None:
    """A TraceError where torch.export traced a size that only the data decides (an unbacked
    symbol: torch.where, nonzero, a boolean mask, .item()), which the IR cannot hold: every
    size of the generated program is fixed, or a function of the inputs' (dynamic_dims)."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
    try:
        unbacked = free_unbacked_symbols(val) if val is not None else set()
    except Exception:             # noqa: BLE001 - a value torch cannot inspect: not one
        return
    if not unbacked:
        return
    where = user_frame_from_text(node.meta.get("stack_trace", "")) or "(no source line)"
    shape = [_shape(v) for v in val] if isinstance(val, (list, tuple)) else _shape(val)
    raise TraceError(
        f"{type(module).__name__}.forward makes a value whose size depends on the data: "
        f"{node.target} at {where} gives {shape}, where {', '.join(sorted(map(str, unbacked)))} "
        "is known only when it runs. nncompile's generated program fixes every size at trace "
        "time (or, with dynamic_dims, derives it from the inputs' sizes), so data-dependent "
        "routing (torch.where / nonzero / boolean-mask indexing, as a classic "
        "mixture-of-experts loop does with index_add) cannot be compiled. Compute it with "
        "fixed sizes (every expert on every token, weighted by a dense routing mask, or a "
        "fixed-capacity dispatch), or use a Hugging Face MoE block (Mixtral, Qwen3-MoE), "
        "which nncompile fuses into one op it can dispatch along ep (docs/experts.md)")


def _shape(v: Any) -> Any:
    return list(v.shape) if isinstance(v, torch.Tensor) else v
