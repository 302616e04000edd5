"""Bad Lightning set-ups get clear errors (one process, gloo): two optimizers, no trace
inputs, clipping by value, 'auto' ZeRO without autodist, a Lightning precision plugin; and
ZeRO-1 (16-mixed, offload) and a ZeRO-3 optimizer from nncompile.build_optimizer train like
plain; nanoGPT's two parameter groups (decay / no decay, each its own lr) with a LambdaLR
train under ZeRO-1 and ZeRO-3 like plain Lightning on one device.

    python tests/workers/lightning_errors.py --savedir DIR
"""
from __future__ import annotations

import argparse
import os
import sys

import lightning as L
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import models  # noqa: E402

import nncompile  # noqa: E402
from nncompile.integration.lightning import NnCompilePrecision, NnCompileStrategy  # noqa: E402


class Lit(L.LightningModule):
    def __init__(self, optimizers="one", dummy=True):
        super().__init__()
        torch.manual_seed(0)
        self.net = models.MLP()
        self.optimizers_kind = optimizers
        self.losses: list[float] = []
        self.automatic_optimization = optimizers != "two"   # Lightning's rule for several
        if dummy:
            self.dummy_forward_args = models.batch("mlp", 0)

    def forward(self, x, y):
        return self.net(x, y)

    def training_step(self, batch, i):
        loss = self(**batch)
        self.losses.append(loss.item())
        return loss

    def train_dataloader(self):
        # one epoch = 2 steps, so a checkpoint after fit(max_steps=2) resumes at an epoch end
        if self.optimizers_kind == "nanogpt":     # one epoch of 4 steps
            return torch.utils.data.DataLoader([models.batch("mlp", i) for i in range(4)],
                                               batch_size=None)
        return torch.utils.data.DataLoader([models.batch("mlp", i) for i in range(2)],
                                           batch_size=None)

    def configure_optimizers(self):
        ps = list(self.parameters())
        if self.optimizers_kind == "two":
            return [torch.optim.SGD(ps[:2], lr=0.1), torch.optim.SGD(ps[2:], lr=0.1)]
        if self.optimizers_kind == "nanogpt":      # nanoGPT's configure_optimizers
            named = [(n, p) for n, p in self.named_parameters() if p.requires_grad]
            opt = torch.optim.AdamW(
                [{"params": [p for _, p in named if p.dim() >= 2], "weight_decay": 0.5},
                 {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0,
                  "lr": 0.02}], lr=0.05, betas=(0.9, 0.95))
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
        if self.optimizers_kind == "subset":
            return torch.optim.SGD(ps[:2], lr=0.1)
        if self.optimizers_kind == "build_optimizer":
            return nncompile.build_optimizer(self.nncompile_module, torch.optim.SGD, lr=0.1,
                                             momentum=0.9)
        if self.optimizers_kind == "momentum":
            return torch.optim.SGD(ps, lr=0.1, momentum=0.9)
        return torch.optim.SGD(ps, lr=0.1)


def fit(lit, savedir, precision="32-true", config=None, ckpt_path=None, max_steps=2, **kwargs):
    strategy = NnCompileStrategy(config or nncompile.ComputeConfig(1), pas_policy="dp",
                                 gen_savedir=savedir, reuse="moo")
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=max_steps,
                        plugins=[NnCompilePrecision(precision)], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, **kwargs)
    trainer.fit(lit, ckpt_path=ckpt_path)
    return trainer


def expect(what: str, fn, match: str) -> None:
    try:
        fn()
    except nncompile.NNCompileError as e:
        assert match in str(e), f"{what}: {e}"
        print(f"ok error {what}: {e}", flush=True)
        return
    raise AssertionError(f"{what}: no error")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--savedir", required=True)
    d = ap.parse_args().savedir
    expect("two optimizers", lambda: fit(Lit("two"), d), "exactly one optimizer")
    expect("no dummy args", lambda: fit(Lit(dummy=False), d), "dummy_forward_args")
    expect("clip by value", lambda: fit(Lit(), d, gradient_clip_val=1.0,
                                        gradient_clip_algorithm="value"), "'norm'")
    trainer = fit(Lit(), d, gradient_clip_val=1.0)
    lm = trainer.lightning_module
    assert lm.net is None and isinstance(lm.nncompile_module, nncompile.runtime.program.module.
                                         ParallelModule)
    assert {id(p) for p in lm.parameters()} == \
        {id(p) for p in lm.nncompile_module.parameters()}      # the module's are pm's
    print("ok lightning set-up: trainable modules replaced, clipping by norm", flush=True)
    for precision in ("16-true", "bf16-true", "16-mixed", "bf16-mixed"):
        trainer = fit(Lit(), f"{d}/{precision}", precision=precision, gradient_clip_val=1.0)
        pm = trainer.lightning_module.nncompile_module
        dtype = {"16-true": torch.float16, "bf16-true": torch.bfloat16}.get(precision,
                                                                            torch.float32)
        assert all(p.dtype == dtype for p in pm.parameters()), precision
        assert trainer.global_step == 2 and all(torch.isfinite(p).all() for p in pm.parameters())
        print(f"ok precision {precision}: 2 steps, parameters in {dtype}", flush=True)
    expect("state_dict_type", lambda: NnCompileStrategy(state_dict_type="full"), "sharded")
    expect("precision", lambda: NnCompilePrecision("64-true"), "supports")
    zero_checks(d)


