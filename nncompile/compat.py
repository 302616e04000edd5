"""The one place nncompile touches version-dependent or private PyTorch APIs.

Each function hides one API that differs between the supported torch releases (MIN_TORCH up
to the newest tested, see docs/versions.md), with a comment naming the release that changed
it. The rest of the package calls these functions and never tests `torch.__version__` itself;
tests/test_compat.py greps the package to keep it so.

    before:  getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    after:   compat.all_gather_single()
"""
from __future__ import annotations

import contextlib
import re

import torch
import torch.distributed as dist

MIN_TORCH = (2, 11)         # the oldest release the suite is run on (docs/versions.md)


def torch_version(text: str | None = None) -> tuple[int, int]:
    """(major, minor) of the installed torch (or of `text`, e.g. "2.11.0+cu130")."""
    m = re.match(r"(\d+)\.(\d+)", text if text is not None else str(torch.__version__))
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def check_torch_version(text: str | None = None) -> None:
    """ImportError naming the minimum when the installed torch is older than MIN_TORCH."""
    have = torch_version(text)
    if have < MIN_TORCH:
        raise ImportError(
            f"nncompile needs torch>={MIN_TORCH[0]}.{MIN_TORCH[1]}, found torch "
            f"{text if text is not None else torch.__version__}; upgrade it "
            f"(pip install 'torch>={MIN_TORCH[0]}.{MIN_TORCH[1]}') or see docs/versions.md")


# ---- the threaded process group (one process, a thread per rank: nncompile.tools.simulate) ---

def _mtp():
    # torch.testing._internal: the threaded backend DTensor's own tests run on; no public
    # equivalent exists in any supported release.
    from torch.testing._internal.distributed import multi_threaded_pg
    return multi_threaded_pg


def install_threaded_pg() -> None:
    """Make "threaded" the backend of thread-local default groups (every rank a thread)."""
    mtp = _mtp()
    keep_fake_device_guard()
    # group names per thread (torch >= 2.4; private binding, unchanged since)
    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    world = mtp._install_threaded_pg()
    if not hasattr(world, "comms"):
        # torch 2.11: destroy_process_group() reads `_world.comms` (torchcomms), which that
        # release's ThreadLocalWorld lacks (added in 2.13): give it a per-thread list.
        dist.distributed_c10d._world = _with_comms(world)
    mtp.ProcessLocalGroup.reset()


def keep_fake_device_guard() -> None:
    """Install, from the calling (main) thread, the no-op CUDA device guard FakeTensorMode sets
    on entry when no GPU is visible. In torch 2.11's CUDA build the guard that a thread sets
    first dies with that thread, and the next trace in another thread (a simulated rank)
    calls through it and crashes the process (SIGSEGV in ensureCUDADeviceGuardSet). Set here
    first, it lives as long as the process. A no-op where a GPU is visible or where the guard
    is already set; the CPU builds never crash."""
    ensure = getattr(torch._C, "_ensureCUDADeviceGuardSet", None)
    if ensure is not None and not torch.cuda.is_available():
        ensure()


def uninstall_threaded_pg() -> None:
    """Undo install_threaded_pg: the caller's own world and autograd threading come back."""
    mtp = _mtp()
    mtp.ProcessLocalGroup.reset()
    mtp._uninstall_threaded_pg()
    # torch 2.11 turns autograd multithreading off at install and never back on (2.13 restores
    # it in _uninstall_threaded_pg and clears `_ctx_manager`)
    cm = getattr(mtp, "_ctx_manager", None)
    if cm is not None:
        cm.__exit__(None, None, None)
        mtp._ctx_manager = None
    torch._C._distributed_c10d._set_thread_isolation_mode(False)


def abort_threaded_collectives(exc: BaseException) -> bool:
    """Wake ranks blocked in a threaded collective with `exc`; False where torch cannot."""
    try:
        _mtp().ProcessLocalGroup.exception_handle(exc)
        return True
    except Exception:   # noqa: BLE001 - a release without it: peers time out instead
        return False


