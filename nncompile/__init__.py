"""nncompile: compile a single-device PyTorch model into readable per-rank programs that train
it across many devices.

    pm = nncompile.parallelize(model, {"idx": idx, "targets": targets},
                               nncompile.ComputeConfig(plan_ngpus=2, runtime_ngpus=4),
                               gen_savedir="./.nncompile")      # pas_policy="autodist"
    loss = pm(idx, targets); loss.backward()
    print(nncompile.explain(pm, "h.0.mlp_fc.weight"))                # why this placement
"""
from .version import __version__

from .compat import check_torch_version, quiet_known_import_noise  # noqa: E402
check_torch_version()                    # an older torch: ImportError naming the minimum
quiet_known_import_noise()               # torchao's import (transformers') prints no noise

from .config import ComputeConfig  # noqa: E402
from .parallel_spec import ParallelSpec  # noqa: E402
from .float8_spec import Float8Spec, module_filter as float8_module_filter  # noqa: E402
from .errors import (CheckpointError, ConfigError, EditedCodeWarning, GraphError,  # noqa: E402
                     InputMismatchError, NNCompileError, PipelineError, PlanCheckError, PolicyError,
                     ReuseError, TraceError, ValueReadError)
from nncompile.runtime.optim.clip import clip_grad_norm_  # noqa: E402
from nncompile.runtime.optim import grad_scaler as _grad_scaler  # noqa: E402,F401
from nncompile.runtime.protocol.distributed import init_distributed  # noqa: E402
from nncompile.runtime.protocol.lockstep import finish  # noqa: E402
from nncompile.runtime.store.value_reads import grad_norms  # noqa: E402
from nncompile.runtime.optim.optimizer import build_optimizer
from nncompile.runtime.optim.elementwise import declare_elementwise  # noqa: E402
from nncompile.runtime.checkpoints.dedup import deduped_state_dict, load_deduped_state_dict
from nncompile.runtime.checkpoints.merge import load_merged_state_dict, merge_state_dicts
from nncompile.data import DataParallelSampler, accumulation_steps  # noqa: E402
from nncompile.runtime.checkpoints.checkpoint import (latest_checkpoint, load_checkpoint,
                                                      merge_checkpoint, save_checkpoint)
from nncompile.runtime.checkpoints.async_checkpoint import AsyncCheckpoint  # noqa: E402
from nncompile.runtime.checkpoints.pretrained import load_pretrained, save_pretrained  # noqa: E402
from nncompile.runtime.checkpoints.full_state import full_optimizer_state_dict, full_state_dict

# The compiler (tracing, passes, autodist, codegen) loads on first use, so the runtime's
# modules import without it (a rank program needs only nncompile.runtime and the core).
_COMPILER = {"parallelize": ("nncompile.api", "parallelize"),
             "verify": ("nncompile.api", "verify"),
             "register_op": ("nncompile.custom_ops", "register_op"),
             "explain": ("nncompile.passes.autodist", "explain"),
             "plan_report": ("nncompile.passes.autodist", "report_table"),
             "PlanInfeasibleError": ("nncompile.passes.autodist", "PlanInfeasibleError"),
             "memory": ("nncompile.tools.memory", None)}   # memory.profile: measured vs predicted


def __getattr__(name: str):
    if name not in _COMPILER:
        raise AttributeError(f"module 'nncompile' has no attribute {name!r}")
    import importlib
    module, attr = _COMPILER[name]
    value = importlib.import_module(module)
    value = value if attr is None else getattr(value, attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_COMPILER})

__all__ = ["parallelize", "verify", "explain", "register_op", "plan_report", "ComputeConfig",
           "ParallelSpec", "Float8Spec", "float8_module_filter",
           "init_distributed", "finish", "build_optimizer", "declare_elementwise", "clip_grad_norm_",
           "save_checkpoint", "load_checkpoint", "merge_checkpoint", "latest_checkpoint",
           "accumulation_steps", "DataParallelSampler", "AsyncCheckpoint",
           "save_pretrained", "load_pretrained", "full_state_dict", "full_optimizer_state_dict",
           "deduped_state_dict", "load_deduped_state_dict", "merge_state_dicts",
           "load_merged_state_dict", "CheckpointError", "EditedCodeWarning",
           "NNCompileError", "ConfigError", "TraceError", "PolicyError", "ReuseError",
           "GraphError", "InputMismatchError", "PlanInfeasibleError", "PlanCheckError", "PipelineError",
           "ValueReadError", "grad_norms",
           "__version__"]
