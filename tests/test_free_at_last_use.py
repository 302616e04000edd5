"""Generated code frees each intermediate at its last use (nncompile/codegen/lifetimes.py): `del` lines
that never delete a value read later (in the same function, by a checkpointed closure or by the
return), a forward whose peak memory is the plain model's although its non-saved
intermediates are large, and unchanged parity."""
from __future__ import annotations

import ast
import copy
import os
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import models
import nncompile
from nncompile import ComputeConfig
from nncompile.tools.simulate import run_ranks

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from gpt import GPT  # noqa: E402

KEPT = {"DEVICE", "PLAN_GROUP", "ZERO"}         # non-tensor locals of the generated forward


def _names(node, ctx) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ctx)}


def check_function(fn: ast.FunctionDef) -> int:
    """Walk a generated function's straight-line body: every `del` deletes a name assigned
    before and not yet deleted, never an argument; no name is read after its `del`; a
    closure's free names are never deleted; at the return only non-tensor names, the
    returned ones and the arguments are left undeleted. Returns the number of `del`s."""
    args = {a.arg for a in fn.args.args}
    defined, deleted, free, gathered, dels = set(), set(), set(), set(), 0
    for stmt in fn.body:
        if isinstance(stmt, ast.FunctionDef):           # a checkpointed closure
            dels += check_function(stmt)
            inner_args = {a.arg for a in stmt.args.args}
            free |= _names(stmt, ast.Load) - _names(stmt, ast.Store) - inner_args
            continue
        if isinstance(stmt, ast.Delete):
            dels += 1
            for t in stmt.targets:
                assert isinstance(t, ast.Name), ast.unparse(stmt)
                assert t.id not in args, f"{fn.name}: argument {t.id} deleted"
                assert t.id in defined, f"{fn.name}: {t.id} deleted before it is assigned"
                assert t.id not in deleted, f"{fn.name}: {t.id} deleted twice"
                deleted.add(t.id)
            continue
        read = _names(stmt, ast.Load) & deleted
        assert not read, f"{fn.name}: {sorted(read)} read after del: {ast.unparse(stmt)[:200]}"
        if isinstance(stmt, ast.Return):        # (a unit gathered inside a closure dies with it)
            left = defined - deleted - _names(stmt, ast.Load) - KEPT - gathered
            left = {n for n in left if not n.startswith("s_")}      # dynamic sizes
            assert not left, f"{fn.name}: never deleted: {sorted(left)}"
        defined |= _names(stmt, ast.Store)
        if "comm.zero_gather(" in ast.unparse(stmt):
            gathered |= _names(stmt, ast.Store)
        stale = defined & deleted & _names(stmt, ast.Store)
        deleted -= stale                                # reassigned (a relay's clone)
    assert not free & deleted, f"{fn.name}: closure reads deleted {sorted(free & deleted)}"
    return dels


def check_code(code: str) -> dict[str, int]:
    """`del` count per generated forward, stage and compute_constants function of a file
    (each checked)."""
    tree = ast.parse(code)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "GenModel")
    out = {}
    for fn in cls.body:
        if isinstance(fn, ast.FunctionDef) and (fn.name.startswith("stage_") or fn.name in (
                "forward_impl", "forward_eval_impl", "compute_constants")):
            out[fn.name] = check_function(fn)
    return out


def _gen(tmp_path, name, model, batch, plan, policy="dp", files=(0,), **cfg):
    nncompile.parallelize(model, batch, ComputeConfig(plan, plan, **cfg), pas_policy=policy,
                          gen_savedir=tmp_path, load_module=False, instance_name=name)
    return [(tmp_path / name / f"gencode{r}.py").read_text() for r in files]


PIPE_BATCH = {"idx": torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(0)),
              "targets": torch.randint(0, 64, (8, 16),
                                       generator=torch.Generator().manual_seed(1))}
RECOMPUTE = {"parallel": {"recompute_modules": ["Block"]}}
PLANS = {   # name: (model, batch, plan_ngpus, policy, ranks' files, config)
    "dp_llama": ("hf_llama", None, 1, "dp", (0,), {}),
    "dp_branchy": ("branchy", None, 1, "dp", (0,), {}),            # + forward_eval_impl
    "zero3_branchy": ("branchy", None, 1, "dp", (0,), {"use_zero": 3}),
    "tp2_gpt": ("gpt", None, 2, "tp", (0, 1), {}),
    "zero3_gpt": ("gpt", None, 1, "dp", (0,), {"use_zero": 3}),
    "zero3_recompute_gpt": ("gpt", None, 1, "dp", (0,), {"use_zero": 3, **RECOMPUTE}),
    "tp2_recompute_gpt": ("gpt", None, 2, "tp", (0,), RECOMPUTE),
    "pipeline_tp_gpt": ("gpt4", PIPE_BATCH, 2, "tp", (0, 1),
                        {"parallel": {"pp": 2, "microbatches": 2}}),
    "pipeline_zero3_recompute": ("gpt4", PIPE_BATCH, 2, "dp", (0, 1),
                                 {"use_zero": 3, "parallel": {
                                     "pp": 2, "microbatches": 2,
                                     "recompute_modules": ["Block"]}}),
}