def _with_comms(world):
    """torch 2.11's ThreadLocalWorld plus the `comms` list newer releases have."""
    import threading

    class ThreadLocalWorldWithComms(type(world)):
        _comms = threading.local()

        @property
        def comms(self):
            if not hasattr(self._comms, "comms"):
                self._comms.comms = []
            return self._comms.comms

    return ThreadLocalWorldWithComms()


# ---- collectives ------------------------------------------------------------------------------

def grouped_mm():
    """torch._grouped_mm, one product per group of rows (private; its fast path: bfloat16 on
    CUDA compute capability 9+), or None where this torch has none."""
    return getattr(torch, "_grouped_mm", None)


def all_gather_single():
    """dist.all_gather_into_tensor under the name this torch prefers (torch 2.13 added
    `all_gather_single` and deprecated the `_tensor` spelling)."""
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def reduce_scatter_single():
    """dist.reduce_scatter_tensor, as all_gather_single (renamed in torch 2.13)."""
    return getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def strided_shard(dim: int, split_factor: int):
    """DTensor's `_StridedShard(dim, split_factor=...)` placement: a dimension sharded after
    another split of it (a column-parallel weight's rows cut again by ZeRO-3, as FSDP2 does
    under tp). Private in every supported release (2.11-2.13, same constructor)."""
    from torch.distributed.tensor.placement_types import _StridedShard
    return _StridedShard(dim, split_factor=split_factor)


def alias_at_offset_zero(t: torch.Tensor) -> torch.Tensor:
    """A tensor over the same memory as contiguous `t` whose storage starts at t's first
    element. A DTensor takes its local tensor's storage offset, and torch.save of a DTensor
    with a nonzero one reads its (wrapper's) storage and fails ("invalid python storage",
    torch 2.13); views into a flat buffer get this alias first. The sliced storage holds a
    reference to t's, so the memory lives as long as either."""
    if not t.storage_offset():
        return t
    st, size = t.untyped_storage(), t.element_size()
    start = t.storage_offset() * size
    piece = st[start:start + t.numel() * size]
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(piece, 0, t.shape, t.stride())


# ---- pipeline stages --------------------------------------------------------------------------

def pipeline_stages_send_integers() -> bool:
    """Whether torch.distributed.pipelining's PipelineStage passes non-floating tensors (token
    ids, masks) between stages in training. torch 2.11 calls requires_grad_(True) on every
    received buffer ("only Tensors of floating point dtype can require gradients") and expects
    a gradient back for each; 2.13 takes requires_grad from the stage's metadata. Where False,
    runtime/program/pipeline.py carries such tensors as float64 across the boundary."""
    return torch_version() >= (2, 13)


def pipeline_stage_class():
    """torch.distributed.pipelining.PipelineStage, on torch 2.11 without the warm-up sends a
    rank makes to itself: its schedules open the stage neighbours' channels with one batch of
    sends and receives (`_get_init_p2p_neighbors_ops`), including those between two stages of
    one rank (V-shaped zero-bubble placements), which gloo refuses ("Pair is not connected").
    torch 2.13 replaced that warm-up with a vote that skips the rank's own stages."""
    from torch.distributed.pipelining import PipelineStage
    if torch_version() >= (2, 13):
        return PipelineStage

    class PipelineStageNoSelfWarmup(PipelineStage):
        def _get_init_p2p_neighbors_ops(self):
            me = dist.get_rank(self.group)
            return [op for op in super()._get_init_p2p_neighbors_ops()
                    if getattr(op, "group_peer", None) != me]
    return PipelineStageNoSelfWarmup


def _torch_action(a):
    from torch.distributed.pipelining.schedules import _Action, _ComputationType
    if a.parts:              # OVERLAP_F_B: torch's container action (stage -1, no micro-batch)
        return _Action(-1, _ComputationType(a.kind), None, tuple(map(_torch_action, a.parts)))
    return _Action(a.stage, _ComputationType(a.kind), a.microbatch)


