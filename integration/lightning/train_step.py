"""Plans that train through `pm.train_step` (pipeline stages, or parallel.microbatches > 1)
under NnCompileStrategy.

Such a plan cannot run a forward alone: train_step runs forward and backward of the unit's
whole batch together (on the pipeline schedule, or accumulating over micro-batches). So the
LightningModule's `forward` becomes a call of train_step that returns the mean loss as a tensor
whose backward does nothing, and an unchanged training_step trains on it:

    Lightning's closure              under a train-step plan
    training_step: loss = self(b)    zero_grad (moved here, see optimizer_step)
    zero_grad                        training_step: self(b) = pm.train_step(b): forward and
                                                    backward, gradients reduced into .grad
    backward(loss)                   backward(loss): nothing left to do
    clip, optimizer.step             clip (global norm over the stages), optimizer.step

Validation, test and predict on a pipelined plan run `pm(...)`: the stages forward only over
the unit's batch, returning the mean loss (runtime/program/pipeline.py).

Refused, each with the fix: validation/test/predict on a microbatches-only plan (its forward
runs one micro-batch), accumulate_grad_batches
> 1 (train_step reduces at its end: raise microbatches instead), a GradScaler (16-mixed: the
loss is scaled nowhere before the schedule's backward), a training_step that returns another
loss than self(...)'s or calls self(...) twice, a closure that is not Lightning's.
"""
from __future__ import annotations

import torch
from lightning.pytorch.strategies import ParallelStrategy

from nncompile.errors import ConfigError, PipelineError


