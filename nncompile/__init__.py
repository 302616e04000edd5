"""nncompile: compile a single-device PyTorch model into readable per-rank programs that train
it across many devices.

    pm = nncompile.parallelize(model, {"idx": idx, "targets": targets},
                               nncompile.ComputeConfig(plan_ngpus=2, runtime_ngpus=4),
                               pas_policy="tp", gen_savedir="./.nncompile")
    loss = pm(idx, targets); loss.backward()
"""
__version__ = "0.1.0"

from .config import ComputeConfig  # noqa: E402
from .errors import (ConfigError, GraphError, InputMismatchError, NNCompileError,  # noqa: E402
                     PolicyError, ReuseError, TraceError)
from .api import parallelize  # noqa: E402
from .check import verify  # noqa: E402

__all__ = ["parallelize", "verify", "ComputeConfig", "NNCompileError", "ConfigError",
           "TraceError", "PolicyError", "ReuseError", "GraphError", "InputMismatchError",
           "__version__"]
