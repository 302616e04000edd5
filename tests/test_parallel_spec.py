"""ParallelSpec (nncompile/parallel_spec.py): the mesh dims and plan options, typed and checked
once; a dict works too; the old pas_config keys map onto its fields with a FutureWarning that
names them, and give the same config and the same generated code; plan.json prints the spec
and the mesh it made."""
import dataclasses
import json
import warnings

import pytest

import models
import nncompile
from nncompile import ComputeConfig, ConfigError, ParallelSpec
from nncompile.parallel_spec import FIELDS, LEGACY_KEYS


def test_every_old_key_has_one_field_and_every_field_a_doc():
    assert sorted(LEGACY_KEYS.values()) == sorted(FIELDS)
    assert len(LEGACY_KEYS) == 19
    for name, f in FIELDS.items():
        assert len(f.metadata["doc"]) > 20, name


def test_the_spec_and_a_dict_of_its_fields_are_one_config():
    spec = ParallelSpec(pp=2, microbatches=4, schedule="gpipe")
    a = ComputeConfig(4, 8, parallel=spec)
    b = ComputeConfig(4, 8, parallel={"pp": 2, "microbatches": 4, "schedule": "gpipe"})
    assert a == b and a.parallel is not None and b.parallel == spec
    assert a.pipeline.stages == 2 and a.pipeline.schedule == "gpipe"
    assert a.pipeline.microbatches == 4 and a.pas_config == {}
    assert spec.changed() == {"pp": 2, "schedule": "gpipe", "microbatches": 4}


def test_old_keys_map_onto_fields_with_a_warning_naming_them():
    with pytest.warns(FutureWarning) as record:
        old = ComputeConfig(4, 4, pas_config={"pipeline_stages": 2, "microbatches": 2,
                                              "context_parallel": 2, "device": "cpu"})
    message = str(record[0].message)
    assert record[0].filename == __file__          # points at the user's line
    for text in ("pas_config['pipeline_stages'] -> parallel.pp",
                 "pas_config['context_parallel'] -> parallel.cp",
                 "pas_config['microbatches'] -> parallel.microbatches",
                 "parallel=ParallelSpec(pp=2, cp=2, microbatches=2, device='cpu')"):
        assert text in message, message
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        new = ComputeConfig(4, 4, parallel=ParallelSpec(pp=2, cp=2, microbatches=2,
                                                        device="cpu"))
    assert old == new and old.plan_json() == new.plan_json()
    # replacing a field of the config re-checks it and warns no more
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert dataclasses.replace(old, runtime_ngpus=8).parallel == new.parallel


def test_a_key_and_its_field_that_disagree_are_refused():
    with pytest.raises(ConfigError, match=r"both set pp \(pas_config\['pipeline_stages'\]=2, "
                                          r"parallel.pp=4\); give it once, in parallel"):
        ComputeConfig(4, pas_config={"pipeline_stages": 2}, parallel={"pp": 4})


@pytest.mark.parametrize("given, words", [
    ({"pipeline_stages": 2}, "no field 'pipeline_stages' (did you mean 'pp'?)"),
    ({"microbatch": 2}, "no field 'microbatch' (did you mean 'microbatches'?)"),
    ({"pp": 0}, "parallel.pp=0; give a positive int or 'auto'"),
    ({"pp": True}, "parallel.pp=True"),
    ({"cp": "two"}, "parallel.cp='two'"),
    ({"ep": 1.5}, "parallel.ep=1.5"),
    ({"microbatches": "auto"}, "parallel.microbatches='auto'; give a positive int"),
    ({"schedule": "dualpipe"}, "parallel.schedule='dualpipe' is not a schedule"),
    ({"cp_attention": "ring"}, "parallel.cp_attention='ring'"),
    ({"cp_order": "zigzag", "cp_attention": "ulysses"}, "parallel.cp_order='zigzag'"),
    ({"overlap_grad_sync": 1}, "parallel.overlap_grad_sync=1"),
    ({"recompute_modules": "Block"}, "parallel.recompute_modules='Block'"),
    ({"batched_inputs": "x"}, "parallel.batched_inputs='x'"),
    ({"device": 3}, "parallel.device=3"),
    ({"mem_limit_gb": 0}, "parallel.mem_limit_gb=0: a number > 0"),
    ({"solver_time_limit": "1"}, "parallel.solver_time_limit='1'"),
    ({"optimizer_state_bytes": -2}, "parallel.optimizer_state_bytes=-2: a number >= 0"),
    ({"constraints": "h.*"}, "parallel.constraints must be a list"),
])
def test_each_field_is_checked_with_its_name(given, words):
    with pytest.raises(ConfigError) as e:
        ComputeConfig(2, parallel=given)
    assert words in str(e.value), str(e.value)


def test_counts_are_checked_against_the_plan_once():
    with pytest.raises(ConfigError, match=r"parallel.pp=3 does not divide plan_ngpus=4"):
        ComputeConfig(4, parallel={"pp": 3})
    with pytest.raises(ConfigError, match=r"parallel.cp=3: .* divides plan_ngpus=4"):
        ComputeConfig(4, parallel={"cp": 3})
    with pytest.raises(ConfigError, match=r"parallel.cp=4 splits each pipeline stage's ranks, "
                                          r"but parallel.pp=2 leaves 2"):
        ComputeConfig(4, parallel={"pp": 2, "cp": 4})
    with pytest.raises(ConfigError, match="need a pipeline: parallel.pp > 1"):
        ComputeConfig(4, parallel={"schedule": "gpipe"})
    with pytest.raises(ConfigError, match=r"pass nncompile.ParallelSpec\(...\) or a dict"):
        ComputeConfig(2, parallel=[("pp", 2)])


def test_old_keys_and_the_spec_generate_the_same_code(tmp_path):
    """One pipelined compile each way: identical rank files, and plan.json's "parallel"
    holds what was asked and the mesh it made."""
    model, batch = models.build("gpt"), models.batch("gpt", 0, 8)
    with pytest.warns(FutureWarning):
        old = ComputeConfig(4, 4, pas_config={"pipeline_stages": 2, "microbatches": 4})
    outs = [nncompile.parallelize(model, batch, config, pas_policy="tp",
                                  gen_savedir=tmp_path / name, load_module=False)
            for name, config in (("old", old), ("new", ComputeConfig(4, 4, parallel=ParallelSpec(
                pp=2, microbatches=4))))]
    for r in range(4):
        assert (outs[0] / f"gencode{r}.py").read_text() == \
            (outs[1] / f"gencode{r}.py").read_text()
    plan = json.loads((outs[1] / "plan.json").read_text())
    assert plan["parallel"] == {"spec": {"pp": 2, "microbatches": 4},
                                "mesh": {"dp": 1, "pp": 2, "tp": 2}}
