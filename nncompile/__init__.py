"""nncompile: compile a single-device PyTorch model into readable per-rank programs that train
it across many devices.

    pm = nncompile.parallelize(model, {"idx": idx, "targets": targets},
                               nncompile.ComputeConfig(plan_ngpus=2, runtime_ngpus=4),
                               gen_savedir="./.nncompile")      # pas_policy="autodist"
    loss = pm(idx, targets); loss.backward()
    print(nncompile.explain(pm, "h.0.mlp_fc.weight"))                # why this placement
"""
__version__ = "0.1.0"

from .config import ComputeConfig  # noqa: E402
from .errors import (ConfigError, GraphError, InputMismatchError, NNCompileError,  # noqa: E402
                     PolicyError, ReuseError, TraceError)
from .api import parallelize  # noqa: E402
from .check import verify  # noqa: E402
from nncompile.passes.autodist import explain, report_table as plan_report  # noqa: E402
from nncompile.passes.autodist import PlanInfeasibleError  # noqa: E402
from nncompile.runtime.clip import clip_grad_norm_  # noqa: E402

__all__ = ["parallelize", "verify", "explain", "plan_report", "clip_grad_norm_", "ComputeConfig",
           "NNCompileError", "ConfigError", "TraceError", "PolicyError", "ReuseError",
           "GraphError", "InputMismatchError", "PlanInfeasibleError",
           "__version__"]
