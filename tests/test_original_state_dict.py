"""The module given to parallelize, after it: where the plan keeps every parameter whole its
state_dict() is pm's weights (the very tensors pm trains); where the plan shards by boxes (tp)
or by rows (ZeRO-3) it holds DTensor views of pm's pieces (runtime/store/module_views.py,
zero3_views.py; ZeRO-3 over groups of the data-parallel ranks as HSDP's (Replicate, Shard(0))):
reading, editing, freezing and state_dict() work as on one device; where no DTensor describes
a piece (a part of a fused q|k|v parameter split by heads) that parameter is released, and
the module's state_dict() (nanoGPT saves raw_model.state_dict()) is an error naming what to
save instead, not a dict of storage-less tensors. Simulated ranks."""
from __future__ import annotations

import copy
import io

import pytest
import torch

import nncompile
from nncompile import ComputeConfig
from nncompile.errors import CheckpointError
from nncompile.tools.simulate import run_ranks

WORLD = 2


def _batch():
    g = torch.Generator().manual_seed(0)
    return {"idx": torch.randint(0, 64, (2, 16), generator=g),
            "targets": torch.randint(0, 64, (2, 16), generator=g)}


def _after_one_step(gpt, tmp_path, name, plan, policy, check, world=WORLD, batch=_batch, **cfg):
    def rank_fn(rank):
        module = copy.deepcopy(gpt)
        pm = nncompile.parallelize(module, batch(), ComputeConfig(plan, world, **cfg),
                                   pas_policy=policy, gen_savedir=tmp_path, instance_name=name)
        opt = torch.optim.SGD(pm.parameters(), lr=0.1)
        pm(**batch()).backward()
        opt.step()
        return check(module, pm)
    return run_ranks(world, rank_fn)


@pytest.fixture(scope="module")
def fused():
    """nanoGPT's block with its fused q|k|v projection (tests/test_param_parts.py): under tp
    its weight is held as parts split by heads, which no one DTensor describes: released."""
    from test_param_parts import _TinyGPT
    torch.manual_seed(0)
    return _TinyGPT("nanogpt")


def _fused_batch():
    from test_param_parts import _batches
    return _batches(1)[0]


RELEASED = "attn.c_attn.weight"


def _released_after_one_step(fused, tmp_path, name, check):
    return _after_one_step(fused, tmp_path, name, 2, "tp", check, batch=_fused_batch)


@pytest.mark.parametrize("policy,plan", [("dp", 1), ("tp", 2)])
def test_zero3_module_state_dict_holds_dtensors(gpt, tmp_path, policy, plan):
    """Under ZeRO-3 (and tp x ZeRO-3) the module's state_dict() (nanoGPT saves
    raw_model.state_dict()) holds Shard(0) DTensors under the original names whose full
    tensors are the weights pm trained; torch.save of it works."""
    from torch.distributed.tensor import DTensor

    def check(module, pm):
        sd = module.state_dict()
        torch.save(sd, io.BytesIO())
        full = pm.gather_params()
        return ({k: isinstance(v, DTensor) for k, v in sd.items()},
                {k: float((v.full_tensor() - full[k]).abs().max()) for k, v in sd.items()
                 if k in full},                # (a tied weight once, under its first name)
                {k: not torch.equal(v, gpt.state_dict()[k]) for k, v in full.items()})
    kinds, errs, changed = _after_one_step(gpt, tmp_path, f"sd3{policy}", plan, policy, check,
                                           use_zero=3)[0]
    assert set(kinds) == set(gpt.state_dict()) and all(kinds.values()), kinds
    assert max(errs.values()) == 0.0 and any(changed.values()), errs


def test_released_module_state_dict_is_an_error(fused, tmp_path):
    """Where a module's parameter stays released (a fused q|k|v weight held as parts under
    tp) its state_dict() is an error naming what to save instead."""
    def check(module, pm):
        errors = []
        for what in (module.state_dict,                         # raw_model.state_dict()
                     lambda: torch.save(module.state_dict(), io.BytesIO()),
                     lambda: module.get_submodule("attn").state_dict()):
            with pytest.raises(CheckpointError) as e:
                what()
            errors.append(str(e.value))
        return errors, pm.gather_params()
    errors, _ = _released_after_one_step(fused, tmp_path, "sdparts", check)[0]
    for msg in errors:
        assert "state_dict() of the module given to nncompile.parallelize" in msg, msg
        assert "nncompile.save_checkpoint(dir, pm, optimizer)" in msg
        assert "pm.gather_params()" in msg
    assert "'attn.c_attn." in errors[0], errors[0]
    assert "c_attn" in errors[2], errors[2]