class TrainStepPlans(ParallelStrategy):
    """NnCompileStrategy's part for train-step plans (mixed in before ParallelStrategy)."""

    _step_calls = 0                # self(...) calls in this training_step
    _step_loss = None              # ... and the loss the last one returned
    _zeroed_first = False          # ... and this step's zero_grad ran before training_step

    @property
    def uses_train_step(self) -> bool:
        """The plan trains through pm.train_step: pipeline stages, or micro-batches."""
        pipe = self.compute_config.pipeline
        return pipe.enabled or pipe.microbatches > 1

    def _describe_plan(self) -> str:
        pipe = self.compute_config.pipeline
        if pipe.enabled:
            return (f"this plan is pipelined (parallel.pp={pipe.stages!r}, "
                    f"schedule {pipe.schedule!r}, {pipe.microbatches} micro-batches)")
        return (f"this plan splits each batch into parallel.microbatches="
                f"{pipe.microbatches} (traced at one micro-batch)")

    def _check_train_step_setup(self, trainer) -> None:
        what = self._describe_plan()
        if trainer.accumulate_grad_batches > 1:
            m = self.compute_config.pipeline.microbatches
            raise ConfigError(
                f"accumulate_grad_batches={trainer.accumulate_grad_batches} with "
                f"NnCompileStrategy: {what}, and pm.train_step reduces the gradients at the end "
                f"of every call, so Lightning cannot accumulate over several of them. "
                f"Accumulate inside the plan instead: parallel.microbatches="
                f"{m * trainer.accumulate_grad_batches} with a batch "
                f"{trainer.accumulate_grad_batches}x larger, and accumulate_grad_batches=1")
        plugin = self.precision_plugin
        if getattr(plugin, "scaler", None) is not None:
            raise ConfigError(
                f"precision {plugin.precision!r} with a GradScaler under NnCompileStrategy: "
                f"{what}, so the backward runs inside pm.train_step (on the pipeline schedule), "
                f"where the loss cannot be scaled before it; use NnCompilePrecision("
                f"'bf16-mixed') or 'bf16-true' (no scaler), or '32-true'")

    def _train_step_forward(self, *args, **kwargs) -> torch.Tensor:
        """The LightningModule's forward under a train-step plan: forward and backward of the
        whole batch in pm.train_step; returns the mean loss with a backward that does
        nothing (the gradients are in .grad already)."""
        trainer = self.lightning_module.trainer
        if not (trainer.training and torch.is_grad_enabled()) and \
                self.compute_config.pipeline.enabled:
            # validation, test, predict: the stages forward only over the micro-batches, in
            # the mode Lightning put the module in; the mean loss on every rank
            return self.parallel_module(*args, **kwargs)
        if not (trainer.training and torch.is_grad_enabled()):
            stage = "sanity check" if trainer.sanity_checking else \
                str(trainer.state.stage.value if trainer.state.stage else "this call")
            raise PipelineError(
                f"NnCompileStrategy: {self._describe_plan()}, so a forward alone cannot run "
                f"({stage}): validation, test and predict are not supported under this plan. "
                f"Turn validation off (Trainer(limit_val_batches=0, num_sanity_val_steps=0)) "
                f"and evaluate a merged checkpoint (NnCompileStrategy.merge_checkpoint or "
                f"python -m nncompile merge) under a plan without parallel.pp/microbatches")
        if self.lightning_module.automatic_optimization and not self._zeroed_first:
            raise ConfigError(
                f"NnCompileStrategy: {self._describe_plan()}: pm.train_step leaves the gradients "
                f"in .grad during training_step, so Lightning's zero_grad must run before it, "
                f"not between training_step and backward; the strategy moves it there in "
                f"optimizer_step, but this step's closure is not Lightning's (an overridden "
                f"LightningModule.optimizer_step?). Pass Lightning's optimizer_closure to "
                f"optimizer.step unchanged, or use manual optimization")
        self._step_calls += 1
        loss = self.parallel_module.train_step(*args, **kwargs)
        self._step_loss = _TrainStepLoss.apply(loss, self._anchor(loss))
        return self._step_loss

    def _anchor(self, like: torch.Tensor) -> torch.Tensor:
        """A leaf that requires grad, so the returned loss has a (no-op) backward."""
        anchor = getattr(self, "_anchor_leaf", None)
        if anchor is None or anchor.device != like.device:
            anchor = self._anchor_leaf = torch.zeros((), device=like.device, requires_grad=True)
        return anchor

    def optimizer_step(self, optimizer, closure, model=None, **kwargs):
        """Train-step plans: Lightning's closure runs training_step, then zero_grad, then
        backward; train_step makes the gradients inside training_step, so zero_grad runs first."""
        zero = getattr(closure, "_zero_grad_fn", None) if self.uses_train_step else None
        if zero is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        closure._zero_grad_fn = None
        zero()
        self._zeroed_first = True
        try:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        finally:
            closure._zero_grad_fn = zero
            self._zeroed_first = False

    def training_step(self, *args, **kwargs):
        if not self.uses_train_step:
            return super().training_step(*args, **kwargs)
        self._step_calls, self._step_loss = 0, None
        out = super().training_step(*args, **kwargs)
        if self.lightning_module.automatic_optimization and out is not None:
            self._check_step_output(out)
        return out

    def _check_step_output(self, out) -> None:
        loss = out.get("loss") if isinstance(out, dict) else out
        what = self._describe_plan()
        if self._step_calls != 1:
            raise ConfigError(
                f"training_step called self(...) {self._step_calls} times; {what}, so each "
                f"call runs forward and backward of a whole batch (pm.train_step). Call it "
                f"once per training_step, on the batch, and return its loss")
        if loss is not self._step_loss and not (
                isinstance(loss, torch.Tensor) and loss.numel() == 1 and
                float(loss) == float(self._step_loss)):
            raise ConfigError(
                f"training_step returned a loss other than the one self(...) returned; {what}, "
                f"so the gradients come from forward's loss inside pm.train_step and a loss "
                f"computed after it (scaled, summed with another term) would not be "
                f"differentiated. Return self(...)'s loss unchanged and put every term of the "
                f"loss inside forward")


class _TrainStepLoss(torch.autograd.Function):
    """train_step's mean loss as a tensor Lightning can call backward on: the schedule ran
    the backward already, so this backward does nothing."""

    @staticmethod
    def forward(ctx, loss, anchor):
        return loss.detach().clone()

    @staticmethod
    def backward(ctx, grad):
        return None, None
