"""What user code does to the parameters through the module given to parallelize (DDP's
`model.module` habit), under tp where that module holds DTensor views of pm's pieces
(runtime/store/module_views.py): freezing and unfreezing a block mid-training, a WGAN-style clamp,
and torch's own checkpoint API (get/set_model_state_dict + torch.distributed.checkpoint) into
another plan. Each against one device. Two simulated ranks."""
from __future__ import annotations

import copy

import pytest

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor

import models
import nncompile
from nncompile import ComputeConfig
from nncompile.tools.simulate import run_ranks

WORLD, STEPS, CLAMP = 2, 5, 0.05


def _batch(step: int):
    return models.batch("gpt", step, batch_size=2, seq=16)


def _run_steps(model, opt, steps) -> list[float]:
    """zero_grad, forward, backward and step per step of `steps`; the losses."""
    out = []
    for step in steps:
        opt.zero_grad()
        loss = model(**_batch(step))
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out


def _train(model, module, step_fn=None):
    """SGD with momentum and weight decay; block h.0 frozen for steps 1-2, then unfrozen;
    every weight clamped to [-CLAMP, CLAMP] after each step (through `module`)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
    losses = []
    for step in range(STEPS):
        if step in (1, 3):
            module.get_submodule("h.0").requires_grad_(step == 3)
        opt.zero_grad()
        loss = model(**_batch(step))
        loss.backward()
        opt.step()
        with torch.no_grad():
            for p in module.parameters():
                p.clamp_(-CLAMP, CLAMP)
        losses.append(loss.item())
    return losses


def test_freeze_unfreeze_and_clamp_through_the_module_under_tp(tmp_path):
    base = models.build("gpt")
    ref = copy.deepcopy(base)
    want_losses = _train(ref, ref)
    frozen_moved = not torch.equal(ref.get_parameter("h.0.mlp_fc.weight"),
                                   base.get_parameter("h.0.mlp_fc.weight"))

    def rank_fn(rank):
        module = copy.deepcopy(base)
        pm = nncompile.parallelize(module, _batch(0), ComputeConfig(2, WORLD), pas_policy="tp",
                                   gen_savedir=tmp_path, instance_name="habits")
        return _train(pm, module), pm.gather_params()
    for losses, got in run_ranks(WORLD, rank_fn):
        assert max(abs(a - b) for a, b in zip(losses, want_losses)) < 1e-5, (losses,
                                                                             want_losses)
        for fqn, p in ref.named_parameters():
            torch.testing.assert_close(got[fqn], p.detach(), rtol=1e-5, atol=1e-6)
        assert max(float(v.abs().max()) for v in got.values()) <= float(torch.tensor(CLAMP))
    assert frozen_moved          # h.0 trained in the steps it was not frozen


def test_torch_checkpoint_api_on_the_module_into_another_plan(tmp_path):
    """get_model_state_dict(pm.module) + dcp.save under tp; a fresh parallelize under dp
    (and tp), dcp.load + set_model_state_dict: the weights and the next step's loss equal the
    uninterrupted run's. nncompile's own checkpoint functions are not called."""
    base = models.build("gpt")

    def rank_fn(rank):
        module = copy.deepcopy(base)
        pm = nncompile.parallelize(module, _batch(0), ComputeConfig(2, WORLD), pas_policy="tp",
                                   gen_savedir=tmp_path, instance_name="dcp_tp")
        opt = torch.optim.SGD(pm.parameters(), lr=0.1)
        pm(**_batch(0)).backward()
        opt.step()
        dcp.save(get_model_state_dict(pm.module), checkpoint_id=tmp_path / "ckpt")
        want, next_loss = pm.gather_params(), pm(**_batch(1)).item()
        out = []
        for policy, plan in (("dp", 1), ("tp", 2)):
            fresh = models.build("gpt", seed=7) if rank == 0 else None
            fresh = copy.deepcopy(base) if fresh is None else fresh
            pm2 = nncompile.parallelize(fresh, _batch(0), ComputeConfig(plan, WORLD),
                                        pas_policy=policy, gen_savedir=tmp_path,
                                        instance_name=f"dcp_{policy}_in")
            state = get_model_state_dict(pm2.module)
            dcp.load(state, checkpoint_id=tmp_path / "ckpt")
            set_model_state_dict(pm2.module, state)
            got = pm2.gather_params()
            out.append((max(float((got[k] - want[k]).abs().max()) for k in want),
                        abs(pm2(**_batch(1)).item() - next_loss)))
        return out
    for errors in run_ranks(WORLD, rank_fn):
        for weight_err, loss_err in errors:
            assert weight_err == 0.0 and loss_err < 1e-6, errors


@pytest.mark.parametrize("plan,world", [(1, 2), (2, 4)])
def test_zero3_in_place_edits_equal_one_device(tmp_path, plan, world):
    """WGAN-style clamping over pm.parameters() under ZeRO-3 (and tp x ZeRO-3): pm's
    parameters are the module's Shard(0) DTensors over the flat pieces, so each rank edits its
    rows of every parameter and the weights equal one device's after every step; reading them
    (p.norm(), the sum of a copy) gives one device's values, not a meta tensor."""
    base = models.build("gpt")
    ref = copy.deepcopy(base)

    def train(model, step_fn):
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        for step in range(3):
            opt.zero_grad()
            step_fn(model, step).backward()
            opt.step()
            with torch.no_grad():
                for i, p in enumerate(model.parameters()):
                    (p.data if i % 2 else p).clamp_(-CLAMP, CLAMP)
                    p.mul_(torch.full_like(p, 0.99))      # a tensor shaped like p
    train(ref, lambda m, step: m(**_batch(step)))
    want = _reads(ref)

    def rank_fn(rank):
        module = copy.deepcopy(base)
        pm = nncompile.parallelize(module, _batch(0), ComputeConfig(plan, world, use_zero=3),
                                   pas_policy="tp" if plan > 1 else "dp",
                                   gen_savedir=tmp_path, instance_name=f"zero3_{plan}")
        same = [{id(p) for p in pm.parameters()} == {id(p) for p in module.parameters()}]
        kinds = {type(p).__name__ for p in pm.parameters()}
        train(pm, lambda m, step: m(**_batch(step)))
        return pm.gather_params(), _reads(module), same, kinds
    for got, reads, same, kinds in run_ranks(world, rank_fn):
        assert all(same) and kinds == {"DTensor"}, (same, kinds)
        for fqn, p in ref.named_parameters():
            torch.testing.assert_close(got[fqn], p.detach(), rtol=1e-5, atol=1e-6)
        for fqn, (want_norm, want_total) in want.items():
            norm, total = reads[fqn]
            assert abs(norm - want_norm) <= 1e-5 * max(1.0, want_norm)
            assert abs(total - want_total) <= 1e-4 * max(1.0, abs(want_total))


