"""Optimizers as a contract: what grouping code sees of pm.named_parameters() (names, shapes,
dim(), requires_grad) is the same under every plan, ZeRO-3 included; parameter groups keep their
own hyper-parameters under every ZeRO stage and offload; optimizers that are not element-wise
are refused where ZeRO steps pieces of tensors; a parameter no rank used gets no gradient and
is not moved; an optimizer built from the original module before parallelize trains pm.
Every case runs on 2 simulated ranks against the same loop on one device."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import nncompile
from nncompile import ComputeConfig
from nncompile.errors import ConfigError
from nncompile.tools.simulate import run_ranks

STEPS = 5
WORLD = 2



def _batches(n=STEPS):
    # no ignored targets: each data-parallel unit's mean loss averages to the global one
    g = torch.Generator().manual_seed(0)
    return [{"idx": torch.randint(0, 64, (4, 16), generator=g),
             "targets": torch.randint(0, 64, (4, 16), generator=g)} for _ in range(n)]


def _unit_batch(dp=WORLD):
    return {k: v[:v.shape[0] // dp] for k, v in _batches(1)[0].items()}


def nanogpt_groups(named, lrs=(None, None)):
    """nanoGPT's configure_optimizers: weight decay on tensors of 2 or more dims."""
    named = [(n, p) for n, p in named if p.requires_grad]
    decay = {"params": [p for _, p in named if p.dim() >= 2], "weight_decay": 0.1}
    no_decay = {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0}
    for g, lr in zip((decay, no_decay), lrs):
        if lr is not None:
            g["lr"] = lr
    return [decay, no_decay]


def one_device(model, make_opt, steps=STEPS, sched=None):
    model = copy.deepcopy(model)
    opt = make_opt(model)
    lr_sched = sched(opt) if sched else None
    losses = []
    for b in _batches(steps):
        loss = model(**b)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if lr_sched:
            lr_sched.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}