@pytest.mark.parametrize("policy,plan", [("dp", 1), ("tp", 2)])
def test_zero3_over_groups_of_replicas_holds_hsdp_dtensors(gpt, tmp_path, policy, plan):
    """ZeRO-3 over groups of 2 of the data-parallel ranks (zero_ngroups=2): every parameter
    of pm and of the module is one DTensor, Replicate() across the groups and Shard(0) inside
    one (FSDP2's HSDP), whose full tensors are the weights pm trained; the module holds the
    same objects, and torch's clip_grad_norm_ over them gives one device's norm."""
    from torch.distributed.tensor import Replicate

    def check(module, pm):
        full = pm.gather_params()
        same = all(p is q for p, q in zip(pm.parameters(), module.parameters()))
        pm.zero_grad()
        pm(**_batch()).backward()            # torch's clip over the DTensors: one device's norm
        norm = float(torch.nn.utils.clip_grad_norm_(pm.parameters(), 1e9))
        w = module.get_parameter("h.0.mlp_fc.weight")
        return (same, {type(p).__name__ for p in pm.parameters()}, tuple(w.placements[:2]),
                max(float((p.full_tensor() - full[n]).abs().max())
                    for n, p in module.named_parameters() if n in full), norm)
    same, kinds, placements, err, norm = _after_one_step(
        gpt, tmp_path, f"hsdp{policy}", plan, policy, check, world=4 * plan, use_zero=3,
        zero_ngroups=2)[0]
    ref = copy.deepcopy(gpt)
    ref(**_batch()).backward()                 # one device: the same step, then the norm
    step = torch.optim.SGD(ref.parameters(), lr=0.1)
    step.step()
    step.zero_grad()
    ref(**_batch()).backward()
    want = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9))
    assert abs(norm - want) <= 1e-5 * want, (norm, want)
    assert same and kinds == {"DTensor"}, kinds
    # (under tp the plan splits the weight's rows too: a strided Shard(0), as FSDP2's with tp)
    assert placements[0] == Replicate() and getattr(placements[1], "dim", None) == 0 and \
        type(placements[1]).__name__ in ("Shard", "_StridedShard") and err == 0.0, \
        (placements, err)


def test_whole_parameters_keep_the_state_dict(gpt, tmp_path):
    """dp without ZeRO keeps every parameter whole: the module's state_dict() holds the
    weights pm trained."""
    def check(module, pm):
        return module.state_dict(), pm.gather_params()
    out = _after_one_step(gpt, tmp_path, "sddp", 1, "dp", check)
    sd, full = out[0]
    changed = False
    for fqn, want in full.items():
        torch.testing.assert_close(sd[fqn], want, rtol=0, atol=0)
        changed |= not torch.equal(want, gpt.state_dict()[fqn])
    assert changed, "the step changed nothing"


def test_released_parameter_prints_and_refuses_copies(fused, tmp_path):
    """A released parameter has no storage: printing it says where its values are, and copying
    or pickling the module is an error naming the fix, instead of reading freed memory (which
    crashed the process)."""
    def check(module, pm):
        w = module.get_parameter(RELEASED)
        shown = repr(w)
        errors = []
        for what in (lambda: copy.deepcopy(module), lambda: torch.save(w, io.BytesIO())):
            with pytest.raises(nncompile.ConfigError) as e:
                what()
            errors.append(str(e.value))
        return shown, errors, isinstance(w, torch.nn.Parameter), tuple(w.shape)
    shown, errors, is_param, shape = _released_after_one_step(fused, tmp_path, "rel", check)[0]
    assert shown.startswith("<released Parameter [") and "ParallelModule" in shown, shown
    assert is_param and shape == tuple(fused.get_parameter(RELEASED).shape)
    assert "cannot copy a parameter of a module that was parallelized" in errors[0], errors[0]
    assert "cannot pickle" in errors[1] and "copy.deepcopy(model)" in errors[1], errors[1]


