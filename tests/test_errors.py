"""Bad input gets a clear NNCompileError saying what was wrong and what to do."""
import os

import pytest
import torch

import models
import nncompile
from nncompile import (ComputeConfig, ConfigError, InputMismatchError, PolicyError,
                       ReuseError, TraceError)


def compile_only(model, example, tmp_path, **kw):
    kw.setdefault("pas_policy", "tp")
    cfg = kw.pop("config", ComputeConfig(plan_ngpus=2, runtime_ngpus=2))
    return nncompile.parallelize(model, example, cfg, gen_savedir=tmp_path, load_module=False,
                                 **kw)


def test_runtime_not_multiple_of_plan():
    with pytest.raises(ConfigError, match=r"runtime_ngpus=3 is not a multiple of plan_ngpus=2"):
        ComputeConfig(plan_ngpus=2, runtime_ngpus=3)


def test_plan_ngpus_that_does_not_divide_the_job(tmp_path, monkeypatch):
    """plan_ngpus=3 under `torchrun --nproc_per_node=2` (before any process group): the fix
    is a plan_ngpus that divides 2, said in one line from the user's call, the rank named."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(ConfigError) as e:
        nncompile.parallelize(models.build("mlp"), models.batch("mlp", 0), ComputeConfig(3),
                              pas_policy="tp", gen_savedir=tmp_path)
    assert str(e.value) == ("plan_ngpus=3 does not divide this job's 2 ranks (each data-parallel "
                            "unit is plan_ngpus ranks): use plan_ngpus in [1, 2], or launch a "
                            "multiple of 3 ranks (torchrun --nproc_per_node=3) [rank 1]")
    assert e.traceback[-1].name == "_check_plan_fits_job" and len(e.traceback) == 3


def test_world_size_differs_from_runtime_ngpus(tmp_path):
    with pytest.raises(ConfigError, match=r"runtime_ngpus=2 but the world size is 1.*"
                                          r"--nproc_per_node=2"):
        nncompile.parallelize(models.build("mlp"), models.batch("mlp", 0),
                              ComputeConfig(plan_ngpus=2, runtime_ngpus=2), pas_policy="tp",
                              gen_savedir=tmp_path)


def test_dummy_args_key_not_in_signature(tmp_path):
    with pytest.raises(ConfigError, match=r"\['inputs'\].*forward's arguments are \['x', 'y'\]"):
        compile_only(models.build("mlp"), {"inputs": torch.randn(4, 16)}, tmp_path)


class Branchy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        if y.sum() > 0:   # branches on a tensor's value
            return y.sum()
        return -y.sum()


def test_data_dependent_branch_names_user_line(tmp_path, capfd):
    line = Branchy.forward.__code__.co_firstlineno + 2
    with pytest.raises(TraceError) as err:
        compile_only(Branchy(), (torch.randn(2, 4),), tmp_path)
    # torch.export's dump of the partial FX graph is not printed before the error
    assert "def forward(self" not in capfd.readouterr().err
    msg = str(err.value)
    assert "branches on a tensor's value" in msg
    assert f"test_errors.py:{line}" in msg and "if y.sum() > 0" in msg
    assert "torch.where" in msg


def test_unknown_policy(tmp_path):
    with pytest.raises(PolicyError, match=r"unknown policy 'zigzag'; choose one of \['autodist', "
                                          r"'data', 'dp', 'tp', 'tp_sp'\]"):
        compile_only(models.build("mlp"), models.batch("mlp", 0), tmp_path, pas_policy="zigzag")


def test_later_policy_is_not_available_yet(tmp_path):
    with pytest.raises(PolicyError, match="'pp'.*not available yet"):
        compile_only(models.build("mlp"), models.batch("mlp", 0), tmp_path, pas_policy="pp")


def test_dp_needs_plan_of_one(tmp_path):
    with pytest.raises(PolicyError, match="needs plan_ngpus=1"):
        compile_only(models.build("mlp"), models.batch("mlp", 0), tmp_path, pas_policy="dp")


def test_reuse_match_after_model_changed(tmp_path):
    compile_only(models.MLP(), models.batch("mlp", 0), tmp_path)
    with pytest.raises(ReuseError) as err:
        compile_only(models.MLP(d_hidden=32), models.batch("mlp", 0), tmp_path)
    msg = str(err.value)
    assert "traced graph changed" in msg and "f32[64, 16]" in msg and "f32[32, 16]" in msg
    assert "reuse='override'" in msg


def test_reuse_match_after_config_changed(tmp_path):
    compile_only(models.MLP(), models.batch("mlp", 0), tmp_path)
    with pytest.raises(ReuseError, match=r"plan_ngpus: 2 -> 4"):
        compile_only(models.MLP(), models.batch("mlp", 0), tmp_path,
                     config=ComputeConfig(plan_ngpus=4, runtime_ngpus=4))


def test_unwritable_gen_savedir(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    with pytest.raises(ConfigError, match=r"gen_savedir .*a_file/out.* is not writable"):
        compile_only(models.build("mlp"), models.batch("mlp", 0), blocker / "out")


def test_call_with_other_shapes(tmp_path):
    pm = nncompile.parallelize(models.build("mlp"), models.batch("mlp", 0),
                               ComputeConfig(plan_ngpus=1), pas_policy="dp",
                               gen_savedir=tmp_path)
    pm(**models.batch("mlp", 1))
    with pytest.raises(InputMismatchError, match=r"input 'x' is torch.float32\[8, 16\] but the "
                                                 r"module was traced with torch.float32\[4, 16\]"):
        pm(**models.batch("mlp", 0, batch_size=8))


def test_bad_reuse_mode(tmp_path):
    with pytest.raises(ConfigError, match="reuse='sometimes'"):
        compile_only(models.build("mlp"), models.batch("mlp", 0), tmp_path, reuse="sometimes")


def test_failed_compile_leaves_nothing_half_written(tmp_path):
    with pytest.raises(TraceError):
        compile_only(Branchy(), (torch.randn(2, 4),), tmp_path, instance_name="b")
    assert not os.path.exists(tmp_path / "b")
    assert [p.name for p in tmp_path.iterdir()] == []


class ClassicMoE(torch.nn.Module):
    """The routing loop people write first: torch.where per expert, then index_add_."""

    def __init__(self, d=16, experts=4, k=2):
        super().__init__()
        self.gate = torch.nn.Linear(d, experts, bias=False)
        self.experts = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(d, 32), torch.nn.ReLU(), torch.nn.Linear(32, d))
            for _ in range(experts))
        self.k = k

    def forward(self, x):
        b, t, d = x.shape
        x = x.view(-1, d)
        w, idx = self.gate(x).softmax(-1).topk(self.k, -1)
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            tok, slot = torch.where(idx == i)
            out.index_add_(0, tok, expert(x[tok]) * w[tok, slot, None])
        return out.view(b, t, d).pow(2).mean()


def test_a_data_dependent_moe_loop_is_a_trace_error_on_every_rank(tmp_path):
    """Under ep 2 on two ranks: rank 0 raises a TraceError naming torch.where and the source
    line, rank 1 an error naming rank 0's (no rank waits)."""
    from nncompile.errors import NNCompileError
    from nncompile.tools.simulate import run_ranks
    x = torch.randn(2, 8, 16)
    models_ = [ClassicMoE() for _ in range(2)]

    def rank_fn(rank):
        try:
            nncompile.parallelize(models_[rank], {"x": x},
                                  nncompile.ComputeConfig(2, 2, parallel={"ep": 2}),
                                  pas_policy="tp", gen_savedir=str(tmp_path))
        except NNCompileError as e:
            return type(e).__name__, str(e)
        return None, ""

    got = run_ranks(2, rank_fn, timeout_s=300)
    (kind0, text0), (kind1, text1) = got
    assert kind0 == "TraceError" and "size depends on the data" in text0
    assert "aten.where" in text0 and "torch.where(idx == i)" in text0
    assert kind1 == "NNCompileError" and "compilation failed on rank 0" in text1
    assert "TraceError" in text1 and "rank 1" in text1


