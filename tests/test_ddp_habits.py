"""What a DDP script assumes of its wrapper, on 2 simulated ranks: every rank starts from
global rank 0's weights and buffers (as DDP broadcasts them at wrap time); the ranks of one plan
unit must be fed the same batch and, when the plan draws random numbers, hold the same
generator (checked on the first calls); torch.nn.utils.clip_grad_norm_(pm.parameters()) clips
by the global norm; a merged ZeRO checkpoint resumes a plain AdamW exactly; pm.module is the
original module and pm.dp_rank / pm.dp_size say which data-parallel unit a rank feeds."""
from __future__ import annotations

import contextlib
import copy
import threading

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import models
import nncompile
from nncompile import ComputeConfig
from nncompile.runtime.program import rng
from nncompile.tools.simulate import run_ranks


class Centered(nn.Module):
    """An MLP whose input is shifted by a buffer (so buffers are part of the model)."""

    def __init__(self, p: float = 0.0):
        super().__init__()
        self.fc1, self.fc2, self.head = nn.Linear(16, 64), nn.Linear(64, 64), nn.Linear(64, 8)
        self.register_buffer("center", torch.zeros(16))
        self.p = p

    def forward(self, x, y):
        h = F.relu(self.fc1(x - self.center))
        h = F.dropout(torch.tanh(self.fc2(h)), self.p, self.training)
        return F.cross_entropy(self.head(h), y)


def _batch(seed: int, n: int = 8):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 16, generator=g), torch.randint(0, 8, (n,), generator=g)


def _perturbed(model: nn.Module, rank: int) -> nn.Module:
    """The model as a script seeding each rank differently builds it (a private generator:
    threads share the global one)."""
    m = copy.deepcopy(model)
    g = torch.Generator().manual_seed(100 + rank)
    with torch.no_grad():
        for t in list(m.parameters()) + list(m.buffers()):
            t.add_(torch.randn(t.shape, generator=g))
    return m


# ---- every rank starts from rank 0's weights ---------------------------------------------------
@pytest.mark.parametrize("policy,plan", [("dp", 1), ("tp", 2)])
def test_every_rank_starts_from_rank0_weights(tmp_path, monkeypatch, policy, plan):
    from nncompile.runtime.program import consistency
    monkeypatch.setattr(consistency, "BUCKET_BYTES", 1024)     # several buckets
    torch.manual_seed(0)
    base = Centered()
    per_rank = [_perturbed(base, r) for r in range(2)]
    want = {n: t.detach().clone() for n, t in per_rank[0].state_dict().items()}
    assert not torch.equal(want["fc1.weight"], per_rank[1].fc1.weight)

    def rank_fn(rank):
        model = per_rank[rank]
        pm = nncompile.parallelize(model, _batch(0), ComputeConfig(plan, 2), pas_policy=policy,
                                   gen_savedir=tmp_path)
        return pm.gather_params(), {n: t.clone() for n, t in model.named_buffers()}, \
            pm.center.clone(), pm.module is model
    for params, module_state, center, same in run_ranks(2, rank_fn):
        assert same                                     # pm.module: the original object
        for n, t in params.items():
            assert torch.equal(t, want[n]), n
        assert "center" in module_state
        for n, t in module_state.items():               # the module's buffers, as DDP
            assert torch.equal(t, want[n]), n           # leaves them
        assert torch.equal(center, want["center"])


def test_init_sync_off_keeps_each_ranks_weights(tmp_path):
    torch.manual_seed(0)
    base = Centered()
    per_rank = [_perturbed(base, r) for r in range(2)]

    def rank_fn(rank):
        pm = nncompile.parallelize(per_rank[rank], _batch(0), ComputeConfig(1, 2, init_sync=False),
                                   pas_policy="dp", gen_savedir=tmp_path)
        return pm.gather_params()["fc1.weight"]
    w0, w1 = run_ranks(2, rank_fn)
    assert not torch.equal(w0, w1)


# ---- the ranks of one plan unit get the same inputs ----------------------------------------------
def _unit_run(tmp_path, batches, *, check_inputs=3, p=0.0, states=None, train=True):
    """Call a tp plan-2 pm on each rank with its own list of batches; per call, the error's
    text (or None) and the all_gathers it issued (torch.distributed.all_gather counted)."""
    torch.manual_seed(0)
    model = Centered(p)
    counts: dict = {}
    real = dist.all_gather

    def counted(*args, **kwargs):
        key = threading.get_ident()
        counts[key] = counts.get(key, 0) + 1
        return real(*args, **kwargs)

    def rank_fn(rank):
        ctx = rng.rank_generator(states[rank]) if states else contextlib.nullcontext()
        pm = nncompile.parallelize(copy.deepcopy(model), _batch(0),
                                   ComputeConfig(2, 2, check_inputs=check_inputs),
                                   pas_policy="tp", gen_savedir=tmp_path)
        pm.train(train)
        out = []
        with ctx:
            for x, y in batches[rank]:
                before = counts.get(threading.get_ident(), 0)
                try:
                    pm(x, y).backward()
                    err = None
                except nncompile.InputMismatchError as e:
                    err = str(e)
                out.append((err, counts.get(threading.get_ident(), 0) - before))
                if err:
                    break
        return out
    dist.all_gather = counted
    try:
        return run_ranks(2, rank_fn)
    finally:
        dist.all_gather = real


