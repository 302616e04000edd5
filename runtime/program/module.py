"""ParallelModule: the base class of every generated `GenModel`.

It takes this rank's shards from the original module's current weights, computes constants
once, checks inputs against the traced ones, runs the generated forward, and reduces
gradients like DDP (reducer.py: bucketed, optionally overlapped with backward; `no_sync()`
for gradient accumulation). `gather_params` / `gather_grads` rebuild full tensors keyed by
the original FQNs (collectives: every rank calls them). `state_dict()` is the model's (FQNs,
DTensors where the plan splits: runtime/checkpoints/model_state.py); `local_state_dict()` is this rank's
shard plus the plan it belongs to (checkpoint.py builds deduped, merged and resharding
formats from it).
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from nncompile.config import ComputeConfig
from nncompile.errors import ConfigError, InputMismatchError
from nncompile.symbolic import check_sizes
from nncompile.ir.placement import Shard
from nncompile.mesh import Mesh, grad_reduction
from nncompile.rows import buffer_rows, const_rows, param_rows, take
from nncompile import arguments, rank_file

from . import consistency
from ..store import model_names
from ..checkpoints import model_state
from ..protocol.lockstep import agree_before_forward, lockstep_group, meet
from .copying import deepcopy_parallel_module
from .float8 import Float8
from ..protocol.groups import axis_groups, get_groups, group_along
from .reducer import Reducer
from ..store.zero import ZeroRuntime, all_gather_along, memory_settings
from ..store.meta_buffers import with_real_buffers
from ..store.zero3_handles import make_handles
from ..store.released import release_original, take_original
from ..store.module_views import pieces_registered, view_released
from ..store.stage_params import release_other_stages
from ..store.view_grads import link_grads
from ..store.pieces import local_named_parameters, local_parameters, pieces_of
from ..store.parts import assemble_sources
from ..checkpoints.state import check_same_plan, share_over_pipeline
from ..store.holders import gather_split_axes, plan_info


def _slice(full: torch.Tensor, slices) -> torch.Tensor:
    return full[tuple(slice(a, b) for a, b in slices)]


class ParallelModule(torch.nn.Module):
    # The generated subclass declares what its rank runs (nncompile/rank_file.py: RankFile);
    # the class attributes below (set after the class) are the schema's defaults.

    def __init__(self, module: torch.nn.Module | None = None, device: Any = None,
                 compute_config: ComputeConfig | None = None):
        super().__init__()
        self.rank_file = rank_file.read(type(self), getattr(self, "gencode_path", ""))
        self.axis_groups = axis_groups(self.RANK, self.PLAN_NGPUS, self.RUNTIME_NGPUS,
                                       self.PIPE_RANKS, self.mesh_axes)
        self.compute_config = compute_config or ComputeConfig(self.PLAN_NGPUS, self.RUNTIME_NGPUS)
        self.plan_group, self.dp_group = get_groups(self.PLAN_NGPUS, self.RUNTIME_NGPUS,
                                                    self.PIPE_RANKS, self.mesh_axes)
        if device is None:
            device = next((t.device for t in (module.parameters() if module is not None else [])
                           if not t.is_meta), torch.device("cpu"))
        self.device = torch.device(device)
        self.float8 = Float8(self.FLOAT8["recipe"], self, self.FLOAT8["scales"]) \
            if self.FLOAT8 else None          # FLOAT8.linear in the code (runtime/program/float8.py)
        self._out_spec = pytree.treespec_loads(self.OUT_SPEC) if self.OUT_SPEC else None
        self._eval_out_spec = pytree.treespec_loads(self.EVAL_OUT_SPEC) \
            if self.EVAL_OUT_SPEC else self._out_spec
        self._partial_grad = {row.name for row in param_rows(self) if row.partial_grad}
        self.memory = memory_settings(self)
        self.zero: ZeroRuntime | None = None
        self._grad_shards = None       # a ZeRO-2 optimizer keeps the gradients (optimizer.py)
        state = _full_state(module)
        consistency.sync_at_load(self, module, state)     # rank 0's weights, as DDP
        if self.memory.zero == 3:
            self.zero = ZeroRuntime(self, self.ZERO_UNITS, self.memory.offload_params,
                                    self.compute_config.zero_ngroups)
            rows = {row.name: row for row in param_rows(self)}
            for unit in self.zero.units:
                pieces = [self._local_shard(state.get(rows[n].source), rows[n])
                          for n in unit.layout.names]
                flat = torch.nn.Parameter(self.zero.shard_of(unit, pieces),
                                          requires_grad=unit.trainable)
                flat._zero_attr = unit.attr
                self.__dict__[unit.attr] = flat     # stored_parameters(), not parameters()
            make_handles(self)      # named_parameters(): local names and shard shapes
            shared = {}
        else:
            shared = take_original(self, module, state, param_rows(self))
            for row in param_rows(self):
                p = shared.get(row.name)
                if p is None:
                    p = torch.nn.Parameter(
                        self._local_shard(state.get(row.source), row),
                        requires_grad=not self.INFERENCE_ONLY and row.name not in self.FROZEN)
                self.register_parameter(row.name, p)
        full_buffers = {}
        state = with_real_buffers(module, state, [row.fqn for row in buffer_rows(self)])
        for row in buffer_rows(self):
            full = state[row.fqn].detach().to(self.device)
            full_buffers[row.name] = full
            self.register_buffer(row.name, _slice(full, row.slices).clone())
        if self.CONSTS:
            consts = self.compute_constants(**full_buffers)
            for row in const_rows(self):
                self.register_buffer(row.name, _slice(consts[row.name], row.slices).contiguous(),
                                     persistent=False)
        self._reducer = self._build_reducer()
        if release_original(self, module, param_rows(self), shared):
            view_released(self, module, param_rows(self))   # DTensor views where they fit
            release_other_stages(self, module, param_rows(self))
        # the mode of the module it was built from (as a copy of it would be): pm.train() and
        # pm.eval() then switch, as they do on the model
        self.train(module.training if module is not None else self.TRAINING)
        self.__dict__["_lockstep_group"] = lockstep_group(self)   # every rank, at load
        self.pipeline = None
        if self.PIPELINE is not None and dist.is_initialized():
            from .pipeline import PipelineRuntime
            self.pipeline = PipelineRuntime(self)
        self.order_as_model()
        if self.compute_config.compile:
            self.compile()

    def _local_shard(self, full: torch.Tensor | None, row) -> torch.Tensor:
        """This rank's slice (rows.take) of a full original weight; uninitialized when the
        weight is on meta (load it with load_merged_state_dict)."""
        if full is None or full.is_meta:
            dtype = full.dtype if full is not None else torch.float32
            return torch.empty(row.local_shape, device=self.device, dtype=dtype)
        return take(row, full.detach()).clone().to(self.device)

    # ---- generated by codegen -------------------------------------------------------------
    def compute_constants(self, **buffers) -> dict[str, torch.Tensor]:
        return {}

    def forward_impl(self, *inputs):
        raise NotImplementedError

    forward_eval_impl = None    # the forward in eval mode, where it differs (nncompile/modes.py)

    # ---- torch.compile ----------------------------------------------------------------------
    def compile(self, **kwargs) -> "ParallelModule":
        """torch.compile this rank's generated forward (`forward_impl`, its collectives
        included: runtime/program/comm.py traces them as functional collectives) with torch.compile's
        `kwargs`, backend "inductor" unless given. Argument binding, input checks and the
        gradient reducer stay eager. Compiles on the first call; calling compile again starts
        over from the generated code. ComputeConfig(compile=True) calls it at load."""
        if self.PIPELINE is not None:
            raise ConfigError("compile() compiles the generated forward, which a pipelined plan "
                              "does not have (its stages run under torch's pipeline "
                              "schedules); leave compile off with a pipeline (parallel.pp)")
        if self.zero is not None:
            raise ConfigError("compile() cannot trace ZeRO-3's parameter gathers (they swap "
                              "saved tensors through saved_tensors_hooks); run this plan "
                              "uncompiled, or with use_zero 0, 1 or 2")
        kwargs.setdefault("backend", "inductor")
        compiled = torch.compile(type(self).forward_impl, **kwargs)
        self.forward_impl = functools.partial(compiled, self)   # an instance attribute wins
        if type(self).forward_eval_impl is not None:            # eval mode's program too
            self.forward_eval_impl = functools.partial(
                torch.compile(type(self).forward_eval_impl, **kwargs), self)
        self.compile_options = dict(kwargs)
        return self

    # ---- calling ----------------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        """Called like the original module's forward (nncompile/arguments.py)."""
        if self.PIPELINE is not None:
            from .pipeline import pipelined_forward
            return pipelined_forward(self, args, kwargs)
        try:
            specs = self._input_specs
        except AttributeError:
            self._legacy_args()
            specs = self._input_specs = [
                (name, torch.Size(shape) if all(isinstance(d, int) for d in shape) else None,
                 _dtype(dtype), shape, dtype) for name, shape, dtype in self.INPUTS]
        bound = dict(arguments.bind(self, args, kwargs))
        inputs = []
        for name, size, dt, shape, dtype in specs:
            x = bound[name]
            if not (isinstance(x, torch.Tensor) and x.shape == size and x.dtype == dt
                    and x.device == self.device):          # the common case, checked fast
                x = self._check_input(name, x, shape, dtype)
            inputs.append(x)
        return self._run(inputs)

    def _legacy_args(self) -> None:
        if self.ARGS is None:           # files generated before ARGS: one tensor per argument
            type(self).ARGS = [(name, "*", [("input", name)]) for name, _, _ in self.INPUTS]
            type(self).SIGNATURE = [name for name, _, _ in self.INPUTS]

    def train_step(self, *args, **kwargs) -> torch.Tensor:
        """Forward and backward of one optimizer step on the unit's whole batch, split into
        the plan's micro-batches (pipelined: on the plan's schedule; otherwise accumulated).
        Leaves reduced gradients in .grad (as loss.backward() would) and returns the mean
        loss over the micro-batches, on every rank. Call optimizer.step() after it."""
        from .pipeline import accumulate, split_check
        self._legacy_args()
        if not torch.is_grad_enabled():
            raise ConfigError("train_step runs backward; call it outside torch.no_grad()")
        if self.TRAIN_ERROR:
            self._refuse_train()
        inputs = split_check(self, args, kwargs)
        if self.PIPELINE is None:
            return accumulate(self, inputs)
        if self.pipeline is None:
            raise ConfigError("a pipelined plan's train_step needs the process group it was "
                              "loaded in (torch.distributed.init_process_group first)")
        return self.pipeline.step(inputs)

    def _run(self, inputs: list[torch.Tensor]):
        """The generated forward on checked inputs."""
        self.__dict__["_calls"] = self.__dict__.get("_calls", 0) + 1   # (hang_report names it)
        if self.SIZES:                    # dynamic_dims: each size within its range
            check_sizes([(name, x, shape) for x, (name, shape, _) in zip(inputs, self.INPUTS)],
                        self.SIZES)
        grad = torch.is_grad_enabled()
        if grad and self.PLAN_NGPUS > 1 and any(x.requires_grad for x in inputs):
            self._check_grad_inputs(inputs)
        together = agree_before_forward(self, inputs)   # the unit's ranks run it together (lockstep.py)
        if self._calls_to_check and together:   # first calls: the unit got the same inputs
            consistency.check_call(self, inputs)     # (a collective: after the local checks)
        reducer = self._reducer if grad else None
        if reducer is not None:
            reducer.reset()               # a backward that raised must not leave state behind
        # eval mode runs the eval program where the forward differs beyond mode flags (those
        # read self.training in either program: nncompile/modes.py)
        evaluating = not self.training and self.forward_eval_impl is not None
        if not self.training and self.EVAL_ERROR:
            self._refuse_eval()
        if self.training and self.TRAIN_ERROR:
            self._refuse_train()
        impl = self.forward_eval_impl if evaluating else self.forward_impl
        if self.zero is not None:
            self.zero.reset()
            with torch.autograd.graph.saved_tensors_hooks(self.zero.pack, self.zero.unpack):
                out = impl(*inputs)
        else:
            out = impl(*inputs)
        if self.BUFFER_UPDATES and not evaluating:
            out = self._write_back(out)
        if reducer is not None:
            reducer.watch(out)            # sync mode: reduce when a backward through out ends
        spec = self._eval_out_spec if evaluating else self._out_spec
        if spec is None:
            return out
        return out[0] if spec.is_leaf() and len(out) == 1 else \
            pytree.tree_unflatten(list(out), spec)

    def _write_back(self, out: tuple) -> tuple:
        """The outputs without the buffers' new values that follow them; in training mode
        (as BatchNorm does) each is copied into its buffer. `.data` keeps the buffer's version
        counter, so the backward of this forward, which saved the old buffer, still runs."""
        k = len(self.BUFFER_UPDATES)
        out, new = tuple(out[:-k]), out[-k:]
        if self.training:
            with torch.no_grad():
                for name, t in zip(self.BUFFER_UPDATES, new):
                    getattr(self, name).data.copy_(t.detach())
        return out

    def _refuse_eval(self) -> None:
        raise ConfigError(
            f"this module is in eval mode, but its forward could not be traced in eval mode "
            f"when it was compiled ({self.EVAL_ERROR.splitlines()[0]}), so only the training "
            f"program exists; call pm.train() before calling it, or make the model's forward "
            f"traceable in eval mode")

    def _refuse_train(self) -> None:
        raise ConfigError(
            f"this module is in training mode, but its forward could not be traced in training "
            f"mode when it was compiled ({self.TRAIN_ERROR.splitlines()[0]}), so only the eval "
            f"program exists; call pm.eval() before calling it, or fix what the message names "
            f"and parallelize again to train")

    def _check_grad_inputs(self, inputs: list[torch.Tensor]) -> None:
        """An input that needs a gradient here but was traced without one: the plan holds no
        sum of its gradient over the plan unit, so each rank would see only its part."""
        for x, (name, _, _) in zip(inputs, self.INPUTS):
            if x.requires_grad and name not in self.GRAD_INPUTS:
                raise InputMismatchError(
                    f"input {name!r} requires grad, but the module was traced with a dummy "
                    f"{name!r} that does not, so the plan does not sum its gradient over the "
                    f"{self.PLAN_NGPUS} ranks of the plan unit and {name}.grad would be wrong; "
                    f"pass dummy_args with {name}.requires_grad_() to parallelize (or detach "
                    f"the input if its gradient is not needed)")

    def _check_input(self, name: str, x: Any, shape, dtype: str) -> torch.Tensor:
        """The traced input `name` must come as a tensor of its traced shape, dtype, device."""
        traced = f"a {dtype}{list(shape)} tensor"
        if not tuple(shape):        # a scalar input (scalar_inputs): a number or 0-d tensor
            x = arguments.as_scalar_tensor(x, _dtype(dtype), self.device)
            if isinstance(x, torch.Tensor) and x.dim() == 0 and x.device != self.device:
                x = x.to(self.device)
        if not isinstance(x, torch.Tensor):
            kind = f"a {type(x).__module__}.{type(x).__name__}".replace("builtins.", "")
            hint = " (convert it with torch.as_tensor)" if hasattr(x, "__array__") or \
                isinstance(x, (list, tuple)) else ""
            raise InputMismatchError(f"input {name!r} is {kind}, but the module was traced with "
                                     f"{traced}{hint}")
        if all(isinstance(d, int) for d in shape) and tuple(x.shape) != tuple(shape):
            raise InputMismatchError(
                f"input {name!r} is {str(x.dtype)}{list(x.shape)} but the module was traced "
                f"with {dtype}{list(shape)}; shapes are static unless named in "
                f"parallelize(..., dynamic_dims={{{name!r}: {{0: 'batch', ...}}}}): pass "
                f"dynamic_dims, call parallelize again with dummy_args of this shape (another "
                f"instance_name), or pad/batch to it")
        if str(x.dtype) != dtype:
            raise InputMismatchError(f"input {name!r} is {str(x.dtype)} but the module was "
                                     f"traced with {dtype}; convert it with .to({dtype})")
        if x.device.type != self.device.type or (
                x.device.index is not None and self.device.index is not None
                and x.device.index != self.device.index):
            raise InputMismatchError(f"input {name!r} is on {x.device} but this rank's module "
                                     f"is on {self.device}; move it with .to({str(self.device)!r})")
        return x

    def __deepcopy__(self, memo):
        """An independent copy on the same process groups (runtime/program/copying.py)."""
        return deepcopy_parallel_module(self, memo)

    # ---- the job around the module -----------------------------------------------------------
    _calls_to_check = 0     # first calls left whose inputs are compared across the plan unit

    @property
    def module(self) -> torch.nn.Module | None:
        """The original module this one was built from (DDP's `model.module`), the object
        given to parallelize (None when built without one). A parameter this rank keeps whole
        is the very tensor pm trains; under a plan that shards parameters (tp, ZeRO-3,
        pipelines) the others are released after loading, and the module's own state_dict()
        raises (it is not a checkpoint of pm): save with nncompile.save_checkpoint, or take
        full weights with pm.gather_params()."""
        return self.__dict__.get("_original_module")

    @property
    def mesh_axes(self) -> tuple[tuple[str, int], ...]:
        """MESH_AXES as ((name, size), ...), what runtime/protocol/groups.py's functions take."""
        return tuple(self.MESH_AXES.items())

    @property
    def mesh(self) -> Mesh:
        """The job's mesh as this file was generated for: ("dp", ["pp",] [axes...,] "plan")."""
        return Mesh.of(self.PLAN_NGPUS, self.RUNTIME_NGPUS, self.PIPE_RANKS, self.MESH_AXES)

    def axis_group(self, axis: str):
        """This rank's process group along mesh axis `axis` (CP_GROUP in the code)."""
        return self.axis_groups[axis]

    @property
    def dp_size(self) -> int:
        """How many data-parallel units run the plan (runtime_ngpus // ranks per unit)."""
        return self.mesh.size("dp")

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel unit, 0..dp_size-1 (rank // plan_ngpus without a
        pipeline): seed or shard the data by it, so a unit's ranks get the same batch."""
        rank = dist.get_rank() if dist.is_initialized() else self.RANK
        return self.mesh.unit_of(rank)

    # ---- gradients ----------------------------------------------------------------------
    def _build_reducer(self) -> Reducer | None:
        """Each gradient is reduced as nncompile.mesh.grad_reduction says: partial sums over
        the plan unit (the world when there is also data parallelism), the rest over the
        data-parallel group, all averaged over data-parallel units; frozen ones not at all."""
        if not dist.is_initialized() or self.INFERENCE_ONLY or self.zero is not None:
            return None         # ZeRO-3 reduces each unit's gradient in the gather's backward
        mesh = self.mesh
        params = []
        for name, param in local_parameters(self):
            reduction = grad_reduction(mesh, name in self._partial_grad, param.requires_grad,
                                       tuple(a for a, names in self.PARTIAL_GRAD_AXES.items()
                                             if name in names))
            if reduction is None:
                continue
            size = 1
            for dim in reduction.dims:
                size *= mesh.size(dim)
            group = group_along(reduction.dims, self.PLAN_NGPUS, self.RUNTIME_NGPUS,
                                self.PIPE_RANKS, self.mesh_axes)
            params.append((param, group, size, reduction.scale))
        if not params:
            return None
        cfg = self.compute_config
        return Reducer(params, bucket_cap_mb=cfg.reducer_bucket_cap_mb,
                       async_=cfg.use_async_reducer,
                       reduce_dtype=torch.float32 if cfg.reduce_in_fp32 else None)

    @contextlib.contextmanager
    def no_sync(self):
        """Skip gradient reduction inside the block (gradient accumulation): gradients add up
        locally and the first backward outside the block reduces the sum, as in DDP."""
        if self._reducer is None:
            yield
            return
        old, self._reducer.sync = self._reducer.sync, False
        try:
            yield
        finally:
            self._reducer.sync = old

    @property
    def require_backward_grad_sync(self) -> bool:
        """DDP's flag (nanoGPT sets it False on accumulation micro-steps): False skips the
        gradient reduction of the following backwards, as no_sync() does. Without a reducer
        (one rank; ZeRO-3, whose gradients are reduced per unit in backward) it is ignored and
        reads True; a pipeline's step reduces at its end whatever it says."""
        return self._reducer.sync if self._reducer is not None else True

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        if self._reducer is not None:
            self._reducer.sync = bool(value)

    # ---- full tensors -------------------------------------------------------------------
    def _gather(self, local: dict[str, torch.Tensor | None], rows: list | None = None,
                copy: bool = True) -> dict[str, torch.Tensor | None]:
        """Full tensors by FQN from this rank's shards by local name (of every parameter, or
        of `rows`): all-gathered along "plan" inside the stage, then shared over the pipeline
        ranks (a tied weight once). copy=False: a whole one may be `local`'s own tensor."""
        full = {}
        rows = param_rows(self) if rows is None else rows
        sources = assemble_sources(self, rows, local)    # fused parameters held as parts
        for row in rows:
            if row.part is not None:
                full.setdefault(row.source, sources[row.source])
                continue
            t = local[row.name]
            if t is not None and isinstance(row.placement, Shard) and self.plan_group is not None:
                t = all_gather_along(t, row.placement.dim, self.PLAN_NGPUS, self.plan_group)
            if t is not None:
                t = gather_split_axes(self, row, t)     # an expert weight's "ep"
            full[row.fqn] = t.clone() if copy and t is not None else t
        return share_over_pipeline(self, full)

    def local_params(self) -> dict[str, torch.Tensor]:
        """This rank's shard of every parameter by local name (under ZeRO-3 gathered from the
        flat pieces: a collective over the ZeRO group)."""
        if self.zero is not None:
            return self.zero.local_tensors()
        return {row.name: getattr(self, row.name).detach() for row in param_rows(self)}

    def local_grads(self) -> dict[str, torch.Tensor | None]:
        """This rank's shard of every reduced gradient by local name (zeros before backward,
        None for a frozen parameter); under ZeRO-2/3 gathered from the pieces (a collective)."""
        if self.zero is not None:
            return self.zero.local_tensors(grads=True)
        if self._grad_shards is not None:
            return self._grad_shards.local_grads()
        out = {}
        for row in param_rows(self):
            param = getattr(self, row.name)
            out[row.name] = None if not param.requires_grad else (
                torch.zeros_like(param) if param.grad is None else param.grad).detach()
        return out

    def local_tensors(self) -> dict[str, torch.Tensor]:
        """local_params() and the persistent buffers, by local name (what checkpoints hold)."""
        out = self.local_params()
        out.update({row.name: getattr(self, row.name) for row in buffer_rows(self)})
        return out

    @torch.no_grad()
    def load_local_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy shards of parameters and buffers (by local name, shaped like this rank's
        shard) into the module (under ZeRO-3 into the flat pieces)."""
        params = {row.name for row in param_rows(self)}
        if self.zero is not None:
            self.zero.load_local_tensors({n: t for n, t in tensors.items() if n in params})
            tensors = {n: t for n, t in tensors.items() if n not in params}
        for name, t in tensors.items():
            getattr(self, name).copy_(t)

    def gather_params(self) -> dict[str, torch.Tensor]:
        """Full parameters keyed by original FQN, every stage's under a pipeline (a collective:
        every rank of the job calls it)."""
        meet(self, "gather_params")
        return self._gather(self.local_params())

    def gather_grads(self) -> dict[str, torch.Tensor | None]:
        """Full (reduced) gradients keyed by original FQN, every stage's under a pipeline (a
        collective); None for a frozen parameter."""
        meet(self, "gather_grads")
        return self._gather(self.local_grads())

    # ---- checkpoints ------------------------------------------------------------------------
    def get_extra_state(self) -> dict:
        """Stored under `_extra_state` in local_state_dict(): the plan these shards belong to."""
        return plan_info(self)

    def set_extra_state(self, state: dict) -> None:
        check_same_plan(state, self, "this state dict")

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        """Under ZeRO-3 the state dict still holds each parameter's shard by local name
        (gathered from the flat pieces), so every checkpoint format reads it unchanged."""
        super()._save_to_state_dict(destination, prefix, keep_vars)
        for name, piece in pieces_of(self).items():     # this rank's piece, not its DTensor
            destination[prefix + name] = piece if keep_vars else piece.detach()
        if self.zero is None:
            return
        for name, t in self.zero.local_tensors().items():    # in place of the handles
            destination[prefix + name] = t

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        if self.zero is not None:
            names = [row.name for row in param_rows(self)]
            given = {n: state_dict[prefix + n] for n in names if prefix + n in state_dict}
            if given:
                self.zero.load_local_tensors(given)
            for n in given:                   # loaded: the handles stand in (meta, no copy)
                state_dict[prefix + n] = self._parameters[n]
        with pieces_registered(self):     # loaded into this rank's pieces
            super()._load_from_state_dict(state_dict, prefix, local_metadata, strict,
                                          missing_keys, unexpected_keys, error_msgs)

    # ---- the model's names (runtime/store/model_names.py) -----------------------------------------
    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True):
        """pm's parameters under the model's own names (FQNs), in the model's order, as on one
        device (runtime/store/model_names.py); the rank file's names: pieces.local_named_parameters."""
        items = torch.nn.Module.named_parameters(self, recurse=recurse,
                                                 remove_duplicate=remove_duplicate)
        return model_names.as_model(self, items, prefix)

    def named_buffers(self, prefix: str = "", recurse: bool = True,
                      remove_duplicate: bool = True):
        """pm's buffers under the model's names; computed constants keep their local names."""
        items = torch.nn.Module.named_buffers(self, recurse=recurse,
                                              remove_duplicate=remove_duplicate)
        return model_names.as_model(self, items, prefix)

    def named_children(self):
        """pm's own children (none, as generated), then the model's: code that walks a
        model's tree (the HF Trainer's get_decay_parameter_names, `pm.apply(init_fn)`,
        `pm.train()`) walks the model's, as on one device (model_names.children)."""
        yield from super().named_children()
        if not self.__dict__.get("_own_children_only"):
            yield from model_names.children(self)

    def __getattr__(self, name: str):
        """pm's own attributes, then the model's children (model_names.child_of)."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            return model_names.child_of(self, name)

    def order_as_model(self) -> None:
        model_names.order_as_model(self)

    # ---- parameters as stored -------------------------------------------------------------
    def stored_parameters(self):
        """The Parameters holding this rank's weights: parameters(), except under ZeRO-3, where
        parameters() are storage-less handles (runtime/store/zero3_handles.py) and these are the
        flat pieces."""
        if self.zero is None:
            return iter([p for _, p in local_parameters(self)])
        return iter([self.zero.flat(u) for u in self.zero.units])

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        if self._grad_shards is not None:       # ZeRO-2: its optimizer holds the gradients
            self._grad_shards.clear_grads()
        if self.zero is None:
            for piece in pieces_of(self).values():
                if piece.grad is not None:
                    piece.grad = None if set_to_none else piece.grad.zero_()
            link_grads(self)          # pm.module's views show it
            return
        for flat in self.stored_parameters():
            if flat.grad is not None:
                flat.grad = None if set_to_none else flat.grad.zero_()
        for seg in self.__dict__.get("_nnc_segments", {}).values():
            seg.grad = None if set_to_none or seg.grad is None else seg.grad
        link_grads(self)              # pm.module's views show it

    def _apply(self, fn, recurse: bool = True):
        """ZeRO-3's handles have no storage to move or convert; the flat pieces stay where
        offload_params put them."""
        self.__dict__["_own_children_only"] = True     # the model's own tensors stay
        try:
            if self.zero is None:
                with pieces_registered(self):
                    return super()._apply(fn, recurse)
            handles = dict(self._parameters)
            self._parameters.clear()
            try:
                return super()._apply(fn, recurse)
            finally:
                self._parameters.update(handles)
        finally:
            self.__dict__.pop("_own_children_only", None)

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        """The model's state dict, as FSDP2's: the model's names, in its order, a tensor the
        plan splits as a DTensor over this rank's piece (runtime/checkpoints/model_state.py), so torch's
        get_model_state_dict(pm) and DCP work as for a DDP or FSDP2 model. nncompile's
        per-rank form: local_state_dict()."""
        if args:                            # torch's old positional form
            destination, prefix, keep_vars = (*args, prefix, keep_vars)[:3]
        return model_state.model_state(self, prefix, keep_vars, destination)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load the model's form (state_dict(); DTensors of any plan or full tensors), or
        nncompile's per-rank form (local_state_dict(), whose plan is checked first)."""
        local = {n for n, _ in local_named_parameters(self)}
        if "_extra_state" in state_dict or any(k in local for k in state_dict):
            return self.load_local_state_dict(state_dict, strict=strict, assign=assign)
        return model_state.load_model_state(self, state_dict, strict=strict)

    def local_state_dict(self, keep_vars: bool = False) -> dict:
        """nncompile's per-rank form: this rank's pieces by the rank file's names, and the
        plan they belong to under `_extra_state` (what the "sharded" checkpoint format,
        dedup and merge_state_dicts read)."""
        return torch.nn.Module.state_dict(self, keep_vars=keep_vars)

    def load_local_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load local_state_dict()'s form, checking its plan before touching any tensor."""
        if "_extra_state" in state_dict:
            check_same_plan(state_dict["_extra_state"], self, "this state dict")
        return torch.nn.Module.load_state_dict(self, state_dict, strict=strict, assign=assign)


def _dtype(name: str) -> torch.dtype | None:
    """torch.float32 for "torch.float32" (None if torch has no such dtype)."""
    dt = getattr(torch, name.removeprefix("torch."), None)
    return dt if isinstance(dt, torch.dtype) else None


def _full_state(module: torch.nn.Module | None) -> dict[str, torch.Tensor]:
    if module is None:
        return {}
    out = dict(module.named_parameters(remove_duplicate=False))
    out.update(dict(module.named_buffers(remove_duplicate=False)))
    return out


for _name, _value in rank_file.defaults().items():     # what a file leaves undeclared
    setattr(ParallelModule, _name, _value)
