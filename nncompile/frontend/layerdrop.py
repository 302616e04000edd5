"""Hugging Face LayerDrop while tracing (BART, mBART, Whisper, ...).

In training such a model draws `p = torch.rand([])` and skips a layer `if p < self.layerdrop`.
transformers 4.5x and >= 5.20 draw only when layerdrop > 0; 5.0 to 5.19 draw always, a
data-dependent branch torch.export refuses. While the frontend traces, a layerdrop of 0 reads
as a constant no draw passes; a layerdrop > 0 in training is refused with the fix (a model in
eval mode never draws: nncompile/modes.py compiles its eval program alone).

    before: if dropout_probability < self.layerdrop   -> TraceError (layerdrop 0.0)
    after:  if dropout_probability < _NoLayerDrop()   -> False, the draw is kept
"""
from __future__ import annotations

import torch

from ..errors import TraceError


class _NoLayerDrop:
    """A `layerdrop` of 0 that a traced comparison cannot branch on: `p < layerdrop` is False
    for every draw p in [0, 1), as it is for 0.0, without comparing the tensor."""

    def __float__(self) -> float:
        return 0.0

    def __gt__(self, other) -> bool:       # p < layerdrop (p a tensor or a number in [0, 1))
        return False

    def __ge__(self, other) -> bool:
        return float(other) <= 0.0 if not isinstance(other, torch.Tensor) else False

    def __lt__(self, other) -> bool:       # layerdrop > 0.0 reads as 0.0 < layerdrop
        return not isinstance(other, torch.Tensor) and float(other) > 0.0

    def __le__(self, other) -> bool:
        return not isinstance(other, torch.Tensor) and float(other) >= 0.0

    def __eq__(self, other) -> bool:
        return not isinstance(other, torch.Tensor) and float(other) == 0.0

    __hash__ = None

    def __repr__(self) -> str:
        return "0.0"


def _layerdrop_modules(module: torch.nn.Module) -> list[torch.nn.Module]:
    """Submodules with a Hugging Face `layerdrop` attribute, checked: a layerdrop > 0 in
    training skips layers at random, which one traced program cannot do."""
    found = []
    for path, m in module.named_modules():
        p = m.__dict__.get("layerdrop")
        if not isinstance(p, (int, float)) or isinstance(p, bool):
            continue
        if p > 0 and m.training:
            raise TraceError(
                f"{path or type(module).__name__} ({type(m).__name__}) has layerdrop={p}: in "
                "training it skips whole layers at random, which one traced program cannot do. "
                "Set the model config's encoder_layerdrop / decoder_layerdrop (or the layer's "
                "layerdrop) to 0 before nncompile.parallelize, or hand the model over in "
                "eval mode (model.eval()) to compile it for evaluation only")
        if p == 0:
            found.append(m)
    return found


class static_layerdrop:
    """While tracing: every layerdrop of 0 is a _NoLayerDrop (restored afterwards)."""

    def __init__(self, module: torch.nn.Module):
        self.modules = _layerdrop_modules(module)

    def __enter__(self):
        self.saved = [(m, m.__dict__["layerdrop"]) for m in self.modules]
        for m, _ in self.saved:
            m.__dict__["layerdrop"] = _NoLayerDrop()
        return self

    def __exit__(self, *exc):
        for m, p in self.saved:
            m.__dict__["layerdrop"] = p
        return False