def _reads(module) -> dict:
    """{FQN: (p.norm(), p.detach().clone().sum())} as one device has them."""
    return {n: (float(_full(p.norm())), float(_full(p.detach().clone().sum())))
            for n, p in module.named_parameters()}


def _loss(out):
    return out if isinstance(out, torch.Tensor) else out["loss"]


def _full(t):
    """A DTensor's value as one device has it (torch's reductions of a sharded DTensor, such
    as norm(), are partial until read with full_tensor(), as under FSDP2)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def _grad_case(case: str):
    """(model, batch of a step, config, policy) for the gradient test's cases."""
    if case == "ep":
        from test_moe import batch, moe
        return moe("mixtral"), lambda step: batch(), ComputeConfig(
            2, 2, parallel={"ep": 2}), "data"
    if case == "cp":
        from test_context_parallel import batch, hf
        return hf("llama"), lambda step: batch(32), ComputeConfig(
            2, 2, parallel={"cp": 2}), "tp"
    policy, world = case.split("_w")
    if policy.endswith("zero3"):          # ZeRO-3: Shard(0) DTensors over the flat pieces
        plan = 2 if policy.startswith("tp") else 1
        return models.build("gpt"), _batch, ComputeConfig(plan, int(world), use_zero=3), \
            "tp" if plan == 2 else "dp"
    return models.build("gpt"), _batch, ComputeConfig(2, int(world)), policy


@pytest.mark.parametrize("case", ["tp_w2", "tp_w4", "tp_sp_w2", "ep", "cp", "zero3_w2",
                                  "tp_zero3_w4"])