def test_different_batches_in_one_plan_unit_are_named(tmp_path):
    x, y = _batch(1)
    x2 = x.clone()
    x2[3, 5] += 0.5                                    # rank 1 sees one value changed
    out = _unit_run(tmp_path, [[(x, y)], [(x2, y)]])
    for calls in out:
        err = calls[0][0]
        assert err is not None and "input 'x' differs across the ranks of one plan unit" in err
        assert "ranks [1] were fed another 'x' than rank 0" in err
        assert "pm.dp_rank" in err and "rank // plan_ngpus" in err and "check_inputs=0" in err
    y2 = y.clone()
    y2[0] = (y[0] + 1) % 8                              # one integer label
    out = _unit_run(tmp_path, [[(x, y)], [(x, y2)]])
    assert all("input 'y' differs" in calls[0][0] for calls in out)


def test_equal_batches_pass_and_later_calls_issue_no_collective(tmp_path):
    batches = [_batch(s) for s in range(4)]
    x3, y3 = batches[3]
    other = (x3 + 1, y3)                     # call 4 differs, after the 3 checked calls
    out = _unit_run(tmp_path, [batches, batches[:3] + [other]])
    for calls in out:
        assert [err for err, _ in calls] == [None] * 4
        counts = [c for _, c in calls]
        assert counts[0] == counts[1] == counts[2] == counts[3] + 1, counts
    off = _unit_run(tmp_path, [batches[:1], batches[:1]], check_inputs=0)
    assert off[0][0][1] == out[0][3][1]      # what a plan without the check issues


def test_dropout_needs_one_generator_per_plan_unit(tmp_path):
    x, y = _batch(1)
    g0, g1 = torch.Generator().manual_seed(1337), torch.Generator().manual_seed(1338)
    differ = [g0.get_state(), g1.get_state()]
    out = _unit_run(tmp_path, [[(x, y)], [(x, y)]], p=0.3, states=differ)
    for calls in out:
        err = calls[0][0]
        assert err is not None and "the random generator of ranks [1] differs" in err, err
        assert "seed + pm.dp_rank" in err
    same = [g0.get_state(), g0.get_state()]
    assert all(calls[0][0] is None for calls in
               _unit_run(tmp_path, [[(x, y)], [(x, y)]], p=0.3, states=same))
    # in eval mode nothing is drawn: nothing to compare
    assert all(calls[0][0] is None for calls in
               _unit_run(tmp_path, [[(x, y)], [(x, y)]], p=0.3, states=differ, train=False))


def test_dp_rank_and_dp_size(tmp_path):
    def rank_fn(rank):
        pm = nncompile.parallelize(models.build("mlp"), models.batch("mlp", 0),
                                   ComputeConfig(2, 4), pas_policy="tp", gen_savedir=tmp_path)
        return pm.dp_rank, pm.dp_size
    assert run_ranks(4, rank_fn) == [(0, 2), (0, 2), (1, 2), (1, 2)]