def test_reading_a_released_parameter_is_an_error_not_a_crash(fused, tmp_path):
    """DDP's `model.module` habit where a module's parameter is released (a fused q|k|v
    weight held as parts under tp):
    p.norm(), p.data.clamp_(), p.clamp_() and torch functions of a released parameter read no
    freed memory (that crashed the process): each is a ConfigError naming the parameter and
    pm.gather_params(); its metadata still reads, and pm's training goes on."""
    def check(module, pm):
        w = module.get_parameter(RELEASED)
        errors = []
        for what in (lambda: w.norm(), lambda: w.data.clamp_(-1, 1), lambda: w.clamp_(-1, 1),
                     lambda: torch.nn.utils.parameters_to_vector([w]), lambda: w.detach(),
                     lambda: w + 1):
            with pytest.raises(nncompile.ConfigError) as e:
                what()
            errors.append(str(e.value))
        meta = (tuple(w.shape), w.dtype, w.requires_grad, w.dim(), w.numel())
        before = {k: v.clone() for k, v in pm.gather_params().items()}
        opt = torch.optim.SGD(pm.parameters(), lr=0.1)
        pm(**_fused_batch()).backward()
        opt.step()
        moved = any(not torch.equal(v, before[k]) for k, v in pm.gather_params().items())
        return errors, meta, moved
    errors, meta, moved = _released_after_one_step(fused, tmp_path, "read3", check)[0]
    shape = tuple(fused.get_parameter(RELEASED).shape)
    assert meta == (shape, torch.float32, True, 2, shape[0] * shape[1]) and moved
    assert "cannot compute norm on the parameter 'attn.c_attn.weight'" in errors[0], errors[0]
    assert "cannot read .data of the parameter 'attn.c_attn.weight'" in errors[1], errors[1]
    for msg in errors:
        assert "pm.gather_params()['attn.c_attn.weight']" in msg, msg


def test_tp_module_holds_dtensor_views_of_pm(gpt, tmp_path):
    """Under tp the module's split parameters are DTensors whose local tensors are pm's
    pieces: full_tensor() and norms equal the gathered weights, an in-place edit of the module
    (p.data.clamp_, p.mul_) changes what pm trains, state_dict() holds DTensors under the
    original names, and calling the module itself is still an error naming pm."""
    from torch.distributed.tensor import DTensor, Shard

    def check(module, pm):
        full = pm.gather_params()
        w = module.get_parameter("h.0.mlp_fc.weight")
        out = {"placements": w.placements, "is_param": isinstance(w, torch.nn.Parameter),
               "full": all(torch.equal(p.full_tensor() if isinstance(p, DTensor) else p,
                                       full[k]) for k, p in module.named_parameters()),
               "norm": float(w.norm().full_tensor()), "want_norm": float(full[
                   "h.0.mlp_fc.weight"].norm()),
               "split": sum(isinstance(p, DTensor) for p in module.parameters())}
        with torch.no_grad():
            w.data.clamp_(-0.01, 0.01)
            module.get_parameter("h.1.mlp_proj.weight").mul_(0)
        after = pm.gather_params()
        out["clamped"] = float(after["h.0.mlp_fc.weight"].abs().max())
        out["zeroed"] = float(after["h.1.mlp_proj.weight"].abs().max())
        sd = module.state_dict()
        out["sd"] = (set(sd) == set(gpt.state_dict()),
                     torch.equal(sd["h.0.mlp_fc.weight"].full_tensor(),
                                 after["h.0.mlp_fc.weight"]))
        with pytest.raises(nncompile.ConfigError, match="call that module"):
            module(**_batch())
        return out
    out = _after_one_step(gpt, tmp_path, "views", 2, "tp", check)[0]
    assert out["placements"][-1] == Shard(0) and out["is_param"] and out["full"]
    assert out["split"] >= 8 and abs(out["norm"] - out["want_norm"]) < 1e-5, out
    assert out["clamped"] <= 0.01 and out["zeroed"] == 0.0 and out["sd"] == (True, True), out