def test_gradients_through_the_module_equal_one_device(tmp_path, case):
    base, batch_of, cfg, policy = _grad_case(case)
    ref = copy.deepcopy(base)
    world = cfg.runtime_ngpus

    def train(model, module):
        opt = torch.optim.AdamW(module.parameters(), lr=1e-3, weight_decay=0.1)
        seen = []
        for step in range(3):
            if step == 1:                          # cleared by hand through the module
                for p in module.parameters():
                    p.grad = None
            else:
                opt.zero_grad()
            _loss(model(**batch_of(step))).backward()
            grads = {n: p.grad for n, p in module.named_parameters() if p.grad is not None}
            full = {n: _full(g).clone() for n, g in grads.items()}
            norms = {n: float(_full(g.norm())) for n, g in grads.items()}
            nans = any(bool(_full(g.isnan().any())) for g in grads.values())
            seen.append((full, norms, nans))
            opt.step()
        return seen
    want = train(ref, ref)

    def rank_fn(rank):
        module = copy.deepcopy(base)
        pm = nncompile.parallelize(module, batch_of(0), cfg, pas_policy=policy,
                                   gen_savedir=tmp_path, instance_name=f"grads_{case}")
        weights = {n: _full(p).detach().clone() for n, p in module.named_parameters()}
        gathered = pm.gather_params()
        seen = train(pm, module)
        kinds = {isinstance(p, DTensor) == isinstance(p.grad, DTensor)
                 for p in module.parameters()}
        every = all(isinstance(p, DTensor) for p in module.parameters()) and \
            all(isinstance(p, DTensor) for p in pm.parameters()) and \
            {id(p) for p in pm.parameters()} == {id(p) for p in module.parameters()}
        return seen, kinds, every, max(float((weights[n] - gathered[n]).abs().max())
                                       for n in gathered)
    for seen, kinds, every, weight_err in run_ranks(world, rank_fn):
        assert kinds == {True}, "a DTensor parameter's .grad is a DTensor"
        assert every and weight_err == 0.0, (every, weight_err)   # pm's are the module's
        for (full, norms, nans), (want_full, want_norms, _) in zip(seen, want):
            assert full.keys() == want_full.keys() and not nans
            for n, g in want_full.items():
                torch.testing.assert_close(full[n], g, rtol=1e-4, atol=1e-6)
                assert abs(norms[n] - want_norms[n]) <= 1e-4 * max(1.0, want_norms[n]), n


def _frozen_block(name: str) -> bool:
    """Block h.0's parameters, by original name or by pm's local name."""
    return name.startswith("h.0.") or name.startswith("h0_") or name.startswith("h_0_")


