"""NnCompilePrecision: Lightning's precision modes for a parallelized module.

    32-true     float32 everywhere
    16-true     module and floating inputs in float16 (a GradScaler may be passed)
    bf16-true   module and floating inputs in bfloat16
    16-mixed    float32 weights, forward under autocast(float16), a GradScaler
    bf16-mixed  float32 weights, forward under autocast(bfloat16)

Autocast applies to the generated code as to eager code: it calls aten ops, and autocast sits
in the dispatcher. With a scaler, "found inf" is agreed across all ranks before the step, so
ranks holding different shards skip or take a step together. The scaler unscales the parallel
module's gradients (and a ZeRO-2 optimizer's gradient pieces), not the optimizer's own
tensors: under ZeRO-1/2 and offload those are copies that get their gradients inside step().
Gradient clipping goes through nncompile.clip_grad_norm_ (the true global norm, ZeRO pieces
and pipeline stages included); clipping by value is refused.

Plans that train through pm.train_step (pipeline stages, or parallel.microbatches) run the
backward inside train_step, so the mixed modes do not autocast the whole training_step there:
each stage's forward (a pipelined plan) or the generated forward of each micro-batch is
wrapped in autocast instead, and the backward runs outside it, as with eager autocast.
"""
from __future__ import annotations

import contextlib
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from nncompile.errors import ConfigError
from nncompile.runtime.optim.clip import clip_grad_norm_
from nncompile.runtime.optim.optimizer import ZeroOptimizer

MODES = {"32-true": None, "16-true": torch.float16, "bf16-true": torch.bfloat16,
         "16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}


class NnCompilePrecision(Precision):
    def __init__(self, precision: str = "32-true", scaler: Any = None):
        precision = str(precision)
        if precision not in MODES:
            raise ConfigError(f"precision={precision!r}; NnCompilePrecision supports "
                              f"{', '.join(MODES)}")
        if scaler is not None and precision not in ("16-mixed", "16-true"):
            raise ConfigError(f"a grad scaler is only used with 16-mixed or 16-true, not "
                              f"{precision}")
        self.precision = precision
        self.dtype = MODES[precision]
        self.mixed = precision.endswith("-mixed")
        if scaler is None and precision == "16-mixed":
            device = "cuda" if torch.cuda.is_available() else "cpu"
            scaler = torch.amp.GradScaler(device)
        self.scaler = scaler
        self.parallel_module = None          # set by NnCompileStrategy after parallelizing

    # ---- dtypes -------------------------------------------------------------------------
    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        if self.dtype is not None and not self.mixed:
            return module.to(self.dtype)
        return module

    def convert_input(self, data: Any) -> Any:
        if self.dtype is None or self.mixed:
            return data
        from torch.utils._pytree import tree_map
        return tree_map(lambda t: t.to(self.dtype) if isinstance(t, torch.Tensor)
                        and t.is_floating_point() else t, data)

    def module_init_context(self):
        return contextlib.nullcontext()

    def _autocast(self):
        device = "cuda" if self.parallel_module is not None and \
            self.parallel_module.device.type == "cuda" else "cpu"
        return torch.autocast(device, dtype=self.dtype)

    @contextlib.contextmanager
    def forward_context(self):
        pm = self.parallel_module
        if not self.mixed or getattr(pm, "_autocast_forwards", None) is not None:
            yield               # a train-step plan: autocast_train_step wrapped the forwards
            return
        with self._autocast():
            yield

    def autocast_train_step(self, pm) -> None:
        """A plan trained through pm.train_step: autocast each stage's forward (pipelined) or
        the generated forward (micro-batches), not the backward train_step runs after it."""
        if not self.mixed or getattr(pm, "_autocast_forwards", None) is not None:
            return
        pm._autocast_forwards = self.dtype

        def wrap(fn):
            def autocast_forward(*args, **kwargs):
                with self._autocast():
                    return fn(*args, **kwargs)
            return autocast_forward
        if pm.pipeline is not None:
            for stage in pm.pipeline.modules:
                stage.fn = wrap(stage.fn)
        else:
            pm.forward_impl = wrap(pm.forward_impl)

    # ---- backward and step --------------------------------------------------------------
    def pre_backward(self, tensor: torch.Tensor, module) -> torch.Tensor:
        if self.scaler is not None:
            tensor = self.scaler.scale(tensor)
        return super().pre_backward(tensor, module)

    def optimizer_step(self, optimizer, model, closure, **kwargs):
        if self.scaler is None:
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        closure_result = closure()
        self._unscale(optimizer)
        self._agree_on_inf(optimizer)
        self._after_closure(model, optimizer)
        if closure_result is None and model.automatic_optimization:
            return None          # backward was skipped (e.g. by returning None from the step)
        out = self.scaler.step(optimizer, **kwargs)
        self.scaler.update()
        return out

    def _unscale(self, optimizer) -> None:
        """scaler.unscale_ on the gradients the step will read: the parallel module's (ZeRO-3:
        its flat pieces') and a ZeRO-2 optimizer's pieces. A plain optimizer over pm's
        parameters, and ZeRO-3 without offload, step those very tensors."""
        if not isinstance(optimizer, ZeroOptimizer) or \
                all(s.param is s.flat for s in optimizer.shards):
            self.scaler.unscale_(optimizer)
            return
        pm = optimizer.pm
        grads = [p.grad for p in pm.stored_parameters() if p.grad is not None]
        grads += [s.grad for s in optimizer.shards if s.grad is not None]
        holders = []                 # GradScaler reads param.grad: an alias of each gradient
        for g in grads:
            holder = g.detach()
            holder.grad = g
            holders.append(holder)
        view = SimpleNamespace(param_groups=[{"params": holders}])
        self.scaler.unscale_(view)
        states = self.scaler._per_optimizer_states
        states[id(optimizer)] = states.pop(id(view))

    def _agree_on_inf(self, optimizer) -> None:
        """A non-finite gradient on any rank's shard must skip the step on every rank: one
        flag, the maximum over this rank's devices, all-reduced over the world (ranks may hold
        gradients on different devices, or none)."""
        state = self.scaler._per_optimizer_states[id(optimizer)]
        found = state["found_inf_per_device"]
        device = self.scaler._scale.device
        flag = torch.zeros((), dtype=torch.float32, device=device)
        for f in found.values():
            flag = torch.maximum(flag, f.to(device))
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if not found:
            found[device] = flag
        for f in found.values():
            f.copy_(flag)

    def clip_grad_by_norm(self, optimizer, clip_val) -> None:
        if self.parallel_module is None:
            raise MisconfigurationException("NnCompilePrecision clips through NnCompileStrategy")
        clip_grad_norm_(self.parallel_module, float(clip_val))

    def clip_grad_by_value(self, optimizer, clip_val) -> None:
        raise ConfigError("gradient_clip_algorithm='value' is not supported by "
                          "NnCompileStrategy; clip by the global norm with "
                          "gradient_clip_algorithm='norm'")

    # ---- state --------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.scaler is not None and state_dict:
            self.scaler.load_state_dict(state_dict)