def on_ranks(model, gen, name, make_opt, steps=STEPS, sched=None, policy="dp", plan=1, **cfg):
    """The same loop on WORLD simulated ranks (dp: each unit its rows of the batch);
    make_opt(pm, module) gets pm and the rank's own copy of the module."""
    dp = WORLD // plan

    def rank_fn(rank):
        module = copy.deepcopy(model)
        first = {k: v[:v.shape[0] // dp] for k, v in _batches(1)[0].items()}
        pm = nncompile.parallelize(module, first, ComputeConfig(plan, WORLD, **cfg),
                                   pas_policy=policy, gen_savedir=gen, instance_name=name)
        opt = make_opt(pm, module)
        lr_sched = sched(opt) if sched else None
        unit = rank // plan
        losses = []
        for b in _batches(steps):
            rows = b["idx"].shape[0] // dp
            loss = pm(**{k: v[unit * rows:(unit + 1) * rows] for k, v in b.items()})
            loss.backward()
            opt.step()
            opt.zero_grad()
            if lr_sched:
                lr_sched.step()
            losses.append(loss.detach().clone())
        return {"losses": losses, "params": pm.gather_params(),
                "named": [(n, tuple(p.shape), p.dim(), p.requires_grad, p.dtype)
                          for n, p in pm.named_parameters()],
                "lrs": lr_sched.get_last_lr() if lr_sched else None}
    return run_ranks(WORLD, rank_fn)


def assert_like(out, ref, plan=1):
    ref_losses, ref_params = ref
    losses = torch.stack([torch.stack(out[u * plan]["losses"])
                          for u in range(WORLD // plan)]).mean(0)
    torch.testing.assert_close(losses, torch.tensor(ref_losses), rtol=1e-5, atol=1e-5)
    for fqn, want in ref_params.items():
        got = out[0]["params"][fqn]
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=lambda m: f"{fqn}: {m}")


ADAMW = dict(lr=1e-2, betas=(0.9, 0.95))
_DP_NAMED = []


def dp_named(gpt, gen):
    """What pm.named_parameters() shows under plain dp (once per module)."""
    if not _DP_NAMED:
        _DP_NAMED.append(on_ranks(gpt, gen, "g00", lambda pm, m: torch.optim.AdamW(
            pm.parameters()), steps=0)[0]["named"])
    return _DP_NAMED[0]


# ---- 1. groups by shape, every ZeRO stage --------------------------------------------------
@pytest.mark.parametrize("zero,offload,how", [
    (0, False, "build"), (1, False, "build"), (2, False, "build"), (3, False, "build"),
    (3, False, "plain"), (1, True, "build"), (3, True, "build")])
def test_nanogpt_groups_equal_one_device(gpt, gen, zero, offload, how):
    ref = one_device(gpt, lambda m: torch.optim.AdamW(nanogpt_groups(m.named_parameters()),
                                                      **ADAMW))

    def make(pm, module):
        groups = nanogpt_groups(pm.named_parameters())
        if how == "plain":                 # torch's own AdamW over pm.named_parameters()
            return torch.optim.AdamW(groups, **ADAMW)
        return nncompile.build_optimizer(pm, torch.optim.AdamW, params=groups, **ADAMW)
    out = on_ranks(gpt, gen, f"g{zero}{int(offload)}", make, use_zero=zero,
                   offload_optimizer=offload)
    assert_like(out, ref)
    # grouping code sees the same names, shapes, dims, requires_grad and dtypes as under dp
    assert out[0]["named"] == dp_named(gpt, gen)
    assert [n for n, *_ in out[0]["named"]] == [n for n, _ in gpt.named_parameters()]
    assert ("h.0.attn.q_proj.weight", (32, 32), 2, True, torch.float32) in out[0]["named"]


def name_groups(named):
    """Weight decay by name, as DDP scripts and Hugging Face's Trainer group: none on biases,
    layer norms and the position table."""
    named = [(n, p) for n, p in named if p.requires_grad]
    skip = [n.endswith(".bias") or ".ln_" in n or n.startswith(("ln_f.", "wpe.")) for n, _ in named]
    return [{"params": [p for (_, p), s in zip(named, skip) if not s], "weight_decay": 0.5},
            {"params": [p for (_, p), s in zip(named, skip) if s], "weight_decay": 0.0}]


@pytest.mark.parametrize("plan,policy,zero,how", [
    (1, "dp", 0, "plain"), (1, "dp", 3, "build"), (2, "tp", 0, "plain"), (2, "tp", 0, "build")])
def test_decay_groups_by_name_equal_one_device(gpt, gen, plan, policy, zero, how):
    """pm.named_parameters() names parameters as the model does, so groups made by name
    (the split one device makes: 13 of 36 tensors decayed) train like one device."""
    ref = one_device(gpt, lambda m: torch.optim.AdamW(name_groups(m.named_parameters()),
                                                      **ADAMW))
    assert [len(g["params"]) for g in name_groups(gpt.named_parameters())] == [13, 23]

    def make(pm, module):
        groups = name_groups(pm.named_parameters())
        if how == "plain":
            return torch.optim.AdamW(groups, **ADAMW)
        return nncompile.build_optimizer(pm, torch.optim.AdamW, params=groups, **ADAMW)
    out = on_ranks(gpt, gen, f"names{plan}{policy}{zero}", make, policy=policy, plan=plan,
                   use_zero=zero)
    assert_like(out, ref, plan=plan)


def test_group_lrs_and_scheduler_survive_zero(gpt, gen):
    lrs = (1e-2, 3e-3)

    def sched(opt):
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    ref = one_device(gpt, lambda m: torch.optim.AdamW(nanogpt_groups(m.named_parameters(), lrs)),
                     sched=sched)
    for zero in (2, 3):
        out = on_ranks(gpt, gen, f"g{zero}0", lambda pm, m: nncompile.build_optimizer(
            pm, torch.optim.AdamW, nanogpt_groups(pm.named_parameters(), lrs)),
            sched=sched, use_zero=zero)
        assert_like(out, ref)
        assert out[0]["lrs"] == pytest.approx([lr / (STEPS + 1) for lr in lrs])


@pytest.mark.parametrize("zero", [2, 3])
def test_build_optimizer_converts_an_optimizer(gpt, gen, zero):
    ref = one_device(gpt, lambda m: torch.optim.AdamW(nanogpt_groups(m.named_parameters()),
                                                      **ADAMW))

    def make(pm, module):
        mine = torch.optim.AdamW(nanogpt_groups(pm.named_parameters()), **ADAMW)
        opt = nncompile.build_optimizer(pm, mine)
        assert type(opt).__name__ == "ZeroOptimizer" and len(opt.param_groups) == 2
        assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
        return opt
    assert_like(on_ranks(gpt, gen, f"g{zero}0", make, use_zero=zero), ref)


# ---- 2. optimizers that are not element-wise ------------------------------------------------
def test_not_elementwise_under_zero3(gpt, gen):
    """Under ZeRO-3 build_optimizer steps flat pieces: an optimizer that looks across elements
    is refused there with the fix; pm.parameters() are Shard(0) DTensors, so torch's LBFGS
    over them (flat views and dot products of whole gradients) gives one device's losses."""
    def train(model):
        opt = torch.optim.LBFGS(model.parameters(), max_iter=3)
        out = []
        for _ in range(2):
            def closure():
                opt.zero_grad()
                loss = model(**_unit_batch())
                loss.backward()
                return loss
            out.append(float(opt.step(closure)))
        return out
    want = train(copy.deepcopy(gpt))

    def rank_fn(rank):
        pm = nncompile.parallelize(copy.deepcopy(gpt), _unit_batch(),
                                   ComputeConfig(1, WORLD, use_zero=3), pas_policy="dp",
                                   gen_savedir=gen, instance_name="g30")
        errors = {}
        for what, make in [
                ("build Adafactor", lambda: nncompile.build_optimizer(pm, torch.optim.Adafactor)),
                ("build LBFGS", lambda: nncompile.build_optimizer(pm, torch.optim.LBFGS))]:
            with pytest.raises(ConfigError) as e:
                make()
            errors[what] = str(e.value)
        plain = torch.optim.Adafactor(pm.parameters())   # refused before its first step
        pm(**_unit_batch()).backward()
        with pytest.raises(ConfigError) as e:       # (DTensor would refuse inside it)
            plain.step()
        errors["plain Adafactor"] = str(e.value)
        plain.zero_grad()
        return errors, train(pm)
    errors, losses = run_ranks(WORLD, rank_fn)[0]
    msg = errors["build Adafactor"]
    assert "Adafactor is not known to be element-wise" in msg and "ZeRO-3" in msg, msg
    assert "elementwise=True" in msg and "declare_elementwise" in msg and "use_zero=0" in msg
    msg = errors["plain Adafactor"]
    assert "cannot step DTensor parameters" in msg and "AdamW" in msg, msg
    assert "LBFGS cannot run under ZeRO-3" in errors["build LBFGS"]
    assert "use_zero=0" in errors["build LBFGS"]
    assert max(abs(a - b) for a, b in zip(losses, want)) < 1e-5, (losses, want)


def test_not_elementwise_refused_under_zero1_unless_declared(gpt, gen):
    def rank_fn(rank):
        pm = nncompile.parallelize(copy.deepcopy(gpt), _unit_batch(),
                                   ComputeConfig(1, WORLD, use_zero=1), pas_policy="dp",
                                   gen_savedir=gen, instance_name="g10")
        with pytest.raises(ConfigError, match="Adafactor is not known to be element-wise.*ZeRO-1"):
            nncompile.build_optimizer(pm, torch.optim.Adafactor)
        with pytest.raises(ConfigError, match="LBFGS cannot run under ZeRO-1"):
            nncompile.build_optimizer(pm, torch.optim.LBFGS)
        return True
    assert all(run_ranks(WORLD, rank_fn))


class Lion(torch.optim.Optimizer):
    """Lion (Chen et al. 2023): sign of an interpolated momentum, decoupled weight decay."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.99), weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                m = self.state[p].setdefault("exp_avg", torch.zeros_like(p))
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(torch.sign(m * b1 + p.grad * (1 - b1)), alpha=-group["lr"])
                m.mul_(b2).add_(p.grad, alpha=1 - b2)


nncompile.declare_elementwise(Lion)

KNOWN = [(torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=0.01)),
         (torch.optim.Adam, dict(lr=1e-2)), (torch.optim.AdamW, dict(lr=1e-2)),
         # eps above rounding noise: the key projection's bias has a zero gradient (softmax
         # ignores a shift shared by every key) up to rounding, which Adagrad would normalize
         (torch.optim.Adagrad, dict(lr=1e-2, eps=1e-6)), (torch.optim.RMSprop, dict(lr=1e-3)),
         (torch.optim.Adamax, dict(lr=1e-2)), (torch.optim.NAdam, dict(lr=1e-2)),
         (torch.optim.RAdam, dict(lr=1e-2)), (Lion, dict(lr=1e-3, weight_decay=0.1))]


@pytest.mark.parametrize("cls,kw", KNOWN, ids=[c.__name__ for c, _ in KNOWN])
def test_known_elementwise_equal_one_device_under_zero3(gpt, gen, cls, kw):
    ref = one_device(gpt, lambda m: cls(m.parameters(), **kw), steps=3)
    out = on_ranks(gpt, gen, "g30", lambda pm, m: cls(pm.parameters(), **kw), steps=3,
                   use_zero=3)
    assert_like(out, ref)


@pytest.mark.parametrize("cls,kw,zero", [(torch.optim.SGD, dict(lr=0.1, momentum=0.9), 1),
                                         (Lion, dict(lr=1e-3, weight_decay=0.1), 2)])
def test_known_elementwise_under_zero12(gpt, gen, cls, kw, zero):
    ref = one_device(gpt, lambda m: cls(m.parameters(), **kw), steps=3)
    out = on_ranks(gpt, gen, f"g{zero}0", lambda pm, m: nncompile.build_optimizer(pm, cls, **kw),
                   steps=3, use_zero=zero)
    assert_like(out, ref)


# ---- 7. a parameter no rank used -----------------------------------------------------------
class WithUnused(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.unused = nn.Linear(8, 16), nn.Linear(16, 4), nn.Linear(8, 4)

    def forward(self, x, y):
        return F.cross_entropy(self.fc2(F.relu(self.fc1(x))), y)


@pytest.mark.parametrize("zero", [0, 1, 2])
def test_unused_parameter_gets_no_grad_and_does_not_decay(gen, zero):
    torch.manual_seed(0)
    model = WithUnused()
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, 8, generator=g), torch.randint(0, 4, (4,), generator=g))
            for _ in range(3)]
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    for x, y in data:
        ref(x, y).backward()
        opt.step()
        opt.zero_grad()

    def rank_fn(rank):
        pm = nncompile.parallelize(copy.deepcopy(model), (data[0][0][:2], data[0][1][:2]),
                                   ComputeConfig(1, WORLD, use_zero=zero), pas_policy="dp",
                                   gen_savedir=gen, instance_name=f"unused{zero}")
        opt = nncompile.build_optimizer(pm, torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
        grads = []
        for x, y in data:
            pm(x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2]).backward()
            grads.append(pm.unused_weight.grad)
            opt.step()
            opt.zero_grad()
        return grads, pm.gather_params()
    out = run_ranks(WORLD, rank_fn)
    for grads, params in out:
        assert all(gr is None for gr in grads)
        for fqn in ("unused.weight", "unused.bias"):
            assert torch.equal(params[fqn], model.get_parameter(fqn)), f"{fqn} moved"
        for fqn, want in ref.named_parameters():
            torch.testing.assert_close(params[fqn], want.detach(), rtol=1e-5, atol=1e-6)


# ---- 10. an optimizer built from the original module ---------------------------------------
@pytest.mark.parametrize("policy,plan,zero", [("dp", 1, 0), ("tp", 2, 0), ("dp", 1, 3)])
def test_optimizer_built_before_parallelize(gpt, gen, policy, plan, zero):
    ref = one_device(gpt, lambda m: torch.optim.AdamW(nanogpt_groups(m.named_parameters()),
                                                      **ADAMW))
    def rank_fn(rank):
        module = copy.deepcopy(gpt)
        # nanoGPT: the optimizer comes from the model, then the model is wrapped
        opt = torch.optim.AdamW(nanogpt_groups(module.named_parameters()), **ADAMW)
        dp = WORLD // plan
        first = {k: v[:v.shape[0] // dp] for k, v in _batches(1)[0].items()}
        pm = nncompile.parallelize(module, first, ComputeConfig(plan, WORLD, use_zero=zero),
                                   pas_policy=policy, gen_savedir=gen,
                                   instance_name=f"orig{policy}{zero}")
        kept = [n for n, p in pm.named_parameters()
                if any(p is q for q in module.parameters())]
        unit = rank // plan
        losses = []
        for b in _batches():
            rows = b["idx"].shape[0] // dp
            loss = pm(**{k: v[unit * rows:(unit + 1) * rows] for k, v in b.items()})
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach().clone())
        called = None
        try:
            module(**_batches(1)[0])
        except ConfigError as e:
            called = str(e)
        return {"losses": losses, "params": pm.gather_params(), "kept": kept, "called": called}
    out = run_ranks(WORLD, rank_fn)
    assert_like(out, ref, plan)
    if policy == "dp" and zero == 0:       # every parameter whole: pm computes with the module's
        assert len(out[0]["kept"]) == len(list(gpt.parameters()))
        assert out[0]["called"] is None
    else:                                 # split or flat: released, the step adopted pm's
        msg = out[0]["called"]
        assert msg is not None and "parallelized" in msg and "pm(...)" in msg, msg


@pytest.mark.parametrize("world,plan,policy,extra", [
    (2, 2, "tp_sp", {}), (4, 2, "tp", {"use_zero": 3}),
    (2, 2, "tp", {"parallel": {"pp": 2, "microbatches": 2}})])
def test_parameters_are_named_as_in_the_model(gpt, gen, world, plan, policy, extra):
    """pm.named_parameters() under tp_sp, tp x ZeRO-3 and a pipeline: the model's names in
    its order (a pipeline rank: its stages' subset, in order), the objects pm.parameters()
    yields."""
    want = [n for n, _ in gpt.named_parameters()]

    def rank_fn(rank):
        module = copy.deepcopy(gpt)
        pm = nncompile.parallelize(module, _unit_batch(world // plan), ComputeConfig(
            plan, world, **extra), pas_policy=policy, gen_savedir=gen,
            instance_name=f"names{world}{policy}{len(extra)}")
        named = list(pm.named_parameters())
        assert all(a is b for (_, a), b in zip(named, pm.parameters(), strict=True))
        return [n for n, _ in named]
    for got in run_ranks(world, rank_fn):
        assert got == [n for n in want if n in got] and len(got) > len(want) // 3, got
        if "parallel" not in extra:
            assert got == want
