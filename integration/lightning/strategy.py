"""NnCompileStrategy: train a LightningModule with nncompile under Lightning's Trainer.

    trainer = L.Trainer(strategy=NnCompileStrategy(ComputeConfig(2, 4), pas_policy="tp"),
                        plugins=[NnCompilePrecision("bf16-mixed")], devices=4)

At setup the LightningModule's `forward` is parallelized once (trace inputs from
`dummy_forward_args`, `dummy_forward_args_fn(first training batch)` or
`example_input_array`; sizes that vary between batches, such as a smaller last batch, are
named in `dynamic_dims=` or a `dynamic_dims` attribute), `forward` is replaced by the
parallel module's and the original
submodules whose parameters it traced (frozen ones too) are set to None, so
`self.parameters()` in `configure_optimizers` yields the parallel module's shards. Ranks of
one plan unit get the same batches (the sampler is sized by data-parallel units) and
`sync_dist` logging averages over the data-parallel group.

ZeRO and offload (ComputeConfig's use_zero 1/2/3 or "auto", offload_optimizer,
offload_params): the optimizer `configure_optimizers` returns is rebuilt on the shards by
`nncompile.build_optimizer(pm, opt)` (a ZeroOptimizer with the same class, defaults and
parameter groups, each group keeping its own values), and its LR schedulers re-pointed to the
new optimizer:

    before: AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, ...}]) + LambdaLR
    after:  ZeroOptimizer(pm, AdamW, the same two groups) + the same LambdaLR, whose
            .optimizer is the ZeroOptimizer (its param_groups are the inner AdamW's)

Pipelined plans (parallel.pp, or microbatches > 1 without stages) train through
`pm.train_step`: `forward` runs it and returns the mean loss with a no-op backward, so an
unchanged `training_step` works; Lightning's zero_grad, clipping, LR schedulers, `sync_dist`
logging and checkpoints work as for any plan (train_step.py, with what is refused and why).

Checkpoints are directories with one `rank{r}.pt` per rank ("sharded" or "deduped"), written
atomically; `merge_checkpoint` turns one into an ordinary Lightning checkpoint that another
plan, or plain Lightning, loads.

Hugging Face weights: `pretrained="dir"` loads `model.save_pretrained`'s files into the parallel
module right after it is built (each rank its slices; the LightningModule may build its model
on meta), and `trainer.strategy.save_pretrained(out)` writes them back by their original names.
"""
from __future__ import annotations

import contextlib
import datetime
import functools
import shutil
import weakref
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.fabric.utilities.distributed import (_get_default_process_group_backend_for_device,
                                                    _init_dist_connection,
                                                    _sync_ddp_if_available)
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn

import nncompile
from nncompile.errors import CheckpointError, ConfigError
from nncompile.mesh import DP, Mesh
from nncompile.runtime.checkpoints.checkpoint import (load_on_every_rank, load_torch,
                                                      merge_lightning_checkpoints, rank_files,
                                                      read_meta, save_torch, staged_directory)
from nncompile.runtime.checkpoints.dedup import (deduped_model_state, deduped_optimizer_state,
                                                 load_deduped_model_state,
                                                 load_deduped_optimizer_state)
from nncompile.runtime.checkpoints.merge import load_merged_optimizer_state, load_merged_state_dict
from nncompile.runtime.optim.optimizer import ZeroOptimizer
from nncompile.runtime.store.segments import local_name
from nncompile.runtime.checkpoints.pretrained import remember_pretrained
from nncompile.rows import param_rows, state_rows
from nncompile.runtime.checkpoints.state import (describe, plan_mismatch, with_members,
                                                 without_members)
from nncompile.runtime.store.holders import plan_info

from .precision import NnCompilePrecision
from .train_step import TrainStepPlans

STATE_DICT_TYPES = ("sharded", "deduped")