@pytest.mark.parametrize("plan,world,build", [(1, 2, False), (2, 4, False), (1, 2, True)])
def test_zero3_ema_and_freezing_equal_one_device(tmp_path, plan, world, build):
    """Under ZeRO-3 (and tp x ZeRO-3): an EMA kept as p.detach().clone() and updated with
    torch._foreach_lerp_ and with mul_/add_, swapped in with p.copy_(ema) to evaluate and
    swapped back (with nncompile.build_optimizer too); block h.0 frozen with p.requires_grad_(False) over pm.named_parameters()
    for steps 1-2 and unfrozen at step 3, under SGD with momentum and weight decay (a frozen
    parameter keeps its momentum and is not decayed). Every loss, the EMA's
    evaluation loss and the final weights equal one device's."""
    base = models.build("gpt")

    def train(model):
        named = list(model.named_parameters())
        params = [p for _, p in named]
        hyper = dict(lr=0.2, momentum=0.9, weight_decay=0.1)
        opt = nncompile.build_optimizer(model, torch.optim.SGD, **hyper) \
            if build and model is not ref else torch.optim.SGD(params, **hyper)
        ema = [p.detach().clone() for p in params]
        losses = []
        for step in range(5):
            if step in (1, 3):
                for n, p in named:
                    if _frozen_block(n):
                        p.requires_grad_(step == 3)
            opt.zero_grad()
            loss = model(**_batch(step))
            loss.backward()
            opt.step()
            losses.append(loss.item())
            with torch.no_grad():
                if step % 2:
                    for e, p in zip(ema, params):
                        e.mul_(0.8).add_(p, alpha=0.2)
                else:
                    torch._foreach_lerp_(ema, params, 0.2)
        with torch.no_grad():
            backup = [p.detach().clone() for p in params]
            for p, e in zip(params, ema):
                p.copy_(e)
            ema_loss = model(**_batch(9)).item()
            for p, b in zip(params, backup):
                p.copy_(b)
        return losses, ema_loss, model(**_batch(9)).item()
    ref = copy.deepcopy(base)
    want = train(ref)
    moved = not torch.equal(ref.get_parameter("h.0.mlp_fc.weight"),
                            base.get_parameter("h.0.mlp_fc.weight"))

    def rank_fn(rank):
        pm = nncompile.parallelize(copy.deepcopy(base), _batch(0),
                                   ComputeConfig(plan, world, use_zero=3),
                                   pas_policy="tp" if plan > 1 else "dp",
                                   gen_savedir=tmp_path, instance_name=f"ema_{plan}_{build}")
        return train(pm), pm.gather_params()
    for (losses, ema_loss, after), got in run_ranks(world, rank_fn):
        assert max(abs(a - b) for a, b in zip(losses, want[0])) < 1e-5, (losses, want[0])
        assert abs(ema_loss - want[1]) < 1e-5 and abs(after - want[2]) < 1e-5
        assert abs(ema_loss - after) > 1e-4        # the EMA really differs from the weights
        for fqn, p in ref.named_parameters():
            torch.testing.assert_close(got[fqn], p.detach(), rtol=1e-5, atol=1e-6, msg=fqn)
    assert moved


class NormalizedSGD(torch.optim.Optimizer):
    """Not element-wise: each tensor moves by lr * g / |g| (a per-tensor norm, as LARS/LAMB)."""

    def __init__(self, params, lr=0.05):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    p.add_(p.grad / (p.grad.norm() + 1e-3), alpha=-g["lr"])


class Orthogonalized(torch.optim.Optimizer):
    """Not element-wise: Muon-style momentum orthogonalised by Newton-Schulz for 2-D weights
    (matrix products over the whole tensor), plain momentum SGD for the rest."""

    def __init__(self, params, lr=0.02, momentum=0.9):
        super().__init__(params, {"lr": lr, "momentum": momentum})

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if "buf" not in st:
                    st["buf"] = torch.zeros_like(p)
                buf = st["buf"].mul_(g["momentum"]).add_(p.grad)
                update = buf
                if p.dim() == 2:
                    x = buf / (buf.norm() + 1e-7)
                    for _ in range(3):
                        x = 1.5 * x - 0.5 * (x @ x.T) @ x
                    update = x
                p.add_(update, alpha=-g["lr"])