def _our_action(a):
    from nncompile.ir.schedule import Action
    if a.sub_actions:
        return Action(-1, a.computation_type.value, -1, tuple(map(_our_action, a.sub_actions)))
    return Action(a.stage_index, a.computation_type.value, a.microbatch_index)


def add_send_recv(compute: dict, stage_rank: dict, nstages: int) -> dict:
    """Each pipeline rank's compute actions (nncompile.ir.schedule.Action) with the sends and
    receives between ranks, placed by torch.distributed.pipelining's own lowering
    (`schedules._add_send_recv`, private: the one its action-list schedules use; checked on
    2.13, the suite's torch). AssertionError when the order cannot be met."""
    from torch.distributed.pipelining.schedules import _add_send_recv
    lowered = _add_send_recv({r: [_torch_action(a) for a in acts] for r, acts in compute.items()},
                             stage_to_rank=lambda s: stage_rank[s], num_stages=nstages)
    return {r: [_our_action(a) for a in acts] for r, acts in sorted(lowered.items())}


def action_list_schedule(stages: list, actions: dict, **kwargs):
    """torch.distributed.pipelining's action-list runtime (`_PipelineScheduleRuntime`,
    private; torch's multi-stage schedules subclass it, checked on 2.13) loaded with every
    pipeline rank's actions, sends and receives included (format "compute_comms"): it runs
    this rank's list as given."""
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime
    schedule = _PipelineScheduleRuntime(stages, **kwargs)
    schedule._prepare_schedule_with_comms(
        {r: [_torch_action(a) for a in acts] for r, acts in actions.items()},
        format="compute_comms")
    return schedule


# ---- torch.export ------------------------------------------------------------------------------

def export_dynamic_options() -> dict:
    """torch.export options for a trace with dynamic sizes. torch 2.11 cannot prove some
    guards that hold for every size in range, e.g. `Min(8*s, 16*s) == 8*s` from reshaping an
    expanded tensor (Hugging Face's repeat_kv), and refuses the range ("Constraints
    violated"); 2.13 proves them. There the frontend exports again with such guards deferred
    to runtime asserts (which it drops), so a guard that truly fails for some size in range
    is refused by torch 2.13+ but on 2.11 shows as an error when that size runs."""
    if torch_version() >= (2, 13):
        return {}
    return {"prefer_deferred_runtime_asserts_over_guards": True}


@contextlib.contextmanager
def export_leaves_no_hooks():
    """Around torch.export: torch 2.11's export registers a global buffer-registration hook
    (register_buffer_assignment_hook) and leaves it behind when the export raises, so every
    later trace sees a global module hook (layer replay then turns itself off). Fixed by
    2.13; here the hooks an export added are removed however it ends."""
    from torch.nn.modules import module as nn_module
    hooks = getattr(nn_module, "_global_buffer_registration_hooks", None)
    before = set(hooks) if hooks is not None else set()
    try:
        yield
    finally:
        if hooks is not None and torch_version() < (2, 13):
            for key in [k for k in hooks if k not in before]:
                del hooks[key]


# ---- autograd ----------------------------------------------------------------------------------

def function_apply():
    """(torch.autograd.Function's own `apply` as found in its class dict, a plain function
    (cls, *args, **kwargs) that calls it): what nncompile.function_watch wraps while tracing.
    Up to torch 2.14 `apply` is a Python classmethod; 2.15 implements it in C (a
    classmethod_descriptor, no `__func__`)."""
    orig = torch.autograd.function.Function.__dict__["apply"]
    if isinstance(orig, classmethod):
        return orig, orig.__func__
    return orig, lambda cls, *args, **kwargs: orig.__get__(None, cls)(*args, **kwargs)


# ---- activation checkpointing ----------------------------------------------------------------

def checkpoint_generator_name() -> str:
    """The private torch.utils.checkpoint generator that `checkpoint(..., use_reentrant=False)`
    runs around the checkpointed function (what nncompile.user_checkpoint wraps to see which
    functions a model checkpoints): `_checkpoint_without_reentrant_generator` up to torch
    2.14; torch 2.15 moved its body to `..._impl` and calls that directly."""
    from torch.utils import checkpoint as ckpt
    impl = "_checkpoint_without_reentrant_generator_impl"
    return impl if hasattr(ckpt, impl) else "_checkpoint_without_reentrant_generator"


