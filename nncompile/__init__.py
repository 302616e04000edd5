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
from .api import parallelize, verify  # noqa: E402
from .custom_ops import register_op  # noqa: E402
from nncompile.passes.autodist import explain, report_table as plan_report  # noqa: E402
from nncompile.passes.autodist import PlanInfeasibleError  # noqa: E402
from nncompile.runtime.clip import clip_grad_norm_  # noqa: E402
from nncompile.runtime import grad_scaler as _grad_scaler  # noqa: E402,F401  (GradScaler agrees)
from nncompile.runtime.distributed import init_distributed  # noqa: E402
from nncompile.runtime.value_reads import grad_norms  # noqa: E402
from nncompile.runtime.optimizer import build_optimizer, declare_elementwise  # noqa: E402
from nncompile.runtime.dedup import deduped_state_dict, load_deduped_state_dict  # noqa: E402
from nncompile.runtime.merge import load_merged_state_dict, merge_state_dicts  # noqa: E402
from nncompile.data import DataParallelSampler, accumulation_steps  # noqa: E402
from nncompile.runtime.checkpoint import (latest_checkpoint, load_checkpoint,  # noqa: E402
                                          merge_checkpoint, save_checkpoint)
from nncompile.runtime.async_checkpoint import AsyncCheckpoint  # noqa: E402
from nncompile.runtime.pretrained import load_pretrained, save_pretrained  # noqa: E402
from nncompile.runtime.full_state import (full_optimizer_state_dict,  # noqa: E402
                                          full_state_dict)
from .tools import memory  # noqa: E402,F401  (nncompile.memory.profile: measured vs predicted)

__all__ = ["parallelize", "verify", "explain", "register_op", "plan_report", "ComputeConfig",
           "ParallelSpec", "Float8Spec", "float8_module_filter",
           "init_distributed", "build_optimizer", "declare_elementwise", "clip_grad_norm_",
           "save_checkpoint", "load_checkpoint", "merge_checkpoint", "latest_checkpoint",
           "accumulation_steps", "DataParallelSampler", "AsyncCheckpoint",
           "save_pretrained", "load_pretrained", "full_state_dict", "full_optimizer_state_dict",
           "deduped_state_dict", "load_deduped_state_dict", "merge_state_dicts",
           "load_merged_state_dict", "CheckpointError", "EditedCodeWarning",
           "NNCompileError", "ConfigError", "TraceError", "PolicyError", "ReuseError",
           "GraphError", "InputMismatchError", "PlanInfeasibleError", "PlanCheckError", "PipelineError",
           "ValueReadError", "grad_norms",
           "__version__"]