class NnCompileStrategy(TrainStepPlans, ParallelStrategy):
    strategy_name = "nncompile"

    def __init__(self, compute_config: nncompile.ComputeConfig | None = None, *,
                 pas_policy: Any = "autodist", gen_savedir: str = "./.nncompile",
                 reuse: str = "match", instance_name: str | None = None,
                 state_dict_type: str = "sharded", dynamic_dims: dict | None = None,
                 pretrained: str | None = None, accelerator=None,
                 parallel_devices: list[torch.device] | None = None,
                 cluster_environment: ClusterEnvironment | None = None, checkpoint_io=None,
                 precision_plugin=None, process_group_backend: str | None = None,
                 timeout: datetime.timedelta = datetime.timedelta(minutes=30)):
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        if state_dict_type not in STATE_DICT_TYPES:
            raise ConfigError(f"state_dict_type={state_dict_type!r}; choose one of "
                              f"{STATE_DICT_TYPES}")
        self.compute_config = compute_config or nncompile.ComputeConfig(plan_ngpus=1)
        cfg = self.compute_config
        if "auto" in (cfg.zero_stage, cfg.offload_optimizer) and isinstance(pas_policy, str) \
                and pas_policy != "autodist":
            raise ConfigError(f"use_zero={cfg.use_zero!r} / offload_optimizer="
                              f"{cfg.offload_optimizer!r}: 'auto' is chosen by autodist, but "
                              f"pas_policy={pas_policy!r}; use pas_policy='autodist' or give a "
                              f"concrete value (use_zero=0-3, offload_optimizer=True/False)")
        self.pas_policy, self.gen_savedir, self.reuse = pas_policy, gen_savedir, reuse
        self.instance_name = instance_name
        self.dynamic_dims = dynamic_dims
        self.state_dict_type = state_dict_type
        self.pretrained = pretrained
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._num_nodes = 1
        self.parallel_module = None

    # ---- placement and processes ---------------------------------------------------------
    @property
    def is_distributed(self) -> bool:
        return True

    @property
    def precision_plugin(self) -> Precision:
        if self._precision_plugin is None:
            self._precision_plugin = NnCompilePrecision()
        return self._precision_plugin

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        """Lightning's default plugin (32-true) becomes NnCompilePrecision("32-true"), which
        clips by the true global norm and unscales the gradients the optimizer steps; other
        Lightning plugins are refused (their clipping and unscaling see only local shards)."""
        if plugin is not None and not isinstance(plugin, NnCompilePrecision):
            if type(plugin) is not Precision:
                mode = getattr(plugin, "precision", "32-true")
                raise ConfigError(f"NnCompileStrategy needs NnCompilePrecision, got "
                                  f"{type(plugin).__name__}; pass plugins=[NnCompilePrecision("
                                  f"{str(mode)!r})] to the Trainer instead of precision=...")
            plugin = NnCompilePrecision("32-true")
        self._precision_plugin = plugin

    @property
    def root_device(self) -> torch.device:
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, n: int) -> None:
        self._num_nodes = n

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def plan_ngpus(self) -> int:
        return self.compute_config.plan_ngpus

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Ranks of one plan unit read the same batches (the unit: the rank's "dp" coordinate;
        plan_ngpus here is the whole unit, every pipeline rank included)."""
        mesh = Mesh.of(self.plan_ngpus, self.world_size)
        return {"num_replicas": mesh.size(DP), "rank": mesh.unit_of(self.global_rank)}

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True              # the shards exist only once forward is parallelized

    def _configure_launcher(self) -> None:
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment,
                                                       self.num_processes, self.num_nodes)

    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.cluster_environment.set_global_rank(self.node_rank * self.num_processes
                                                 + self.local_rank)
        self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        from lightning.pytorch.utilities.rank_zero import rank_zero_only
        rank_zero_only.rank = self.global_rank
        if self.world_size % self.plan_ngpus:
            raise ConfigError(f"{self.world_size} processes cannot run plan units of "
                              f"plan_ngpus={self.plan_ngpus}; use devices * num_nodes = a "
                              f"multiple of {self.plan_ngpus}")
        backend = self._process_group_backend or \
            _get_default_process_group_backend_for_device(self.root_device)
        self._process_group_backend = backend
        _init_dist_connection(self.cluster_environment, backend, timeout=self._timeout)

    # ---- setup: parallelize once ---------------------------------------------------------
    def setup(self, trainer) -> None:
        if self.uses_train_step and trainer.state.fn == TrainerFn.FITTING:
            self._check_train_step_setup(trainer)
        self.accelerator.setup(trainer)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self._parallelize(trainer)
        if isinstance(self.precision_plugin, NnCompilePrecision):
            self.precision_plugin.parallel_module = self.parallel_module
            if self.uses_train_step:
                self.precision_plugin.autocast_train_step(self.parallel_module)
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            self._check_optimizers()
            self._shard_optimizer()
        self.setup_precision_plugin()

    def model_to_device(self) -> None:
        # a model built on meta (its weights come from `pretrained=`) stays there
        self.model._apply(lambda t: t if t.is_meta else t.to(self.root_device))

    def _setup_model(self, model):
        return model

    def _parallelize(self, trainer) -> None:
        lm = self.lightning_module
        if getattr(lm, "nncompile_module", None) is not None:
            self.parallel_module = lm.nncompile_module       # validate/test after fit
            return
        dummy = self.precision_plugin.convert_input(self._dummy_args(trainer, lm))
        config = self.compute_config.resolved(self.world_size)
        pm = nncompile.parallelize(lm, dummy, config, pas_policy=self.pas_policy,
                                   gen_savedir=self.gen_savedir, reuse=self.reuse,
                                   instance_name=self.instance_name or type(lm).__name__,
                                   device=self.root_device,
                                   dynamic_dims=self.dynamic_dims
                                   or getattr(lm, "dynamic_dims", None))
        remember_pretrained(pm, lm)     # a Hugging Face model inside: save_pretrained's names
        if self.pretrained is not None:
            nncompile.load_pretrained(pm, self.pretrained)
        traced = {row.source.split(".")[0] for row in param_rows(pm)}   # frozen ones included
        for name, child in list(lm.named_children()):
            if name in traced:
                setattr(lm, name, None)
        for name, p in list(lm.named_parameters(recurse=False)):
            delattr(lm, name)
        lm.nncompile_module = pm
        lm.forward = self._train_step_forward if self.uses_train_step else pm.__call__
        self.parallel_module = pm

    def _dummy_args(self, trainer, lm) -> Any:
        args = getattr(lm, "dummy_forward_args", None)
        if args is not None:
            if not isinstance(args, dict):
                raise ConfigError("dummy_forward_args must be a dict of forward's keyword "
                                  f"arguments, got {type(args).__name__}")
            return self.batch_to_device(args)
        fn = getattr(lm, "dummy_forward_args_fn", None)
        if fn is not None:
            from lightning.pytorch.trainer.connectors.data_connector import _request_dataloader
            loader = _request_dataloader(trainer.fit_loop._data_source) \
                if trainer.fit_loop._data_source.is_defined() else None
            if loader is None:
                raise ConfigError("dummy_forward_args_fn needs a training dataloader to take "
                                  "the first batch from; define dummy_forward_args instead")
            return fn(self.batch_to_device(next(iter(loader))))
        if lm.example_input_array is not None:
            return self.batch_to_device(lm.example_input_array)
        raise ConfigError(
            f"{type(lm).__name__} gives no inputs to trace forward with: add a "
            "`dummy_forward_args` dict of forward's arguments, or `dummy_forward_args_fn(batch)` "
            "that maps a training batch to that dict, or set `example_input_array`")

    def _check_optimizers(self) -> None:
        if len(self.optimizers) != 1:
            raise ConfigError(f"NnCompileStrategy supports exactly one optimizer; "
                              f"configure_optimizers returned {len(self.optimizers)}")
        if len(self.lr_scheduler_configs) > 1:
            raise ConfigError(f"NnCompileStrategy supports at most one LR scheduler; got "
                              f"{len(self.lr_scheduler_configs)}")

    def _shard_optimizer(self) -> None:
        """ZeRO / offload: rebuild configure_optimizers' optimizer on the shards
        (nncompile.build_optimizer(pm, optimizer): the same class, defaults and parameter
        groups, each group with its own values), re-point the LR schedulers to it."""
        pm, old = self.parallel_module, self.optimizers[0]
        memory = pm.memory
        if memory.zero == 0 and not memory.offload_optimizer:
            return
        if isinstance(old, ZeroOptimizer):
            if old.pm is not pm:
                raise ConfigError("configure_optimizers returned a ZeroOptimizer of another "
                                  "ParallelModule; build it over self.parameters() (or "
                                  "nncompile.build_optimizer(self.nncompile_module, ...))")
            return                 # built with nncompile.build_optimizer already
        # by local name: under ZeRO-3 a torch optimizer over pm's handles steps their segments
        outside = [p for g in old.param_groups for p in g["params"]
                   if local_name(pm, p) is None and p.requires_grad]
        if outside:
            raise ConfigError(
                f"under ZeRO and offload NnCompileStrategy rebuilds the optimizer on the shards "
                f"of the parallel module, but the one configure_optimizers returned holds "
                f"{len(outside)} parameters outside the parallelized forward; build it over "
                f"self.parameters() or self.named_parameters() (in groups if you like)")
        cls = type(old)
        try:
            new = nncompile.build_optimizer(pm, old)
        except TypeError as e:
            raise ConfigError(
                f"could not rebuild {cls.__name__} on the ZeRO shards as {cls.__name__}(groups, "
                f"**optimizer.defaults) ({e}); build it in configure_optimizers with "
                f"nncompile.build_optimizer(self.nncompile_module, {cls.__name__}, ...)") from e
        for config in self.lr_scheduler_configs:
            _repoint(config.scheduler, old, new)
        self.optimizers = [new]

    # ---- collectives ---------------------------------------------------------------------
    def barrier(self, *args, **kwargs) -> None:
        if dist.is_initialized():
            dist.barrier()

    def broadcast(self, obj, src: int = 0):
        if not dist.is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    def reduce(self, tensor, group=None, reduce_op="mean"):
        """sync_dist logging: the ranks of a plan unit hold the same value, so reduce over the
        data-parallel group (whatever group was asked for)."""
        if not isinstance(tensor, torch.Tensor):
            return tensor
        if self.parallel_module is not None:
            group = self.parallel_module.dp_group
            if group is None:                 # one data-parallel unit: nothing to average
                return tensor
        return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        if not dist.is_initialized():
            return decision
        flag = torch.tensor(int(decision), device=self.root_device)
        dist.all_reduce(flag)
        return bool(flag == self.world_size) if all else bool(flag > 0)

    def all_gather(self, tensor, group=None, sync_grads: bool = False):
        from lightning.fabric.utilities.distributed import _all_gather_ddp_if_available
        return _all_gather_ddp_if_available(tensor, group=group, sync_grads=sync_grads)

    @contextlib.contextmanager
    def block_backward_sync(self):
        if self.parallel_module is None:
            yield
            return
        with self.parallel_module.no_sync():
            yield

    # ---- checkpoints ---------------------------------------------------------------------
    def lightning_module_state_dict(self) -> dict[str, Any]:
        pm = self.parallel_module
        return pm.local_state_dict() if self.state_dict_type == "sharded" else deduped_model_state(pm)

    def optimizer_state(self, optimizer) -> dict[str, Any]:
        if self.state_dict_type == "sharded":        # with each group's members, for merging
            return with_members(self.parallel_module, optimizer, optimizer.state_dict())
        return deduped_optimizer_state(self.parallel_module, optimizer)

    def save_pretrained(self, out_dir, config=None, **kwargs):
        """nncompile.save_pretrained of the parallel module: the Hugging Face model inside the
        LightningModule (e.g. `self.model`) as model.save_pretrained writes it. Every rank."""
        return nncompile.save_pretrained(self.parallel_module, out_dir, config, **kwargs)

    def save_checkpoint(self, checkpoint: dict, filepath, storage_options=None) -> None:
        """A directory `filepath` with one rank{r}.pt per rank, renamed into place at the end."""
        meta = {"format": f"lightning-{self.state_dict_type}"}
        with staged_directory(filepath, self.parallel_module, meta) as staging:
            save_torch(checkpoint, staging / f"rank{self.global_rank}.pt")

    def remove_checkpoint(self, filepath) -> None:
        if self.is_global_zero:
            path = Path(filepath)
            shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict:
        path = Path(checkpoint_path)
        if path.is_file():                                  # merged or plain Lightning
            return load_torch(path, map_location=self.root_device)
        meta = read_meta(path)
        pm = self.parallel_module

        def refuse(why: str):
            raise CheckpointError(
                f"{path} was saved under plan [{describe(meta['plan'])}] on "
                f"{meta['world_size']} ranks, but this run is plan [{describe(plan_info(pm))}] "
                f"on {self.world_size} ranks; {why}. Merge it first: NnCompileStrategy."
                f"merge_checkpoint(['{path}'], 'merged.ckpt'), then resume from merged.ckpt")
        if meta["world_size"] != self.world_size:
            refuse(f"it was saved by {meta['world_size']} ranks")
        checkpoint = load_on_every_rank(path / f"rank{self.global_rank}.pt",
                                        map_location=self.root_device)
        saved = checkpoint.get("state_dict", {}).get("_extra_state") or {}
        whys = [plan_mismatch(saved, plan_info(pm))]            # shards decide, not fingerprints
        if dist.is_initialized():                       # every rank refuses if any rank does
            mine, whys = whys[0], [None] * dist.get_world_size()
            dist.all_gather_object(whys, mine)
        bad = next(((r, w) for r, w in enumerate(whys) if w is not None), None)
        if bad is not None:
            refuse(f"rank {bad[0]}'s shards differ: {bad[1]}")
        return checkpoint

    def load_model_state_dict(self, checkpoint: dict, strict: bool = True) -> None:
        sd, pm = checkpoint["state_dict"], self.parallel_module
        if "_extra_state" not in sd:                      # merged / plain Lightning
            load_merged_state_dict(pm, sd)
        elif self._is_deduped(sd):
            load_deduped_model_state(pm, sd)
        else:
            pm.load_local_state_dict(sd, strict=strict)

    def load_optimizer_state_dict(self, checkpoint: dict) -> None:
        opt_sd = checkpoint["optimizer_states"][0]
        optimizer, pm = self.optimizers[0], self.parallel_module
        if "_extra_state" not in checkpoint["state_dict"]:
            load_merged_optimizer_state(pm, optimizer, opt_sd)
        elif "nncompile" in opt_sd:
            load_deduped_optimizer_state(pm, optimizer, opt_sd)
        else:
            saved = opt_sd.get("nncompile_zero")
            mine = optimizer.layout() if isinstance(optimizer, ZeroOptimizer) else None
            if saved != mine:
                raise CheckpointError(
                    f"the checkpoint's optimizer state is {_pieces(saved)}, but this run's "
                    f"optimizer steps {_pieces(mine)} (use_zero={self.compute_config.use_zero!r}"
                    f", zero_ngroups={self.compute_config.zero_ngroups}); sharded optimizer "
                    f"state loads only under the ZeRO stage and groups it was saved with. "
                    f"Resume with those, or merge the checkpoint first: NnCompileStrategy."
                    f"merge_checkpoint([dir], 'merged.ckpt') (or python -m nncompile merge "
                    f"dir -o merged.ckpt) and resume from merged.ckpt; state_dict_type="
                    f"'deduped' checkpoints also load under any ZeRO stage")
            optimizer.load_state_dict(without_members(opt_sd))
        if isinstance(optimizer, ZeroOptimizer):
            # torch's load_state_dict gives the inner optimizer new param_groups / state
            # objects; ZeroOptimizer's aliases (what LR schedulers write the lr into) must
            # follow, or the inner optimizer keeps stepping with the checkpoint's lr
            optimizer.param_groups = optimizer.inner.param_groups
            optimizer.state = optimizer.inner.state
            self.optimizers = self.optimizers         # Lightning's wrappers copy __dict__

    def _is_deduped(self, sd: dict) -> bool:
        names = {row.name for row in state_rows(self.parallel_module)}
        return not names <= set(sd)

    @classmethod
    def merge_checkpoint(cls, checkpoint_files: list[str], output_file: str) -> None:
        """Merge a checkpoint directory (or its rank files) into one Lightning checkpoint that
        any plan, or plain Lightning without nncompile, resumes from."""
        ckpts = [load_torch(f, map_location="cpu")
                 for f in rank_files(checkpoint_files)]
        out = Path(output_file)
        out.parent.mkdir(parents=True, exist_ok=True)
        save_torch(merge_lightning_checkpoints(ckpts), out)

    @classmethod
    def register_strategies(cls, registry) -> None:
        registry.register("nncompile", cls, description="nncompile: compiled tensor/data "
                          "parallel training")


def _pieces(layout: dict | None) -> str:
    if layout is None:
        return "whole local shards (no ZeRO)"
    return (f"ZeRO pieces over a group of {layout['zero_size']} ranks cut into "
            f"{len(layout['shards'])} flat vectors")


def _repoint(scheduler, old, new) -> None:
    """Make an LR scheduler (and those it chains) drive `new` instead of `old`, with the
    step tracking torch's LRScheduler installs on its optimizer (no spurious "lr_scheduler.step()
    before optimizer.step()" warning)."""
    if getattr(scheduler, "optimizer", None) is old:
        scheduler.optimizer = new
        if not hasattr(new.step, "_wrapped_by_lr_sched"):
            func, ref = type(new).step, weakref.ref(new)

            @functools.wraps(func)
            def step(*args, **kwargs):
                opt = ref()
                opt._opt_called = True
                return func(opt, *args, **kwargs)
            step._wrapped_by_lr_sched = True
            new.step = step
    for inner in getattr(scheduler, "_schedulers", None) or []:
        _repoint(inner, old, new)


if "nncompile" not in StrategyRegistry:
    NnCompileStrategy.register_strategies(StrategyRegistry)
