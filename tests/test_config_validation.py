"""ComputeConfig checks every field's type and range, the old pas_config keys are checked under
every policy (with a close-match suggestion; ParallelSpec: tests/test_parallel_spec.py),
instance_name is a plain name, and a corrupted
manifest.json is handled by the reuse mode."""
import json

import pytest

import models
import nncompile
from nncompile import ComputeConfig


def _compile(tmp_path, config=None, **kw):
    kw.setdefault("pas_policy", "dp")
    return nncompile.parallelize(models.build("mlp"), models.batch("mlp", 0),
                                 config or ComputeConfig(1), gen_savedir=tmp_path,
                                 load_module=False, **kw)


@pytest.mark.parametrize("field", ["inference_only", "constant_folding", "offload_params",
                                   "use_async_reducer", "reduce_in_fp32", "check", "compile"])
def test_bool_fields_must_be_bools(field):
    with pytest.raises(nncompile.ConfigError) as e:
        ComputeConfig(1, **{field: "no"})
    msg = str(e.value)
    assert f"{field}='no'" in msg and "must be a bool" in msg and "(True, False)" in msg


def test_use_zero_is_a_stage():
    for value, stage in ((True, 1), (False, 0), (0, 0), (1, 1), (2, 2), (3, 3),
                         ("auto", "auto")):
        assert ComputeConfig(1, use_zero=value).zero_stage == stage
    for bad in (4, -1, 1.0, "3", "yes", None):
        with pytest.raises(nncompile.ConfigError, match=r"use_zero=.*one of 0, 1, 2, 3"):
            ComputeConfig(1, use_zero=bad)


def test_offload_fields():
    with pytest.raises(nncompile.ConfigError, match="offload_params=True .* use_zero=3"):
        ComputeConfig(1, use_zero=2, offload_params=True)
    with pytest.raises(nncompile.ConfigError, match="offload_optimizer='yes'"):
        ComputeConfig(1, offload_optimizer="yes")
    with pytest.raises(nncompile.ConfigError, match="inference_only"):
        ComputeConfig(1, inference_only=True, use_zero=3)
    assert ComputeConfig(1, use_zero=3, offload_params=True).offload_params


def test_zero3_shapes_the_code_other_stages_do_not():
    """ZeRO-3 and 'auto' enter the plan fingerprint; stages 0-2 and offload_optimizer are
    runtime choices (changing them reuses the generated code)."""
    base = ComputeConfig(1, 2).plan_json()
    for runtime_only in (dict(use_zero=1), dict(use_zero=2), dict(offload_optimizer=True)):
        assert ComputeConfig(1, 2, **runtime_only).plan_json() == base
    assert ComputeConfig(1, 2, use_zero=3).plan_json()["memory"]["use_zero"] == 3
    assert ComputeConfig(1, 2, use_zero=3).diff(ComputeConfig(1, 2).to_json()) == \
        ["memory: None -> {'use_zero': 3, 'zero_ngroups': 1, 'offload_optimizer': False, "
         "'offload_params': False}"]


@pytest.mark.parametrize("field", ["pas_config", "user_config"])
def test_dict_fields_must_be_dicts(field):
    with pytest.raises(nncompile.ConfigError) as e:
        ComputeConfig(1, **{field: [("device", "cpu")]})
    assert f"{field} must be a dict (got list)" in str(e.value)


@pytest.mark.parametrize("cap", [0, -1, "25", True])
def test_bucket_cap_is_a_positive_number(cap):
    with pytest.raises(nncompile.ConfigError, match="reducer_bucket_cap_mb must be a positive"):
        ComputeConfig(1, reducer_bucket_cap_mb=cap)


@pytest.mark.parametrize("policy", ["tp", "autodist"])
def test_unknown_pas_config_key_suggests_close_one(tmp_path, policy):
    with pytest.raises(nncompile.ConfigError) as e:
        _compile(tmp_path, ComputeConfig(2, pas_config={"recompute_module": ["Block"]}),
                 pas_policy=policy)
    assert "ComputeConfig(parallel=nncompile.ParallelSpec(...))" in str(e.value)
    msg = str(e.value)
    assert "unknown pas_config keys: ['recompute_module']" in msg
    assert "did you mean 'recompute_modules'?" in msg and "known: [" in msg


def test_known_pas_config_keys_compile(tmp_path):
    with pytest.warns(FutureWarning, match=r"pas_config\['device'\] -> parallel.device"):
        config = ComputeConfig(1, pas_config={"device": "cpu"})
    out = _compile(tmp_path, config)
    assert (out / "gencode0.py").exists()


@pytest.mark.parametrize("name", ["../x", "a/b", "..", ".", ".hidden", ""])
def test_instance_name_is_a_plain_name(tmp_path, name):
    with pytest.raises(nncompile.ConfigError) as e:
        _compile(tmp_path / "gen", instance_name=name)
    assert f"instance_name={name!r} must be a plain directory name" in str(e.value)
    assert not (tmp_path / "x").exists()


def _corrupt(out):
    (out / "manifest.json").write_text("{ not json")


def test_corrupted_manifest_under_match_is_a_reuse_error(tmp_path):
    out = _compile(tmp_path)
    _corrupt(out)
    with pytest.raises(nncompile.ReuseError) as e:
        _compile(tmp_path)
    msg = str(e.value)
    assert f"the manifest at {out / 'manifest.json'} is unreadable" in msg
    assert "reuse='override'" in msg


@pytest.mark.parametrize("reuse", ["override", "moo"])
def test_corrupted_manifest_is_regenerated(tmp_path, reuse):
    out = _compile(tmp_path)
    _corrupt(out)
    assert _compile(tmp_path, reuse=reuse) == out
    assert "fingerprint" in json.loads((out / "manifest.json").read_text())
    assert _compile(tmp_path) == out          # and "match" now reuses it