# ---- torch's own clip_grad_norm_ over pm.parameters() ------------------------------------------
@pytest.mark.parametrize("policy,plan,zero", [("tp", 2, 0), ("dp", 1, 3), ("dp", 1, 2)])
def test_torch_clip_grad_norm_takes_the_global_norm(tmp_path, policy, plan, zero):
    model = models.build("gpt")
    dp = 2 // plan
    ref = copy.deepcopy(model)
    for u in range(dp):
        (ref(**models.batch("gpt", u)) / dp).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
    assert float(ref_norm) > 0.1                        # it clips

    def rank_fn(rank):
        pm = nncompile.parallelize(copy.deepcopy(model), models.batch("gpt", 0),
                                   ComputeConfig(plan, 2, use_zero=zero), pas_policy=policy,
                                   gen_savedir=tmp_path)
        if zero == 2:                                   # its optimizer keeps the gradients
            nncompile.build_optimizer(pm, torch.optim.AdamW, lr=1e-3)
        pm(**models.batch("gpt", rank // plan)).backward()
        try:
            torch.nn.utils.clip_grad_norm_(list(pm.parameters())[1:], 0.1)
            subset = None
        except nncompile.ConfigError as e:
            subset = str(e)
        kept = {n: p.grad.clone() for n, p in pm.named_parameters() if p.grad is not None}
        out = [(torch.nn.utils.clip_grad_norm_(pm.parameters(), 0.1), pm.gather_grads())]
        if zero == 0:                                   # the two-call form: norm, then clip
            for n, p in pm.named_parameters():
                p.grad.copy_(kept[n])
            total = torch.nn.utils.get_total_norm([p.grad for p in pm.parameters()])
            torch.nn.utils.clip_grads_with_norm_(pm.parameters(), 0.1, total)
            out.append((total, pm.gather_grads()))
        return out, subset
    for out, subset in run_ranks(2, rank_fn):
        assert len(out) == (2 if zero == 0 else 1)
        for norm, grads in out:
            torch.testing.assert_close(norm, ref_norm, rtol=1e-5, atol=1e-7)
            for n, p in ref.named_parameters():
                torch.testing.assert_close(grads[n], p.grad, rtol=1e-5, atol=1e-7)
        assert subset is not None and "pass pm.parameters()" in subset, subset


# ---- a merged ZeRO checkpoint resumes a plain optimizer -----------------------------------------
def _gpt_step(model, opt, batches) -> float:
    loss = sum(model(**b) for b in batches) / len(batches)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


@pytest.mark.parametrize("zero", [1, 3])
def test_merged_zero_checkpoint_resumes_a_plain_adamw(tmp_path, zero):
    """tp 2 x dp 2 with ZeRO: 2 steps, merge the 4 ranks' state dicts, torch.save/load, resume
    a plain AdamW on one device for 2 steps: the losses of an uninterrupted run."""
    import io
    model = models.build("gpt")
    units = [[models.batch("gpt", 10 * s + u) for u in range(2)] for s in range(4)]
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    want = [_gpt_step(ref, ref_opt, units[s]) for s in range(4)]

    def rank_fn(rank):
        pm = nncompile.parallelize(copy.deepcopy(model), models.batch("gpt", 0),
                                   ComputeConfig(2, 4, use_zero=zero), pas_policy="tp",
                                   gen_savedir=tmp_path)
        opt = nncompile.build_optimizer(pm, torch.optim.AdamW, lr=1e-2)
        losses = []
        for s in range(2):
            loss = pm(**units[s][rank // 2])
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        return pm.local_state_dict(), opt.state_dict(), losses
    out = run_ranks(4, rank_fn)
    model_sd, opt_sd = nncompile.merge_state_dicts([o[0] for o in out], [o[1] for o in out])
    buf = io.BytesIO()
    torch.save({"model": model_sd, "optimizer": opt_sd}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=False)
    ptrs = [t.untyped_storage().data_ptr() for st in saved["optimizer"]["state"].values()
            for t in st.values() if torch.is_tensor(t)]
    assert len(ptrs) == len(set(ptrs)), "optimizer state tensors share storage"
    resumed = models.build("gpt")
    resumed.load_state_dict(saved["model"])
    opt = torch.optim.AdamW(resumed.parameters(), lr=1e-2)
    opt.load_state_dict(saved["optimizer"])
    got = [_gpt_step(resumed, opt, units[s]) for s in (2, 3)]
    assert got == pytest.approx(want[2:], rel=1e-5, abs=1e-6), (got, want)


def test_runtime_options_are_checked_and_keep_the_plan():
    base = ComputeConfig(2, 4)
    assert base.init_sync is True and base.check_inputs == 3
    assert ComputeConfig(2, 4, init_sync=False, check_inputs=0).plan_json() == base.plan_json()
    with pytest.raises(nncompile.ConfigError, match=r"check_inputs=-1; .* an int >= 0"):
        ComputeConfig(2, check_inputs=-1)
    with pytest.raises(nncompile.ConfigError, match=r"init_sync='no'; init_sync must be a bool"):
        ComputeConfig(2, init_sync="no")


def test_no_sync_takes_effect_at_backward(tmp_path):
    """As documented (docs/concepts.md, "Gradient accumulation"): a forward inside no_sync()
    whose backward runs outside reduces at that backward, and accumulating on top still gives
    DDP's gradients; a backward inside the block does not reduce."""
    model = models.build("mlp")
    ref = copy.deepcopy(model)                  # DDP: the mean over ranks of the summed steps
    for r in range(2):
        for m in range(2):
            (ref(**models.batch("mlp", 10 * m + r)) / 2).backward()

    def rank_fn(rank):
        pm = nncompile.parallelize(copy.deepcopy(model), models.batch("mlp", 0),
                                   ComputeConfig(1, 2), pas_policy="dp", gen_savedir=tmp_path)
        with pm.no_sync():
            loss = pm(**models.batch("mlp", rank))
        loss.backward()                         # outside the block: reduced here
        first = pm.fc1_weight.grad.clone()
        pm(**models.batch("mlp", 10 + rank)).backward()
        accumulated = pm.gather_grads()
        pm.zero_grad()
        loss = pm(**models.batch("mlp", rank))
        with pm.no_sync():
            loss.backward()                     # inside the block: this rank's own
        return first, accumulated, pm.fc1_weight.grad.clone()
    out = run_ranks(2, rank_fn)
    assert torch.equal(out[0][0], out[1][0])
    assert not torch.equal(out[0][2], out[1][2])
    for _, grads, _ in out:
        for n, p in ref.named_parameters():
            torch.testing.assert_close(grads[n], p.grad, rtol=1e-5, atol=1e-6)
