"""NnCompileTrainer: Hugging Face's Trainer, training an nncompile ParallelModule.

    trainer = NnCompileTrainer(model=model, args=TrainingArguments(...), train_dataset=ds,
                               compute_config=nncompile.ComputeConfig(2, 4), pas_policy="tp")
    trainer.train()          # torchrun --nproc_per_node=4 train.py
    trainer.save_model(out)  # save_pretrained files, by the original names

Before the first training step (or evaluation) the model is parallelized once, traced with
the keyword arguments Trainer's compute_loss will pass: the first training batch (or
`dummy_inputs=`) plus `num_items_in_batch` as a 0-d tensor when the model takes loss kwargs,
so that count is a run-time input of the one program. The ParallelModule `pm` then stands
where Trainer puts DDP (`trainer.model_wrapped`); `trainer.model` stays the original model,
whose parameters are pm's (DTensors over its shards under tp and ZeRO-3: save with save_model).

    Trainer                                   NnCompileTrainer
    accelerator.prepare(model): DDP           _wrap_model: pm (gradients averaged over the
                                              data-parallel units by pm, no_sync() for
                                              gradient accumulation)
    AdamW over model.parameters() in the      the same optimizer (class, groups, defaults)
      decay / no-decay groups                 rebuilt on pm: nncompile.build_optimizer
    accelerator.clip_grad_norm_               nncompile.clip_grad_norm_ (true global norm)
    dataloaders sharded per process           per data-parallel unit (data.py)
    model.save_pretrained                     nncompile.save_pretrained(pm, dir)
    model.load_state_dict(checkpoint)         nncompile.load_pretrained(pm, dir)
    optimizer.pt (one rank's state)           <checkpoint>/nncompile/: every rank's shards
                                              of model and optimizer (save_checkpoint)

Trainer's accelerate machinery is bypassed where it would wrap or reshard the model: the
model is never passed to accelerator.prepare (pm is returned as already wrapped), and the
accelerator's dataloader sharding and metric gathering are replaced for multi-rank plan units
(data.py). The optimizer still goes through accelerator.prepare (a thin wrapper that steps it).
Which TrainingArguments are mapped and which are refused: checks.py.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.distributed.tensor import DTensor
from torch.utils import _pytree as pytree
from transformers import Trainer
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.trainer import SCHEDULER_NAME, TRAINING_ARGS_NAME
from transformers.utils import logging

import nncompile
from nncompile.config import ComputeConfig
from nncompile.errors import CheckpointError, ConfigError
from nncompile.runtime.checkpoints.checkpoint import FORMATS

from .checks import check_arguments
from .data import install, unit_mesh

logger = logging.get_logger(__name__)

SHARDS_DIR = "nncompile"        # <checkpoint>/nncompile/: nncompile.save_checkpoint's files
COUNT = "num_items_in_batch"


class NnCompileTrainer(Trainer):
    """transformers.Trainer over an nncompile ParallelModule; takes Trainer's arguments and:

    compute_config: nncompile.ComputeConfig (plan_ngpus, runtime_ngpus, use_zero, ...);
        default ComputeConfig(1): data parallel over every process.
    pas_policy: the plan policy ("dp", "tp", "autodist", a function).
    gen_savedir: where the generated code goes (default `<output_dir>/.nncompile`).
    dummy_inputs: forward's keyword arguments to trace (default: the first training batch).
    instance_name, reuse, dynamic_dims: as nncompile.parallelize takes them.
    checkpoint_format: "sharded" (default), "deduped" or "dcp" for the optimizer and model
        shards in each checkpoint (nncompile.save_checkpoint).
    """

    def __init__(self, model=None, args=None, *trainer_args,
                 compute_config: ComputeConfig | None = None, pas_policy: Any = "autodist",
                 gen_savedir: str | os.PathLike | None = None,
                 dummy_inputs: Mapping | None = None, instance_name: str | None = None,
                 reuse: str = "match", dynamic_dims: Any = None,
                 checkpoint_format: str = "sharded", **trainer_kwargs):
        config = compute_config if compute_config is not None else ComputeConfig(plan_ngpus=1)
        if not isinstance(config, ComputeConfig):
            raise ConfigError(f"compute_config must be an nncompile.ComputeConfig, got "
                              f"{type(config).__name__}")
        if checkpoint_format not in FORMATS:
            raise ConfigError(f"checkpoint_format={checkpoint_format!r}; choose one of "
                              f"{FORMATS}")
        if dummy_inputs is not None and not isinstance(dummy_inputs, Mapping):
            raise ConfigError(f"dummy_inputs must be a dict of forward's keyword arguments, "
                              f"got {type(dummy_inputs).__name__}")
        # before Trainer.__init__ builds an Accelerator with FSDP / DeepSpeed plugins
        check_arguments(args, config, trainer_kwargs.get("model_init"))
        self.compute_config = config
        self.pas_policy = pas_policy
        self.dummy_inputs = dummy_inputs
        self.instance_name = instance_name
        self.reuse = reuse
        self.dynamic_dims = dynamic_dims
        self.checkpoint_format = checkpoint_format
        self.parallel_module = None
        self._count_dtype: torch.dtype | None = None    # num_items_in_batch as traced
        self._pending_weights: str | None = None        # resume: loaded once pm exists
        super().__init__(model, args, *trainer_args, **trainer_kwargs)
        self._check_eval_batch()
        self.gen_savedir = gen_savedir if gen_savedir is not None else \
            os.path.join(self.args.output_dir, ".nncompile")

    def _check_eval_batch(self) -> None:
        """The plan is compiled for the training batch's shape; evaluation batches of another
        size need dynamic_dims."""
        a = self.args
        if self.dynamic_dims is None and self.dummy_inputs is None and \
                self.train_dataset is not None and self.eval_dataset is not None and \
                a.per_device_eval_batch_size != a.per_device_train_batch_size:
            raise ConfigError(
                f"per_device_eval_batch_size={a.per_device_eval_batch_size} but "
                f"per_device_train_batch_size={a.per_device_train_batch_size}: NnCompileTrainer "
                f"compiles the model for the training batch's shape, and evaluation batches "
                f"must have it too. Set per_device_eval_batch_size="
                f"{a.per_device_train_batch_size}, or pass dynamic_dims={{'input_ids': "
                f"{{0: 'batch'}}, ...}} naming the batch dimension of every batched input")

    # ---- processes, data ------------------------------------------------------------------
    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        world, plan = self.accelerator.num_processes, self.compute_config.plan_ngpus
        if world % plan:
            raise ConfigError(f"{world} processes cannot run plan units of plan_ngpus={plan}; "
                              f"launch a multiple of {plan} processes (torchrun "
                              f"--nproc_per_node)")
        runtime = self.compute_config.runtime_ngpus
        if runtime is not None and runtime != world:
            raise ConfigError(f"runtime_ngpus={runtime} but {world} processes run this job; "
                              f"launch with torchrun --nproc_per_node={runtime} or set "
                              f"runtime_ngpus={world}")
        install(self.accelerator, unit_mesh(plan, world), self.accelerator.process_index)
        self.gather_function = functools.partial(self.accelerator.gather_for_metrics,
                                                 use_gather_object=self.args.eval_use_gather_object)

    def get_tp_size(self) -> int:
        """The ranks that read the same batch: one plan unit (Trainer divides its token count
        and the world size by it)."""
        return self.compute_config.plan_ngpus

    def _track_num_input_tokens(self, inputs) -> None:
        """Trainer sums the token count over all processes; a unit's ranks count one batch."""
        before = self.state.num_input_tokens_seen
        super()._track_num_input_tokens(inputs)
        seen = self.state.num_input_tokens_seen - before
        self.state.num_input_tokens_seen = before + seen // self.compute_config.plan_ngpus

    # ---- the parallel module --------------------------------------------------------------
    def _wrap_model(self, model, training: bool = True, dataloader=None):
        """pm in place of DDP (training) or of the bare model (evaluation). Trainer passes a
        model this returns wrapped (not `self.model`) to no accelerator.prepare: pm averages
        its own gradients, and accelerate's DDP would all-reduce them a second time over
        every process (tp ranks hold different shards) and wrap its forward."""
        return self._parallel(dataloader)

    def evaluation_loop(self, dataloader, *args, **kwargs):
        self._parallel(dataloader)     # without a train_dataset, traced on this loader's batch
        return super().evaluation_loop(dataloader, *args, **kwargs)

    def _parallel(self, loader=None):
        if self.parallel_module is None:
            self._parallelize(loader)
        return self.parallel_module

    def _parallelize(self, loader) -> None:
        """Trace and compile the model once, on the arguments compute_loss will pass."""
        config = self.compute_config
        if self.args.activation_checkpointing:
            config = self._recompute_config()
        with _rng_kept():          # peeking at the data must not move any random stream
            dummy = self._trace_inputs(loader)
            pm = nncompile.parallelize(
                self.model, dummy, config, pas_policy=self.pas_policy,
                gen_savedir=self.gen_savedir, reuse=self.reuse,
                instance_name=self.instance_name or type(self.model).__name__,
                device=self._device(), dynamic_dims=self.dynamic_dims)
        if self.args.torch_compile:
            mode = self.args.torch_compile_mode
            pm.compile(backend=self.args.torch_compile_backend or "inductor",
                       **({"mode": mode} if mode else {}))
        self.parallel_module = self.model_wrapped = pm
        _refuse_eager_calls(self.model)
        if self._pending_weights is not None:
            path, self._pending_weights = self._pending_weights, None
            nncompile.load_pretrained(pm, path)

    def _device(self) -> torch.device:
        """args.device, without the index accelerate gives a CPU ("cpu:0"), which torch.load
        cannot map a checkpoint to."""
        device = self.args.device
        return torch.device("cpu") if device.type == "cpu" else device

    def _recompute_config(self) -> ComputeConfig:
        """activation_checkpointing: the layers the model checkpoints (all, or every n-th:
        activation_checkpointing_kwargs' every_n_layers) become the plan's recompute regions,
        parallel.recompute_modules; the generated code recomputes them in backward.

            model.layers.0 .. model.layers.{L-1}  ->  recompute_modules=["model.layers.0", ...]
        """
        if not getattr(self.model, "is_activation_checkpointing", False):
            # Trainer.train() turns it on; an evaluation before training has not
            kwargs = dict(self.args.activation_checkpointing_kwargs or {})
            every = kwargs.pop("every_n_layers", 1)
            self.model.activation_checkpointing_enable(
                activation_checkpointing_kwargs=kwargs or None, every_n_layers=every)
        paths = [name for name, m in self.model.named_modules()
                 if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing]
        if not paths:
            raise ConfigError(
                f"activation_checkpointing=True, but {type(self.model).__name__} checkpoints "
                f"no GradientCheckpointingLayer, so there is nothing to map onto the plan's "
                f"recompute regions. Set activation_checkpointing=False and name the modules "
                f"to recompute in ComputeConfig(parallel={{'recompute_modules': [...]}})")
        config = self.compute_config
        given = config.parallel.recompute_modules
        if given == "auto":                 # autodist decides
            return config
        merged = list(given or []) + [p for p in paths if p not in (given or [])]
        return dataclasses.replace(config, parallel=dataclasses.replace(
            config.parallel, recompute_modules=merged))

    def _trace_inputs(self, loader) -> dict:
        """The keyword arguments compute_loss passes the model for a batch like the first one:
        labels dropped where Trainer pops them, num_items_in_batch added where it adds it (a
        0-d tensor, as Trainer computes it: a run-time input, not a constant)."""
        batch = dict(self.dummy_inputs) if self.dummy_inputs is not None else \
            self._first_batch(loader)
        inputs = dict(self._prepare_inputs(batch))
        if self.compute_loss_func is not None or self.label_smoother is not None:
            inputs.pop("labels", None)
        if self.model_accepts_loss_kwargs and COUNT not in inputs:
            count = self._get_num_items_in_batch([batch], self.args.device)
            if count is not None:
                inputs[COUNT] = count
        if COUNT in inputs:
            count = inputs[COUNT]
            if not isinstance(count, torch.Tensor):
                count = torch.tensor(count)
            inputs[COUNT] = count.reshape(()).to(self.args.device)
            self._count_dtype = inputs[COUNT].dtype
        return inputs

    def _first_batch(self, loader) -> dict:
        """The first training batch (of a fresh train dataloader), else the first batch of
        `loader` or of the evaluation dataloader; collated, on the device."""
        if self.train_dataset is not None:
            loader = self.get_train_dataloader()
        elif loader is None:
            loader = self.get_eval_dataloader()
        it = iter(loader)
        try:
            batch = next(it)
        except StopIteration:
            raise ConfigError("the dataloader yields no batch to trace the model with; pass "
                              "dummy_inputs={...} (forward's keyword arguments)") from None
        finally:
            if hasattr(it, "close"):
                it.close()
            if hasattr(loader, "end"):       # accelerate's loaders: leave no state behind
                loader.end()
        if not isinstance(batch, Mapping):
            raise ConfigError(f"the dataloader yields {type(batch).__name__} batches; "
                              f"NnCompileTrainer traces forward(**batch) and needs dicts "
                              f"(or pass dummy_inputs={{...}})")
        return dict(batch)

    # ---- optimizer, step -------------------------------------------------------------------
    def create_optimizer(self, model=None):
        """Trainer's optimizer (its class, decay / no-decay groups and defaults; or the one
        passed in `optimizers=`), built over the original model's parameters and rebuilt on
        pm's by nncompile.build_optimizer (a ZeroOptimizer under use_zero >= 1)."""
        pm = self._parallel()
        current = _inner(self.optimizer)
        if current is not None and getattr(current, "_nnc_module", None) is pm:
            return self.optimizer
        given = super().create_optimizer(self.model)
        optimizer = nncompile.build_optimizer(pm, _inner(given))
        optimizer._nnc_module = pm
        if self.lr_scheduler is not None:          # one passed in with `optimizers=`
            _repoint(self.lr_scheduler, _inner(given), optimizer)
        self.optimizer = optimizer
        return optimizer

    def compute_loss(self, model, inputs, return_outputs: bool = False,
                     num_items_in_batch=None):
        """Trainer's, with num_items_in_batch as the 0-d tensor the module was traced with."""
        if model is self.parallel_module and self._count_dtype is not None and \
                num_items_in_batch is not None:
            num_items_in_batch = torch.as_tensor(num_items_in_batch).reshape(()).to(
                device=self.args.device, dtype=self._count_dtype)
        return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                    num_items_in_batch=num_items_in_batch)

    def autocast_smart_context_manager(self, cache_enabled: bool | None = True):
        """bf16=True: the generated forward under autocast(bfloat16) (accelerate would wrap
        the model's forward, which pm replaces)."""
        if self.args.bf16:
            return torch.autocast(self.args.device.type, dtype=torch.bfloat16,
                                  cache_enabled=cache_enabled)
        return super().autocast_smart_context_manager(cache_enabled)

    def _clip_grad_norm(self, model):
        return nncompile.clip_grad_norm_(self._parallel(), self.args.max_grad_norm)

    def _get_grad_norm(self, model, grad_norm=None):
        if grad_norm is None:
            grad_norm = nncompile.clip_grad_norm_(self._parallel(), float("inf"))
        return grad_norm

    # ---- saving and loading ----------------------------------------------------------------
    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """save_pretrained files of the model pm trains (every rank calls it: the full
        tensors are gathered), plus the processing class and training arguments."""
        pm = self.parallel_module
        if pm is None:
            return super()._save(output_dir, state_dict)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        nncompile.save_pretrained(pm, output_dir)
        if not self.args.should_save:
            return
        tokenizer = self.processing_class or getattr(self.data_collator, "tokenizer", None)
        if tokenizer is not None:
            tokenizer.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """Every rank's shards of model and optimizer in <output_dir>/nncompile/, the LR
        scheduler as Trainer saves it."""
        nncompile.save_checkpoint(Path(output_dir) / SHARDS_DIR, self._parallel(),
                                  _inner(self.optimizer), format=self.checkpoint_format)
        if self.args.should_save and self.lr_scheduler is not None:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        """The checkpoint's save_pretrained weights into pm (any plan's, or plain Trainer's);
        before pm exists (train() loads first) they are loaded right after parallelizing."""
        path = Path(resume_from_checkpoint)
        if not any((path / f).is_file() for f in ("model.safetensors",
                                                   "model.safetensors.index.json")):
            raise CheckpointError(f"{path} holds no model.safetensors (save_pretrained files); "
                                  f"resume from a checkpoint-N directory Trainer wrote")
        if self.parallel_module is None:
            self._pending_weights = str(path)
            return
        nncompile.load_pretrained(self.parallel_module, path)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        shards = Path(checkpoint) / SHARDS_DIR
        if shards.is_dir():
            nncompile.load_checkpoint(shards, self._parallel(), _inner(self.optimizer))
        elif self.is_world_process_zero():
            logger.warning(f"{checkpoint} has no {SHARDS_DIR}/ (the optimizer state "
                           f"NnCompileTrainer saves): the optimizer starts afresh")
        scheduler = Path(checkpoint) / SCHEDULER_NAME
        if scheduler.is_file() and self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))

    def _load_best_model(self) -> None:
        best = self.state.best_model_checkpoint
        logger.info(f"Loading best model from {best} (score: {self.state.best_metric}).")
        nncompile.load_pretrained(self._parallel(), best)