def weights(trainer) -> dict[str, torch.Tensor]:
    return trainer.lightning_module.nncompile_module.gather_params()


def same_weights(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), what
    for k in a:
        assert torch.allclose(a[k], b[k], rtol=1e-6, atol=1e-7), f"{what}: {k}"


def groups_checks(d: str) -> None:
    """Parameter groups (and a subset of the parameters) survive the rebuild on the shards:
    losses, weights and each group's lr equal plain Lightning on one device."""
    from nncompile.runtime.optim.optimizer import ZeroOptimizer
    steps = 4
    plain_lit = Lit("nanogpt")
    plain = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False)
    plain.fit(plain_lit)
    plain.save_checkpoint(f"{d}/plain_groups.ckpt")
    want = {f"net.{k}": v.detach() for k, v in plain_lit.net.named_parameters()}
    want_lrs = [g["lr"] for g in plain.optimizers[0].param_groups]
    for zero in (1, 3):
        # one rank: read the batches in order as one device does (no distributed sampler)
        trainer = fit(Lit("nanogpt"), f"{d}/z{zero}", max_steps=steps,
                      config=nncompile.ComputeConfig(1, use_zero=zero),
                      use_distributed_sampler=False)
        opt = trainer.strategy.optimizers[0]
        assert isinstance(opt, ZeroOptimizer) and opt.stage == zero
        assert [g["weight_decay"] for g in opt.param_groups] == [0.5, 0.0]
        assert trainer.strategy.lr_scheduler_configs[0].scheduler.optimizer is opt
        assert [g["lr"] for g in opt.param_groups] == want_lrs, want_lrs
        lm = trainer.lightning_module
        assert len(lm.losses) == steps
        for a, b in zip(lm.losses, plain_lit.losses):
            assert abs(a - b) <= 1e-5 * abs(b), (lm.losses, plain_lit.losses)
        same_weights(weights(trainer), want, f"zero{zero} groups")
        print(f"ok zero{zero} two param groups + LambdaLR: {steps} losses and weights equal "
              f"plain Lightning, lrs {want_lrs}", flush=True)
    # the ZeRO-3 run's checkpoint, merged, resumes under plain Lightning (each group's values,
    # AdamW moments and the scheduler) like plain Lightning's own checkpoint of the same steps
    trainer.save_checkpoint(f"{d}/z3_groups")
    NnCompileStrategy.merge_checkpoint([f"{d}/z3_groups"], f"{d}/z3_groups.ckpt")
    runs = {}
    for name in ("plain_groups", "z3_groups"):
        runs[name] = Lit("nanogpt")
        t = L.Trainer(accelerator="cpu", devices=1, max_steps=steps + 3, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False)
        t.fit(runs[name], ckpt_path=f"{d}/{name}.ckpt")
        runs[name].decays = [g["weight_decay"] for g in t.optimizers[0].param_groups]
    got, full = runs["z3_groups"].losses, runs["plain_groups"].losses
    assert len(got) == len(full) == 3 and runs["z3_groups"].decays == [0.5, 0.0]
    for a, b in zip(got, full):
        assert abs(a - b) <= 1e-5 * abs(b), (got, full)
    print("ok zero3 two param groups: merged checkpoint resumes under plain Lightning", flush=True)
    # a subset of the parameters: the others stay where they are, as in plain
    z1 = nncompile.ComputeConfig(1, use_zero=1)
    plain = fit(Lit("subset"), f"{d}/z0")
    same_weights(weights(fit(Lit("subset"), f"{d}/z1", config=z1)), weights(plain),
                 "zero1 subset")
    print("ok zero1 optimizer over a subset: equals plain", flush=True)


