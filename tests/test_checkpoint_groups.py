"""Parameter groups through checkpoints: a merged checkpoint holds every group with its own
hyper-parameters and numbers parameters as a torch optimizer built over those groups on one
device does (group by group), so a plain AdamW loads it and goes on exactly; a resume under
nncompile (sharded, deduped, dcp or merged) restores every group's hyper-parameters and the LR
scheduler. Two simulated ranks against the same loop on one device."""
from __future__ import annotations

import copy

import pytest
import torch

import nncompile
from nncompile import ComputeConfig
from nncompile.errors import CheckpointError
from nncompile.tools.simulate import run_ranks
from test_optimizer_contract import _batches, nanogpt_groups

WORLD = 2
SAVE_AT, STEPS = 3, 5
LRS = (1e-2, 3e-3)
FORMATS = ("sharded", "deduped", "dcp")


def _sched(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))


def _step(model, opt, sched, batch):
    loss = model(**batch)
    loss.backward()
    opt.step()
    opt.zero_grad()
    sched.step()
    return loss.item()


@pytest.fixture(scope="module")
def reference(gpt):
    """One device, uninterrupted: losses, and the optimizer and scheduler at SAVE_AT."""
    model = copy.deepcopy(gpt)
    opt = torch.optim.AdamW(nanogpt_groups(model.named_parameters(), LRS))
    sched = _sched(opt)
    losses, saved = [], None
    for i, b in enumerate(_batches(STEPS)):
        if i == SAVE_AT:
            saved = copy.deepcopy((opt.state_dict(), sched.state_dict()))
        losses.append(_step(model, opt, sched, b))
    return losses, saved


# name: (plan_ngpus, pas_policy, use_zero)
PLANS = {"dp": (1, "dp", 0), "zero1": (1, "dp", 1), "zero3": (1, "dp", 3), "tp": (2, "tp", 0)}


def _rank_batch(b, rank, plan=1):
    """Rank `rank`'s data-parallel unit's rows of the global batch."""
    rows, unit = b["idx"].shape[0] // (WORLD // plan), rank // plan
    return {k: v[unit * rows:(unit + 1) * rows] for k, v in b.items()}


def _parallelize(gpt, key, rank, gen):
    plan, policy, zero = PLANS[key]
    pm = nncompile.parallelize(copy.deepcopy(gpt), _rank_batch(_batches(1)[0], rank, plan),
                               ComputeConfig(plan, WORLD, use_zero=zero), pas_policy=policy,
                               gen_savedir=gen, instance_name=f"cg_{key}")
    opt = nncompile.build_optimizer(pm, torch.optim.AdamW,
                                    params=nanogpt_groups(pm.named_parameters(), LRS))
    return pm, opt, _sched(opt), lambda b: _rank_batch(b, rank, plan)


@pytest.fixture(scope="module")
def saved(gpt, tmp_path_factory):
    """{plan: directory holding every format and a merged file of each}, saved at SAVE_AT."""
    gen, root = tmp_path_factory.mktemp("gen"), tmp_path_factory.mktemp("ck")
    out = {}
    for key in PLANS:
        def rank_fn(rank, key=key):
            pm, opt, sched, mine = _parallelize(gpt, key, rank, gen)
            for b in _batches(SAVE_AT):
                _step(pm, opt, sched, mine(b))
            for fmt in FORMATS:
                nncompile.save_checkpoint(root / key / fmt, pm, opt, format=fmt,
                                          extra={"sched": sched.state_dict()})
        run_ranks(WORLD, rank_fn)
        for fmt in FORMATS:
            nncompile.merge_checkpoint([root / key / fmt], root / key / f"{fmt}.pt")
        out[key] = (root / key, gen)
    return out