def _refuse_eager_calls(model) -> None:
    """Under a plan that shards parameters (tp, ZeRO-3) the model's parameters are DTensor
    views of pm's shards, and the model's own code (`model.generate(...)`, an eager
    `model(**batch)`) cannot run on plain tensors: torch would stop at the first op with
    "aten.embedding.default got mixed torch.Tensor and DTensor". Its token embeddings (T5's
    shared one and its encoder's and decoder's), where such a call starts, refuse plain
    tensors with a ConfigError naming the fix instead. Where the parameters are pm's own
    tensors (dp, ZeRO-1/2) the model runs as it is."""
    embeddings = [m for m in model.modules() if isinstance(m, torch.nn.Embedding)
                  and isinstance(m.weight, DTensor)]
    name = type(model).__name__

    def refuse(module, args, kwargs):
        if any(type(x) is torch.Tensor for x in pytree.tree_leaves((args, kwargs))):
            raise ConfigError(
                f"{name} itself was called (model.generate(...), or model(...) outside the "
                f"trainer), but its parameters are DTensor views of the parallel module's "
                f"shards (a plan that shards them: tp, ZeRO-3), which its own code cannot run "
                f"on. The trainer runs the compiled program (trainer.model_wrapped) for "
                f"training and evaluation losses; to generate, use a single-device copy of the "
                f"trained weights: on every rank full = trainer.parallel_module.gather_params(), "
                f"then gen = {name}(model.config).to(device); gen.load_state_dict(full, "
                f"strict=False); gen.generate(...) (or trainer.save_model(dir) on every rank "
                f"and {name}.from_pretrained(dir))")
    for m in embeddings:
        m.register_forward_pre_hook(refuse, with_kwargs=True)


def _inner(optimizer):
    """The optimizer under accelerate's AcceleratedOptimizer wrapper."""
    return getattr(optimizer, "optimizer", optimizer)


def _repoint(scheduler, old, new) -> None:
    """An LR scheduler passed in with `optimizers=` drives the rebuilt optimizer."""
    if getattr(scheduler, "optimizer", None) is old:
        scheduler.optimizer = new
    for inner in getattr(scheduler, "_schedulers", None) or []:
        _repoint(inner, old, new)


@contextlib.contextmanager
def _rng_kept():
    """Python's, numpy's and torch's random states as they were before the block."""
    py, npy = random.getstate(), np.random.get_state()
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        yield
    random.setstate(py)
    np.random.set_state(npy)
