"""What a newcomer sees first: the progress lines of a compile, `nncompile show DIR | head`, the
note autodist prints without a GPU, and the README's list of device profiles."""
from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import nncompile
from conftest import ROOT
from models import GPT
from nncompile.passes.autodist import profiles


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """A 2-layer GPT compiled for 2 ranks under tp (no process group), and its progress lines."""
    savedir = tmp_path_factory.mktemp("gen")
    torch.manual_seed(0)
    model = GPT(vocab_size=16, block_size=32, n_layer=2, n_head=4, n_embd=64)
    idx = torch.randint(0, 16, (8, 32))
    mp = pytest.MonkeyPatch()
    mp.setenv("NNCOMPILE_QUIET", "0")
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            out = nncompile.parallelize(model, {"idx": idx, "targets": (idx + 1) % 16},
                                        nncompile.ComputeConfig(2, 2), pas_policy="tp",
                                        gen_savedir=str(savedir), load_module=False,
                                        reuse="override")
    finally:
        mp.undo()
    return Path(out), err.getvalue()


def test_trace_line_counts_layers_in_agreement(compiled):
    _, log = compiled
    traced = [ln for ln in log.splitlines() if "] traced " in ln]
    assert traced, log
    # two identical blocks: one traced, one copied from it
    assert "; 1 identical layer copied from a traced one)" in traced[0], traced[0]


def test_pass_times_in_one_column(compiled):
    _, log = compiled
    rows = [ln for ln in log.splitlines() if re.match(r"\[nncompile\]   pass \S", ln)]
    names = [ln.split()[2] for ln in rows]
    assert "overlap_grad_sync" in names and len(rows) >= 5, log
    ends = {ln.index(" ms") for ln in rows}
    assert len(ends) == 1, "\n".join(rows)            # every time ends in the same column


def test_show_into_a_closed_pipe_is_quiet(compiled):
    """`nncompile show DIR | head`: the reader leaves early; no traceback follows."""
    outdir, _ = compiled
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NNCOMPILE_QUIET": "1"}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    proc = subprocess.Popen([sys.executable, "-m", "nncompile", "show", str(outdir)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()                 # before it writes anything: every write fails
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 1
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
    # and the whole output when read to the end
    full = subprocess.run([sys.executable, "-m", "nncompile", "show", str(outdir)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)
    assert full.returncode == 0 and full.stdout.strip(), full.stderr


def test_no_gpu_note_names_only_gpu_profiles(monkeypatch):
    monkeypatch.setattr(profiles, "default_device", lambda: "cpu")
    note = profiles.cpu_fallback_note(None)
    gpus = re.search(r"built-in GPU profiles: ([^)]*)\)", note).group(1)
    names = re.findall(r"'([\w-]+)'", gpus)
    assert names == [n for n in profiles.BUILTIN if n not in ("cpu", "cpu-gloo-2core")], note
    assert "cpu" not in " ".join(names), note


def test_readme_lists_every_builtin_profile():
    readme = (Path(ROOT) / "README.md").read_text()
    para = re.search(r"Built-in device profiles:(.*?);", readme, re.S)
    assert para, "README.md: no 'Built-in device profiles:' list"
    listed = re.findall(r"`([\w-]+)`", para.group(1))
    assert sorted(listed) == sorted(profiles.BUILTIN), listed


def test_readme_runs_what_ci_runs_and_its_quick_files_exist():
    readme = (Path(ROOT) / "README.md").read_text()
    ci = (Path(ROOT) / ".ci" / "run").read_text().splitlines()
    commands = [ln for ln in ci if ln and not ln.startswith(("#", "set ", "cd "))]
    assert commands == ["bash scripts/setup.sh", "python -m pytest"], commands
    shown = [ln.split("#")[0].strip() for ln in readme.splitlines()]
    for command in commands:                  # the set-up and test commands a reader copies
        assert command in shown, f"README.md does not show CI's `{command}`"
    quick = re.search(r"OMP_NUM_THREADS=1 python -m pytest (tests/\S+(?: tests/\S+)*)\n", readme)
    assert quick, "README.md: no quick subset of the tests"
    for name in quick.group(1).split():
        assert (Path(ROOT) / name).is_file(), f"README.md's quick subset names missing {name}"


def test_importing_hugging_face_after_nncompile_prints_nothing():
    """torchao's unloadable CUDA kernels and torch's pytree notice to torchao are not printed
    when transformers (which imports torchao) comes after nncompile; other warnings still are."""
    code = ("import logging, nncompile\n"
            "from transformers import GPT2LMHeadModel\n"
            "import torchao.float8\n"
            "logging.getLogger('torchao').warning('Failed to load something else')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.strip() == "Failed to load something else", proc.stderr