def test_any_error_of_rank_0s_compile_reaches_the_other_ranks(tmp_path, monkeypatch):
    """An error that is not nncompile's (here codegen failing with a RuntimeError, as a bug
    would): rank 0 raises it, rank 1 an NNCompileError naming it instead of waiting in the
    broadcast of rank 0's result."""
    from nncompile import codegen
    from nncompile.errors import NNCompileError
    from nncompile.tools.simulate import run_ranks

    def broken(*args, **kwargs):
        raise RuntimeError("a bug in code generation")
    monkeypatch.setattr(codegen, "render_all", broken)
    mods = [torch.nn.Linear(4, 4) for _ in range(2)]

    def rank_fn(rank):
        try:
            nncompile.parallelize(mods[rank], {"input": torch.randn(2, 4)},
                                  nncompile.ComputeConfig(1, 2), pas_policy="dp",
                                  gen_savedir=str(tmp_path))
        except NNCompileError as e:
            return "nncompile", f"{type(e).__name__}: {e}"
        except RuntimeError as e:
            return "raw", f"{type(e).__name__}: {e}"
        return None, ""

    (k0, t0), (k1, t1) = run_ranks(2, rank_fn, timeout_s=300)
    assert k0 == "raw" and "a bug in code generation" in t0, t0
    assert k1 == "nncompile" and "compilation failed on rank 0 (this is rank 1" in t1, t1
    assert "RuntimeError: a bug in code generation" in t1