class Branchy(nn.Module):
    """A forward that differs in eval mode (its file has forward_eval_impl too)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.head = nn.Linear(16, 64), nn.Linear(64, 64), nn.Linear(64, 8)

    def forward(self, x, y):
        h = torch.tanh(self.fc1(x))
        h = h * 2 if self.training else h.relu()
        return F.cross_entropy(self.head(torch.tanh(self.fc2(h)) + h), y)


def _model(name):
    torch.manual_seed(0)
    if name == "gpt4":
        return GPT(n_layer=4)
    if name == "branchy":
        return Branchy()
    return models.build(name)


@pytest.mark.parametrize("plan", sorted(PLANS))
def test_dels_never_delete_a_value_read_later(plan, tmp_path):
    model, batch, n, policy, files, cfg = PLANS[plan]
    batch = batch or models.batch("mlp" if model == "branchy" else model, 0)
    for code in _gen(tmp_path, plan, _model(model), batch, n, policy, files, **copy.deepcopy(cfg)):
        counts = check_code(code)
        assert counts and all(c >= 3 for k, c in counts.items() if k != "compute_constants")
        if model == "hf_llama":                         # rotary tables: load-time intermediates
            assert counts["compute_constants"] >= 3, counts
        if "branchy" in plan:
            assert "forward_eval_impl" in counts, counts
        if "recompute" in plan:
            assert "def recompute_" in code
            inner = code.split("def recompute_")[1].split("checkpoint(")[0]
            assert "\n            del " in inner          # the closure's own intermediates
        if "pipeline" in plan:
            assert any(k.startswith("stage_") for k in counts), counts


class Block(nn.Module):
    """A block whose wide intermediate autograd does not save (repeat and sum keep only
    sizes): the plain model frees it when forward returns."""

    def __init__(self, d, wide):
        super().__init__()
        self.fc, self.wide = nn.Linear(d, d), wide

    def forward(self, x):
        big = x.repeat(1, 1, self.wide)
        return self.fc(x) + big.sum(-1, keepdim=True)


class Fat(nn.Module):
    def __init__(self, d=32, wide=64, n=6):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d, wide) for _ in range(n))

    def forward(self, x, y):
        for b in self.blocks:
            x = b(x)
        return F.mse_loss(x, y)


def forward_peak(fn) -> int:
    """Peak bytes allocated (above the start) while fn runs, from torch.profiler's trace of
    every allocation and free."""
    from torch._C._profiler import _EventType
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                profile_memory=True) as prof:
        fn()
    allocs, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        stack.extend(e.children)
        if e.typed[0] == _EventType.Allocation:
            allocs.append((e.start_time_ns, e.typed[1].alloc_size))
    cur = peak = 0
    for _, size in sorted(allocs):
        cur += size
        peak = max(peak, cur)
    return peak


def test_forward_peak_is_the_plain_models(tmp_path):
    """Six blocks each make a 0.5 MiB intermediate that autograd does not keep: kept until
    forward returns, the generated forward would peak 5 of them above the plain model."""
    torch.manual_seed(0)
    model = Fat()
    x, y = torch.randn(4, 16, 32), torch.randn(4, 16, 32)
    big = x.numel() * 64 * 4
    pm = nncompile.parallelize(copy.deepcopy(model), (x, y), ComputeConfig(1, 1),
                               pas_policy="dp", gen_savedir=tmp_path, instance_name="fat")
    for _ in range(2):                                  # warm up (first-call allocations)
        pm(x, y).backward()
        model(x, y).backward()
    plain, gen = forward_peak(lambda: model(x, y)), forward_peak(lambda: pm(x, y))
    assert plain >= big, (plain, big)
    assert gen <= plain + big // 2, f"generated forward peaks {gen} B, plain {plain} B " \
                                    f"(one intermediate: {big} B)"
    assert check_code((tmp_path / "fat" / "gencode0.py").read_text())["forward_impl"] >= 6


@pytest.mark.parametrize("name,cfg", [("hf_llama", {}), ("gpt", RECOMPUTE)])
def test_one_device_parity(name, cfg, tmp_path):
    ref = models.build(name)
    pm = nncompile.parallelize(copy.deepcopy(ref), models.batch(name, 0),
                               ComputeConfig(1, 1, **cfg), pas_policy="dp",
                               gen_savedir=tmp_path, instance_name=name)
    for step in range(2):
        batch = models.batch(name, step)
        want, got = ref(**batch), pm(**batch)
        want.backward()
        got.backward()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        grads = pm.gather_grads()
        for n, p in ref.named_parameters():
            torch.testing.assert_close(grads[n], p.grad, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, n=n: f"{n}: {m}")
        ref.zero_grad()
        pm.zero_grad()


def test_tp2_recompute_parity(tmp_path):
    """Two threaded ranks, tp with recomputed blocks: loss and gradients equal one device's."""
    base = models.build("gpt")
    ref = copy.deepcopy(base)
    batch = models.batch("gpt", 0)
    want = ref(**batch)
    want.backward()

    def rank_fn(rank):
        pm = nncompile.parallelize(copy.deepcopy(base), batch,
                                   ComputeConfig(2, 2, **copy.deepcopy(RECOMPUTE)),
                                   pas_policy="tp", gen_savedir=tmp_path)
        loss = pm(**batch)
        loss.backward()
        return loss.detach(), pm.gather_grads()
    for loss, grads in run_ranks(2, rank_fn):
        torch.testing.assert_close(loss, want.detach(), rtol=1e-5, atol=1e-6)
        for n, p in ref.named_parameters():
            torch.testing.assert_close(grads[n], p.grad, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, n=n: f"{n}: {m}")