@pytest.mark.parametrize("plan", ["tp", "zero3"])
@pytest.mark.parametrize("opt_cls", [NormalizedSGD, Orthogonalized])
def test_optimizers_that_look_across_elements_over_the_modules_dtensors(tmp_path, opt_cls,
                                                                         plan):
    """An optimizer that is not element-wise, over pm.parameters() (the module's DTensor
    parameters, the same objects) under tp x dp or ZeRO-3, steps with the whole tensors'
    meaning: every loss and the weights equal one device's."""
    base = models.build("gpt")

    def train(model, module):
        opt = opt_cls(module.parameters())
        losses = []
        for step in range(3):
            opt.zero_grad()
            loss = model(**_batch(step))
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses
    ref = copy.deepcopy(base)
    want = train(ref, ref)
    cfg, policy = (ComputeConfig(2, 4), "tp") if plan == "tp" else \
        (ComputeConfig(1, 4, use_zero=3), "dp")

    def rank_fn(rank):
        module = copy.deepcopy(base)
        pm = nncompile.parallelize(module, _batch(0), cfg, pas_policy=policy,
                                   gen_savedir=tmp_path, instance_name=f"across_{plan}")
        same = {id(p) for p in pm.parameters()} == {id(p) for p in module.parameters()}
        dtensors = all(isinstance(p, DTensor) for p in pm.parameters())
        return train(pm, pm), pm.gather_params(), same and dtensors
    for losses, got, same in run_ranks(4, rank_fn):
        assert same
        assert max(abs(a - b) for a, b in zip(losses, want)) < 1e-5, (losses, want)
        for fqn, p in ref.named_parameters():
            torch.testing.assert_close(got[fqn], p.detach(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("source", ["tp", "zero3"])
def test_torch_state_dict_api_with_the_optimizer_into_another_plan(tmp_path, source):
    """AdamW over the module's DTensor parameters under tp or ZeRO-3; torch's API only:
    get_model_state_dict + get_optimizer_state_dict + dcp.save after step 1; a fresh
    parallelize under dp and under tp, dcp.load + set_model_state_dict +
    set_optimizer_state_dict: the next two steps equal the uninterrupted run's."""
    from torch.distributed.checkpoint.state_dict import (get_optimizer_state_dict,
                                                         set_optimizer_state_dict)
    base = models.build("gpt")


    def rank_fn(rank):
        module = copy.deepcopy(base)
        cfg = ComputeConfig(2, WORLD) if source == "tp" else ComputeConfig(1, WORLD, use_zero=3)
        pm = nncompile.parallelize(module, _batch(0), cfg, pas_policy="tp" if source == "tp"
                                   else "dp", gen_savedir=tmp_path, instance_name=f"api_{source}")
        opt = torch.optim.AdamW(module.parameters(), lr=3e-3, weight_decay=0.1)
        _run_steps(pm, opt, [0, 1])
        dcp.save({"model": get_model_state_dict(module),
                  "optim": get_optimizer_state_dict(module, opt)},
                 checkpoint_id=tmp_path / "api_ckpt")
        want = _run_steps(pm, opt, [2, 3])
        out = []
        mine = ("tp", 2, 0) if source == "tp" else ("dp", 1, 3)
        for policy, plan, zero in [t for t in (("dp", 1, 0), ("tp", 2, 0), ("dp", 1, 3))
                                   if t != mine]:         # into the other plans
            fresh = models.build("gpt", seed=7)
            pm2 = nncompile.parallelize(fresh, _batch(0), ComputeConfig(plan, WORLD,
                                                                         use_zero=zero),
                                        pas_policy=policy, gen_savedir=tmp_path,
                                        instance_name=f"api_{policy}{zero}_in")
            opt2 = torch.optim.AdamW(fresh.parameters(), lr=3e-3, weight_decay=0.1)
            state = {"model": get_model_state_dict(fresh),
                     "optim": get_optimizer_state_dict(fresh, opt2)}
            dcp.load(state, checkpoint_id=tmp_path / "api_ckpt")
            set_model_state_dict(fresh, state["model"])
            set_optimizer_state_dict(fresh, opt2, state["optim"])
            out.append(_run_steps(pm2, opt2, [2, 3]))
        return want, out
    for want, outs in run_ranks(WORLD, rank_fn):
        for got in outs:
            assert max(abs(a - b) for a, b in zip(got, want)) < 1e-5, (got, want)


def test_torch_state_dict_api_with_build_optimizer_from_tp_into_zero3(tmp_path):
    """nncompile.build_optimizer's optimizer (it steps the pieces under pm's DTensors) through
    torch's API: get_model_state_dict + get_optimizer_state_dict + dcp.save under tp 2 after
    step 1, with pm.module and with pm given to the optimizer's; a fresh ZeRO-3 dp 2 pm and
    build_optimizer, dcp.load + set_model_state_dict + set_optimizer_state_dict: the next
    two steps equal the uninterrupted run's. (The model's state goes through pm.module:
    pm.state_dict() is this rank's shards by local name.)"""
    from torch.distributed.checkpoint.state_dict import (get_optimizer_state_dict,
                                                         set_optimizer_state_dict)
    base = models.build("gpt")

    def build(module, plan, zero, name):
        pm = nncompile.parallelize(module, _batch(0), ComputeConfig(plan, WORLD, use_zero=zero),
                                   pas_policy="tp" if plan > 1 else "dp",
                                   gen_savedir=tmp_path, instance_name=name)
        return pm, nncompile.build_optimizer(pm, torch.optim.AdamW, lr=3e-3, weight_decay=0.1)


    def rank_fn(rank):
        pm, opt = build(copy.deepcopy(base), 2, 0, "build_tp")
        _run_steps(pm, opt, [0, 1])
        for via in ("module", "pm"):
            dcp.save({"model": get_model_state_dict(pm.module),
                      "optim": get_optimizer_state_dict(pm.module if via == "module" else pm,
                                                        opt)},
                     checkpoint_id=tmp_path / f"build_{via}")
        want = _run_steps(pm, opt, [2, 3])
        out = {}
        for via in ("module", "pm"):
            pm2, opt2 = build(models.build("gpt", seed=7), 1, 3, "build_z3")
            holder = pm2.module if via == "module" else pm2
            state = {"model": get_model_state_dict(pm2.module),
                     "optim": get_optimizer_state_dict(holder, opt2)}
            dcp.load(state, checkpoint_id=tmp_path / f"build_{via}")
            set_model_state_dict(pm2.module, state["model"])
            set_optimizer_state_dict(holder, opt2, state["optim"])
            out[via] = _run_steps(pm2, opt2, [2, 3])
        return want, out
    for want, outs in run_ranks(WORLD, rank_fn):
        for via, got in outs.items():
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"via {via}: {m}")


@pytest.mark.parametrize("fmt", ["sharded", "deduped", "dcp"])
def test_nncompile_checkpoints_of_an_optimizer_over_the_modules_dtensors(tmp_path, fmt):
    """Under ZeRO-3, AdamW over the module's Shard(0) DTensors; nncompile.save_checkpoint after
    step 1, a fresh pm and optimizer (over its module) load it: the next two steps equal the
    uninterrupted run's (the optimizer's state is not lost)."""
    base = models.build("gpt")
    cfg = ComputeConfig(1, WORLD, use_zero=3)


    def rank_fn(rank):
        module = copy.deepcopy(base)
        pm = nncompile.parallelize(module, _batch(0), cfg, pas_policy="dp",
                                   gen_savedir=tmp_path, instance_name="ckpt_views")
        opt = torch.optim.AdamW(module.parameters(), lr=3e-3, weight_decay=0.1)
        _run_steps(pm, opt, [0, 1])
        nncompile.save_checkpoint(tmp_path / fmt, pm, opt, format=fmt)
        want = _run_steps(pm, opt, [2, 3])
        fresh = models.build("gpt", seed=7)
        pm2 = nncompile.parallelize(fresh, _batch(0), cfg, pas_policy="dp",
                                    gen_savedir=tmp_path, instance_name="ckpt_views")
        opt2 = torch.optim.AdamW(fresh.parameters(), lr=3e-3, weight_decay=0.1)
        nncompile.load_checkpoint(tmp_path / fmt, pm2, opt2)
        moments = sum(1 for st in opt2.state.values() if "exp_avg" in st)
        return want, _run_steps(pm2, opt2, [2, 3]), moments
    for want, got, moments in run_ranks(WORLD, rank_fn):
        assert moments == len(list(base.parameters())), moments
        assert max(abs(a - b) for a, b in zip(got, want)) < 1e-6, (got, want)


@pytest.mark.parametrize("saved_by,loaded_by", [("before", "pm"), ("pm", "before")])
def test_a_sharded_checkpoint_resumes_into_an_optimizer_built_the_other_way(tmp_path,
                                                                           saved_by, loaded_by):
    """Under tp, an optimizer built before parallelize over the model (nanoGPT's, which steps
    pm's pieces) saves a sharded checkpoint, and a resumed script builds AdamW over
    pm.parameters() (DTensors), or the other way round: the loaded moments take each
    parameter's form, and the next two steps equal the uninterrupted run's (before: the step
    raised "got mixed torch.Tensor and DTensor")."""
    base = models.build("gpt")
    cfg = ComputeConfig(2, WORLD)

    def build(seed, way):
        module = copy.deepcopy(base) if seed is None else models.build("gpt", seed=seed)
        opt = torch.optim.AdamW(module.parameters(), lr=3e-3) if way == "before" else None
        pm = nncompile.parallelize(module, _batch(0), cfg, pas_policy="tp",
                                   gen_savedir=tmp_path, instance_name="other_way")
        return pm, opt or torch.optim.AdamW(pm.parameters(), lr=3e-3)

    def rank_fn(rank):
        pm, opt = build(None, saved_by)
        _run_steps(pm, opt, [0, 1])
        nncompile.save_checkpoint(tmp_path / "ck", pm, opt, format="sharded")
        want = _run_steps(pm, opt, [2, 3])
        pm2, opt2 = build(7, loaded_by)
        nncompile.load_checkpoint(tmp_path / "ck", pm2, opt2)
        return want, _run_steps(pm2, opt2, [2, 3])
    for want, got in run_ranks(WORLD, rank_fn):
        assert max(abs(a - b) for a, b in zip(got, want)) < 1e-6, (got, want)


@pytest.mark.parametrize("kind", ["plain", "build_optimizer"])
def test_torch_dcp_api_through_pm_from_tp_dp_into_zero3_and_tp(tmp_path, kind):
    """torch's API given the wrapper, as a DDP or FSDP2 script does: AdamW over
    pm.parameters() (or nncompile.build_optimizer's) under tp 2 x dp 2,
    get_model_state_dict(pm) + get_optimizer_state_dict(pm, opt) + dcp.save after step 1 (and
    the same through pm.module); a fresh ZeRO-3 dp 4 pm and a fresh tp 2 x dp 2 pm,
    dcp.load + set_model_state_dict + set_optimizer_state_dict: the weights equal one
    device's after step 1, and the next two losses one device's. (AdamW's eps 1e-5: a key
    projection's bias has a gradient of float32 noise, which eps 1e-8 would scale up to a
    full step.)"""
    from torch.distributed.checkpoint.state_dict import (get_optimizer_state_dict,
                                                         set_optimizer_state_dict)
    world = 4
    base = models.build("gpt")

    def optimizer(pm):
        if kind == "plain":
            return torch.optim.AdamW(pm.parameters(), lr=3e-3, weight_decay=0.1, eps=1e-5)
        return nncompile.build_optimizer(pm, torch.optim.AdamW, lr=3e-3, weight_decay=0.1, eps=1e-5)

    ref = copy.deepcopy(base)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.1, eps=1e-5)
    _run_steps(ref, ref_opt, [0, 1])
    saved = {n: p.detach().clone() for n, p in ref.named_parameters()}
    want = _run_steps(ref, ref_opt, [2, 3])

    def rank_fn(rank):
        pm = nncompile.parallelize(copy.deepcopy(base), _batch(0), ComputeConfig(2, world),
                                   pas_policy="tp", gen_savedir=tmp_path,
                                   instance_name="dcp_api_tp")
        opt = optimizer(pm)
        _run_steps(pm, opt, [0, 1])
        for via in ("pm", "module"):
            holder = pm if via == "pm" else pm.module
            dcp.save({"model": get_model_state_dict(holder),
                      "optim": get_optimizer_state_dict(holder, opt)},
                     checkpoint_id=tmp_path / f"ckpt_{via}")
        out = {}
        for via in ("pm", "module"):
            for plan, zero in ((1, 3), (2, 0)):
                pm2 = nncompile.parallelize(models.build("gpt", seed=7), _batch(0),
                                            ComputeConfig(plan, world, use_zero=zero),
                                            pas_policy="tp" if plan > 1 else "dp",
                                            gen_savedir=tmp_path,
                                            instance_name=f"dcp_api_{plan}_{zero}")
                opt2 = optimizer(pm2)
                holder = pm2 if via == "pm" else pm2.module
                state = {"model": get_model_state_dict(holder),
                         "optim": get_optimizer_state_dict(holder, opt2)}
                dcp.load(state, checkpoint_id=tmp_path / f"ckpt_{via}")
                set_model_state_dict(holder, state["model"])
                set_optimizer_state_dict(holder, opt2, state["optim"])
                weights = pm2.gather_params()
                out[f"{via} into plan {plan} ZeRO-{zero}"] = (weights,
                                                               _run_steps(pm2, opt2, [2, 3]))
        return out
    for outs in run_ranks(world, rank_fn):
        for where, (weights, losses) in outs.items():
            for fqn, w in saved.items():
                torch.testing.assert_close(weights[fqn], w, rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"{where} {fqn}: {m}")
            torch.testing.assert_close(losses, want, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{where}: {m}")