def zero_checks(d: str) -> None:
    from nncompile.runtime.optim.optimizer import ZeroOptimizer
    z1 = nncompile.ComputeConfig(1, use_zero=1)
    groups_checks(d)
    expect("zero auto tp", lambda: NnCompileStrategy(nncompile.ComputeConfig(1, use_zero="auto"),
                                                     pas_policy="tp"), "pas_policy='autodist'")
    expect("lightning precision plugin", lambda: L.Trainer(
        accelerator="cpu", devices=1, precision="bf16-mixed", logger=False,
        strategy=NnCompileStrategy(nncompile.ComputeConfig(1), pas_policy="dp",
                                   gen_savedir=f"{d}/z0")), "plugins=[NnCompilePrecision(")
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False,
                        strategy=NnCompileStrategy(nncompile.ComputeConfig(1), pas_policy="dp",
                                                   gen_savedir=f"{d}/z0"))
    assert type(trainer.strategy.precision_plugin) is NnCompilePrecision
    print("ok default precision: Lightning's 32-true plugin becomes NnCompilePrecision",
          flush=True)

    # ZeRO-1 (a group of one rank here) and offload step copies of the parameters: the
    # scaler must unscale the module's gradients, not the copies'; the result equals plain
    for name, precision, cfg in (
            ("zero1 16-mixed", "16-mixed", nncompile.ComputeConfig(1, use_zero=1)),
            ("zero1 offload", "32-true", nncompile.ComputeConfig(1, use_zero=1,
                                                                 offload_optimizer=True))):
        kw = dict(precision=precision, gradient_clip_val=0.5)
        init = {f"net.{k}": v.detach().clone() for k, v in Lit().net.named_parameters()}
        plain = fit(Lit("momentum"), f"{d}/z0", **kw)
        assert all(not torch.equal(v, init[k]) for k, v in weights(plain).items()), \
            f"{name}: the steps were skipped"
        trainer = fit(Lit("momentum"), f"{d}/z1", config=cfg, **kw)
        opt = trainer.strategy.optimizers[0]
        assert isinstance(opt, ZeroOptimizer) and isinstance(opt.inner, torch.optim.SGD)
        assert opt.param_groups[0]["momentum"] == 0.9 and opt.param_groups[0]["lr"] == 0.1
        same_weights(weights(trainer), weights(plain), name)
        print(f"ok {name}: ZeroOptimizer(SGD) equals plain SGD after 2 steps", flush=True)

    z3 = nncompile.ComputeConfig(1, use_zero=3)
    plain = fit(Lit("momentum"), f"{d}/z0", gradient_clip_val=0.5)
    trainer = fit(Lit("build_optimizer"), f"{d}/z3", config=z3, gradient_clip_val=0.5)
    pm = trainer.lightning_module.nncompile_module
    assert trainer.strategy.optimizers[0].pm is pm and pm.memory.zero == 3
    assert all(f.dim() == 1 for f in pm.stored_parameters())        # flat pieces, stored
    assert not any(n.startswith("zero_") for n, _ in pm.named_parameters())   # local names
    same_weights(weights(trainer), weights(plain), "zero3")
    print("ok zero3 built by build_optimizer in configure_optimizers: kept, equals plain",
          flush=True)
    z3o = nncompile.ComputeConfig(1, use_zero=3, offload_optimizer=True, offload_params=True)
    offloaded = fit(Lit("momentum"), f"{d}/z3o", config=z3o, gradient_clip_val=0.5)
    opt = offloaded.strategy.optimizers[0]
    assert isinstance(opt, ZeroOptimizer) and opt.stage == 3 and opt.host is not None
    same_weights(weights(offloaded), weights(plain), "zero3 offload")
    print("ok zero3 offload_optimizer offload_params: equals plain", flush=True)

    # a ZeRO-3 checkpoint under ZeRO-1: sharded optimizer pieces are refused with the fix,
    # deduped ones (state by local name) load, and training continues like plain SGD resumed
    # from the same checkpoint (momentum buffers included)
    trainer.save_checkpoint(f"{d}/z3_sharded")
    trainer.strategy.state_dict_type = "deduped"
    trainer.save_checkpoint(f"{d}/z3_deduped")
    expect("zero sharded checkpoint under another stage", lambda: fit(
        Lit("momentum"), f"{d}/z1", config=z1, ckpt_path=f"{d}/z3_sharded", max_steps=4),
        "merge_checkpoint([dir], 'merged.ckpt')")
    plain = fit(Lit("momentum"), f"{d}/z0", ckpt_path=f"{d}/z3_deduped", max_steps=4,
                gradient_clip_val=0.5)
    trainer = fit(Lit("momentum"), f"{d}/z1", config=z1, ckpt_path=f"{d}/z3_deduped",
                  max_steps=4, gradient_clip_val=0.5)
    assert trainer.global_step == plain.global_step == 4
    same_weights(weights(trainer), weights(plain), "zero3 deduped -> zero1")
    print("ok zero3 deduped checkpoint resumes under zero1 like plain", flush=True)


if __name__ == "__main__":
    main()