@pytest.mark.parametrize("key", PLANS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_merged_groups_load_into_plain_adamw(gpt, reference, saved, key, fmt):
    losses, (ref_opt, ref_sched) = reference
    merged = nncompile.runtime.checkpoints.checkpoint.load_torch(saved[key][0] / f"{fmt}.pt")
    opt_sd = merged["optimizer"]
    # each group's hyper-parameters and members, numbered as torch numbers them
    assert len(opt_sd["param_groups"]) == 2
    for got, want in zip(opt_sd["param_groups"], ref_opt["param_groups"]):
        assert got["params"] == want["params"]
        for key in ("weight_decay", "lr", "initial_lr", "betas", "eps"):
            assert got[key] == pytest.approx(want[key]), key
    assert sorted(opt_sd["state"]) == sorted(ref_opt["state"])
    for i, st in ref_opt["state"].items():
        for key, v in st.items():
            torch.testing.assert_close(opt_sd["state"][i][key], v, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"state {i} {key}: {m}")
    assert merged["extra"]["sched"]["last_epoch"] == ref_sched["last_epoch"]
    # a plain AdamW on one device built with the same groups loads it and goes on exactly
    model = copy.deepcopy(gpt)
    model.load_state_dict(merged["model"])
    opt = torch.optim.AdamW(nanogpt_groups(model.named_parameters(), LRS))
    sched = _sched(opt)
    opt.load_state_dict(opt_sd)
    sched.load_state_dict(merged["extra"]["sched"])
    after = [_step(model, opt, sched, b) for b in _batches(STEPS)[SAVE_AT:]]
    torch.testing.assert_close(torch.tensor(after), torch.tensor(losses[SAVE_AT:]),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("key", PLANS)
def test_resume_restores_groups_and_scheduler(gpt, reference, saved, key):
    losses, (ref_opt, _) = reference
    root, gen = saved[key]
    sources = [root / f for f in FORMATS] + [root / f"{f}.pt" for f in FORMATS]

    def rank_fn(rank):
        out = {}
        for src in sources:
            pm, opt, sched, mine = _parallelize(gpt, key, rank, gen)
            extra = nncompile.load_checkpoint(src, pm, opt)
            sched.load_state_dict(extra["sched"])
            lrs = [(g["lr"], g["initial_lr"], g["weight_decay"]) for g in opt.param_groups]
            after = [_step(pm, opt, sched, mine(b)) for b in _batches(STEPS)[SAVE_AT:]]
            out[src.name] = (lrs, after)
        return out
    outs = run_ranks(WORLD, rank_fn)
    want_lrs = [(g["lr"], g["initial_lr"], g["weight_decay"]) for g in ref_opt["param_groups"]]
    for src in sources:
        lrs, _ = outs[0][src.name]
        flat = [x for group in lrs for x in group]         # pytest >= 9.2: approx is flat
        assert flat == pytest.approx([x for group in want_lrs for x in group]), src.name
        after = torch.tensor([outs[r][src.name][1] for r in range(WORLD)]).mean(0)
        torch.testing.assert_close(after, torch.tensor(losses[SAVE_AT:]), rtol=1e-5, atol=1e-5,
                                   msg=lambda m: f"{src.name}: {m}")


def test_groups_without_members_are_refused(gpt, reference, saved):
    """A plain optimizer's state dict of several groups numbers parameters group by group and
    does not say which: merging it by hand is refused (not merged into the first group's
    hyper-parameters with the state of other parameters); with the members save_checkpoint
    records (state.with_members) it merges as a checkpoint does."""
    from nncompile.runtime.checkpoints.state import with_members
    _, gen = saved["dp"]

    def rank_fn(rank):
        pm, opt, sched, mine = _parallelize(gpt, "dp", rank, gen)
        for b in _batches(SAVE_AT):
            _step(pm, opt, sched, mine(b))
        return pm.local_state_dict(), opt.state_dict(), with_members(pm, opt, opt.state_dict())
    outs = run_ranks(WORLD, rank_fn)
    models_sd = [o[0] for o in outs]
    with pytest.raises(CheckpointError, match="2 parameter groups but does not record"):
        nncompile.merge_state_dicts(models_sd, [o[1] for o in outs])
    _, opt_sd = nncompile.merge_state_dicts(models_sd, [o[2] for o in outs])
    ref_opt = reference[1][0]
    assert [g["params"] for g in opt_sd["param_groups"]] == \
        [g["params"] for g in ref_opt["param_groups"]]
    for i, st in ref_opt["state"].items():
        torch.testing.assert_close(opt_sd["state"][i]["exp_avg"], st["exp_avg"], rtol=1e-5,
                                   atol=1e-6)