# ---- autograd engine ---------------------------------------------------------------------------

def will_engine_execute_node():
    """torch._C._will_engine_execute_node (private, torch >= 2.0) or None where absent: whether
    the running backward reaches a node (the reducer skips parameters it will not reach)."""
    return getattr(torch._C, "_will_engine_execute_node", None)


def default_store():
    """The default process group's key-value store (hang reports talk through it)."""
    return dist.distributed_c10d._get_default_store()


def flight_recorder_entries() -> list[dict]:
    """torch's Flight Recorder entries of this process (a list of dicts: profiling_name,
    collective_seq_id, process_group, thread_id, ...); [] where this build has no recorder
    or it is off (TORCH_FR_BUFFER_SIZE unset or 0)."""
    import pickle
    dump = getattr(torch._C._distributed_c10d, "_dump_fr_trace", None)
    if dump is None:
        return []
    try:
        return pickle.loads(dump()).get("entries", [])    # bytes torch made in this process
    except Exception:  # noqa: BLE001 - off, or another layout of the dump
        return []


def torchao_auto_filter(recipe: str):
    """torchao's size filter for a float8 recipe, a `module_filter_fn(mod, fqn)` (its private
    `_auto_filter_for_recipe`, the one torchtitan applies); None where torchao has none."""
    from torchao.float8 import float8_linear_utils
    make = getattr(float8_linear_utils, "_auto_filter_for_recipe", None)
    return make(recipe, []) if make is not None else None


class _KnownImportNoise:
    """A logging filter for two messages torch 2.13 and torchao 0.18 print whenever torchao is
    imported (transformers imports it too): torchao's CUDA kernel libraries that this machine
    cannot load ("Failed to load .../torchao/_C_mxfp8...so", which float8 training does not
    use: it runs on torch._scaled_mm), and torch's deprecation notice to torchao for
    registering its enums with pytree. Every other record passes."""

    def filter(self, record) -> bool:
        text = record.getMessage()
        return not ((text.startswith("Failed to load ") and "/torchao/_C" in text)
                    or "is an Enum subclass and is now natively supported" in text)


def quiet_known_import_noise() -> None:
    """Install _KnownImportNoise on the two loggers (once; imports after nncompile's are
    quiet, one that came before has printed already)."""
    import logging
    for name in ("torchao", "torch.utils._pytree"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _KnownImportNoise) for f in logger.filters):
            logger.addFilter(_KnownImportNoise())


def add_dtensor_op_handler(op, handler) -> None:
    """Register `handler(op, args, kwargs)` for `op` in DTensor's table of per-op handlers
    (`DTensor._op_dispatcher._custom_op_handlers`, the table torch's loss_parallel and context
    parallelism use; private, present in torch 2.4-2.13); an op with a handler already keeps
    it."""
    from torch.distributed.tensor import DTensor
    DTensor._op_dispatcher._custom_op_handlers.setdefault(op, handler)


def incompatible_keys(missing: list[str], unexpected: list[str]):
    """What nn.Module.load_state_dict returns (torch's `_IncompatibleKeys` namedtuple)."""
    from torch.nn.modules.module import _IncompatibleKeys
    return _IncompatibleKeys(missing, unexpected)


def wrap_once(owner, attr, replacement, also=()):
    """Set ``owner.attr`` (and ``attr`` on each module of ``also``) to ``replacement`` dressed
    as torch's function; return torch's function, or None when it is already ours (a second
    call leaves everything as it is). Each use is listed in docs/concepts.md with the torch
    behaviour that forces it."""
    import functools
    current = getattr(owner, attr)
    if getattr(current, "_nncompile", False):
        return None
    wrapper = functools.wraps(current)(replacement)
    wrapper._nncompile = True
    for target in (owner, *also):
        setattr(target, attr, wrapper)
    return current
