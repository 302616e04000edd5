"""Errors raised for bad input. Each message says what was wrong and what to do."""


class NNCompileError(Exception):
    """Base class of every error nncompile raises on purpose."""


class ConfigError(NNCompileError, ValueError):
    """A ComputeConfig or a parallelize() argument is invalid."""


class TraceError(NNCompileError):
    """torch.export could not trace the module's forward."""


class PolicyError(NNCompileError):
    """A policy name is unknown, unavailable, or a policy produced an invalid plan."""


class ReuseError(NNCompileError):
    """Generated code in gen_savedir does not match the current module or config."""


class GraphError(NNCompileError):
    """verify(graph) found an inconsistent IR graph (a bug in a pass or a policy)."""


class InputMismatchError(NNCompileError, ValueError):
    """A ParallelModule was called with inputs unlike the traced ones."""


class CheckpointError(NNCompileError):
    """A checkpoint is incomplete, or was written under a plan this module cannot load."""


class PlanCheckError(NNCompileError):
    """ComputeConfig(check=True): the compiled plan does not compute what the model does."""


class ValueReadError(NNCompileError, RuntimeError):
    """A number was read (`.item()`, `float()`) out of one of pm's DTensors whose value is
    spread over the ranks (runtime/store/value_reads.py)."""


class EditedCodeWarning(UserWarning):
    """A generated file was edited after nncompile wrote it; the edited file runs."""


class PipelineError(NNCompileError, RuntimeError):
    """A pipelined plan used the way only an unpipelined one can be (e.g. pm(...) instead of
    pm.train_step(...))."""
