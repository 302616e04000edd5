"""The rank-file schema (nncompile/rank_file.py): every declaration a generated file makes is a
RankFile field of the declared type, the runtime reads the file through it, and a file of
another schema version (or of none) is refused at load with the fix."""
import ast
import copy

import pytest

import models
import nncompile
from nncompile import rank_file
from nncompile.runtime.program.loader import load_rank_module

CONFIGS = {"tp": (nncompile.ComputeConfig(2, 4), "tp"),
           "zero3": (nncompile.ComputeConfig(1, 2, use_zero=3), "dp"),
           "pipeline": (nncompile.ComputeConfig(2, 2, parallel={
               "pp": 2, "microbatches": 2}), "dp")}


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    out = {}
    model, batch = models.build("gpt"), models.batch("gpt", 0)
    for name, (cfg, policy) in CONFIGS.items():
        d = tmp_path_factory.mktemp(name) / "gen"
        nncompile.api.compile_module(copy.deepcopy(model), batch, cfg, pas_policy=policy,
                                     outdir=d)
        out[name] = d
    return out


def _declared(path) -> dict:
    cls = next(n for n in ast.parse(path.read_text()).body if isinstance(n, ast.ClassDef))
    return {t.id: ast.literal_eval(n.value) for n in cls.body if isinstance(n, ast.Assign)
            for t in n.targets if isinstance(t, ast.Name) and t.id.isupper()}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_declaration_is_a_typed_schema_field(compiled, name):
    for path in sorted(compiled[name].glob("gencode*.py")):
        declared = _declared(path)
        assert declared["SCHEMA"] == rank_file.SCHEMA_VERSION
        for attr, value in declared.items():
            f = rank_file.FIELDS.get(attr)
            assert f is not None, f"{path.name} declares {attr}, which RankFile lacks"
            kind = f.metadata["kind"]
            assert isinstance(value, kind) or (isinstance(value, tuple) and list in (
                kind if isinstance(kind, tuple) else (kind,))), (attr, value)
    assert "PIPELINE" in declared if name == "pipeline" else "PIPELINE" not in declared
    assert ("ZERO_UNITS" in declared) == (name == "zero3")


def test_the_runtime_reads_the_file_through_the_schema(compiled):
    pm = load_rank_module(compiled["tp"], 1, models.build("gpt"))
    assert pm.rank_file.rank == 1 and pm.rank_file.plan_ngpus == 2
    assert pm.rank_file.runtime_ngpus == 4 and pm.rank_file.policy == "tp"
    assert [row[1] for row in pm.rank_file.params] == [row[1] for row in pm.PARAMS]


SCHEMA_LINE = f"    SCHEMA = {rank_file.SCHEMA_VERSION}  # the rank-file schema (nncompile/rank_file.py)\n"


@pytest.mark.parametrize("replacement, words", [
    ("", "before rank-file schemas"), ("    SCHEMA = 7\n", "of schema version 7")])
def test_a_file_of_another_schema_version_is_refused_with_the_fix(compiled, tmp_path,
                                                                  replacement, words):
    text = (compiled["tp"] / "gencode0.py").read_text()
    assert SCHEMA_LINE in text
    (tmp_path / "gencode0.py").write_text(text.replace(SCHEMA_LINE, replacement))
    with pytest.raises(nncompile.ConfigError) as e:
        load_rank_module(tmp_path, 0, models.build("gpt"))
    message = str(e.value)
    assert words in message and "gencode0.py" in message, message
    assert f"reads version {rank_file.SCHEMA_VERSION}" in message and \
        "reuse='override'" in message, message


def test_a_declaration_of_the_wrong_type_is_refused_by_name(compiled, tmp_path):
    text = (compiled["tp"] / "gencode0.py").read_text()
    (tmp_path / "gencode0.py").write_text(text.replace("    PLAN_NGPUS = 2\n",
                                                       "    PLAN_NGPUS = '2'\n"))
    with pytest.raises(nncompile.ConfigError) as e:
        load_rank_module(tmp_path, 0, models.build("gpt"))
    assert "declares PLAN_NGPUS = '2'" in str(e.value) and "must be of type int" in str(e.value)
