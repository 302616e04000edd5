"""Which TrainingArguments NnCompileTrainer maps onto nncompile, and which it refuses.

Checked when the trainer is built, before Trainer makes an Accelerator (which would set up
FSDP or DeepSpeed plugins for the same model):

    refused (ConfigError, with the fix)      why
    fsdp                                     the plan already shards: ComputeConfig use_zero=3
    deepspeed                                ZeRO stages and offload: ComputeConfig use_zero /
                                             offload_optimizer / offload_params
    parallelism_config                       tensor/data parallel sizes: ComputeConfig
    fp16 (mixed)                             its GradScaler unscales through accelerate's
                                             clipping, which nncompile's global-norm clipping
                                             replaces; use bf16=True (no scaler)
    fp16_full_eval / bf16_full_eval          would cast the trained shards in place
    label_smoothing_factor                   Trainer finds a causal LM by the wrapped model's
                                             class name; pass compute_loss_func instead
    auto_find_batch_size                     the plan is compiled for one batch shape
    use_cache                                the eval-mode forward would return a cache
    activation_checkpointing offload         not mapped (activations stay where they are)
    model_init                               the parallel module is built once from `model`
    train_sampling_strategy                  its sampler shards by process, not by unit
      "batch_rebalance" with plan_ngpus > 1
    torch_compile under ZeRO-3 / pipelines   pm.compile() cannot compile those plans

    mapped                                   to
    activation_checkpointing (gradient_      the layers the model checkpoints, as the plan's
      checkpointing)                         parallel.recompute_modules (trainer.py)
    torch_compile (+ backend, mode)          pm.compile(backend=..., mode=...)
    bf16                                     the forward under torch.autocast(bfloat16)
    max_grad_norm                            nncompile.clip_grad_norm_ (true global norm)
    gradient_accumulation_steps              pm.no_sync() between the micro-batches
"""
from __future__ import annotations

import dataclasses

from nncompile.config import ComputeConfig
from nncompile.errors import ConfigError


def check_arguments(args, config: ComputeConfig, model_init=None) -> None:
    """Raise ConfigError for TrainingArguments NnCompileTrainer cannot honour."""
    if model_init is not None:
        raise ConfigError("NnCompileTrainer parallelizes `model` once; model_init (a new model "
                          "per train() call, as hyperparameter search uses) is not supported. "
                          "Pass model=... instead")
    if args is None:
        return
    if getattr(args, "fsdp", None):
        raise ConfigError(
            f"TrainingArguments(fsdp={args.fsdp!r}) with NnCompileTrainer: the nncompile plan "
            f"already places and shards the model, and FSDP would wrap it a second time. Drop "
            f"fsdp and shard parameters, gradients and optimizer state with "
            f"compute_config=ComputeConfig(plan_ngpus, runtime_ngpus, use_zero=3)")
    if getattr(args, "deepspeed", None):
        raise ConfigError(
            "TrainingArguments(deepspeed=...) with NnCompileTrainer: DeepSpeed would wrap the "
            "parallel module a second time. Drop deepspeed and use nncompile's own ZeRO: "
            "compute_config=ComputeConfig(plan_ngpus, runtime_ngpus, use_zero=1|2|3, "
            "offload_optimizer=True/False, offload_params=True/False)")
    if getattr(args, "parallelism_config", None) is not None:
        raise ConfigError("TrainingArguments(parallelism_config=...) with NnCompileTrainer: the "
                          "tensor/data-parallel layout comes from compute_config="
                          "ComputeConfig(plan_ngpus, runtime_ngpus) and pas_policy; drop "
                          "parallelism_config")
    if args.fp16:
        raise ConfigError("fp16=True with NnCompileTrainer: fp16 mixed precision needs a "
                          "GradScaler whose unscaling goes through accelerate's gradient "
                          "clipping, which NnCompileTrainer replaces by nncompile's global-norm "
                          "clipping. Use bf16=True (bfloat16 autocast, no scaler) or float32")
    if args.fp16_full_eval or args.bf16_full_eval:
        raise ConfigError("fp16_full_eval / bf16_full_eval with NnCompileTrainer: they cast the "
                          "model for evaluation, which would cast the parallel module's trained "
                          "shards in place; evaluate with bf16=True (autocast) instead")
    if args.label_smoothing_factor:
        raise ConfigError(
            f"label_smoothing_factor={args.label_smoothing_factor} with NnCompileTrainer: "
            f"Trainer's label smoother decides whether to shift labels from the class name of "
            f"the model it calls, which is the generated parallel module here. Set "
            f"label_smoothing_factor=0 and pass compute_loss_func=... that smooths the loss of "
            f"the model's logits")
    if args.auto_find_batch_size:
        raise ConfigError("auto_find_batch_size=True with NnCompileTrainer: the plan is compiled "
                          "for one batch shape, and a smaller batch after an out-of-memory "
                          "error would not fit it; set per_device_train_batch_size")
    if getattr(args, "use_cache", False):
        raise ConfigError("use_cache=True with NnCompileTrainer: in eval mode the model would "
                          "return its key/value cache, which a compiled program cannot return, "
                          "so evaluation could not run; leave use_cache=False (training and "
                          "evaluation do not use the cache)")
    ckpt_kwargs = dict(getattr(args, "activation_checkpointing_kwargs", None) or {})
    if args.activation_checkpointing and ckpt_kwargs.get("offload"):
        raise ConfigError("activation_checkpointing_kwargs={'offload': True} with "
                          "NnCompileTrainer: checkpointed layers are recomputed by the plan, "
                          "but moving their saved inputs to host memory is not mapped; drop "
                          "'offload' (or use ComputeConfig(offload_params=True) with use_zero=3 "
                          "to save parameter memory)")
    sampling = getattr(args, "train_sampling_strategy", None)
    if config.plan_ngpus > 1 and getattr(sampling, "value", sampling) == "batch_rebalance":
        raise ConfigError(f"train_sampling_strategy='batch_rebalance' with plan_ngpus="
                          f"{config.plan_ngpus}: that sampler gives each process its own "
                          f"batches, but the {config.plan_ngpus} ranks of a plan unit must read "
                          f"the same ones; use 'random', 'sequential' or 'group_by_length'")
    if args.torch_compile:
        try:            # ZeRO-3 and pipelines: ComputeConfig refuses compile=True
            dataclasses.replace(config, compile=True)
        except ConfigError as e:
            raise ConfigError(f"torch_compile=True maps to ParallelModule.compile(), which "
                              f"this compute_config cannot run: {e}") from None
