"""Editing generated code: an edited gencode file runs, with one EditedCodeWarning per process;
reuse='match' never overwrites it; regenerating keeps the edited version in edited/."""
import hashlib
import json
import warnings

import pytest
import torch

import models
import nncompile
from nncompile import ComputeConfig

MARK = "print('edited forward ran', flush=True)"


def _compile(model, tmp_path, **kw):
    return nncompile.parallelize(model, models.batch("gpt", 0), ComputeConfig(1, 1),
                                 pas_policy="dp", gen_savedir=tmp_path, **kw)


def _edit(path):
    text = path.read_text()
    anchor = "        DEVICE, PLAN_GROUP = self.device, self.plan_group\n"
    assert anchor in text
    path.write_text(text.replace(anchor, anchor + f"        {MARK}\n", 1))


def test_manifest_records_file_hashes(tmp_path):
    out = nncompile.parallelize(models.build("gpt"), models.batch("gpt", 0), ComputeConfig(2, 4),
                                pas_policy="tp", gen_savedir=tmp_path, load_module=False)
    files = json.loads((out / "manifest.json").read_text())["files"]
    assert sorted(files) == [f"gencode{r}.py" for r in range(4)]
    for name, sha in files.items():
        assert hashlib.sha256((out / name).read_bytes()).hexdigest() == sha


def test_edited_file_runs_and_warns_once(tmp_path, capfd):
    model = models.build("gpt")
    pm = _compile(model, tmp_path)
    inputs = models.batch("gpt", 0)
    expected = pm(**inputs).item()
    capfd.readouterr()
    _edit(tmp_path / "GPT" / "gencode0.py")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):                      # rerun twice: the warning shows once
            pm = _compile(model, tmp_path)
            assert pm(**inputs).item() == pytest.approx(expected, rel=1e-6)
    edited = [w for w in caught if issubclass(w.category, nncompile.EditedCodeWarning)]
    assert len(edited) == 1, [str(w.message) for w in caught]
    assert "gencode0.py was edited" in str(edited[0].message)
    assert edited[0].filename == __file__      # points at the caller's parallelize line
    assert capfd.readouterr().out.count("edited forward ran") == 2


def test_match_never_overwrites_an_edited_file(tmp_path):
    _compile(models.build("gpt"), tmp_path, load_module=False)
    path = tmp_path / "GPT" / "gencode0.py"
    _edit(path)
    edited_text = path.read_text()
    torch.manual_seed(1)
    changed = models.GPT(n_layer=1)             # a different model: the plan no longer matches
    with pytest.raises(nncompile.ReuseError, match="Edited file\\(s\\) gencode0.py"):
        _compile(changed, tmp_path, load_module=False)
    assert path.read_text() == edited_text
    # same model, reuse='moo': nothing to regenerate, the edit stays
    _compile(models.build("gpt"), tmp_path, load_module=False, reuse="moo")
    assert path.read_text() == edited_text
    # regenerating replaces it and keeps the edited version under edited/
    with pytest.warns(nncompile.EditedCodeWarning, match="kept in"):
        _compile(changed, tmp_path, load_module=False, reuse="override")
    assert MARK not in path.read_text()
    assert (tmp_path / "GPT" / "edited" / "gencode0.py").read_text() == edited_text
