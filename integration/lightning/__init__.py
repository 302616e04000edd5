"""PyTorch Lightning: `NnCompileStrategy` (registered as strategy="nncompile") and
`NnCompilePrecision`."""
from .precision import NnCompilePrecision
from .strategy import NnCompileStrategy

__all__ = ["NnCompileStrategy", "NnCompilePrecision"]
