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


def test_data_dependent_branch_names_user_line(tmp_path):
    line = Branchy.forward.__code__.co_firstlineno + 2
    with pytest.raises(TraceError) as err:
        compile_only(Branchy(), (torch.randn(2, 4),), tmp_path)
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
