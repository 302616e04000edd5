"""The notebooks in notebooks/ run top to bottom (their key cells assert what they show), one
test per notebook, executed with nbclient from notebooks/ as the working directory."""
from __future__ import annotations

import re
import time
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
EXPECTED = ["01_trace_and_ir.ipynb", "02_constant_folding.ipynb", "03_autodist.ipynb",
            "04_comm_insertion.ipynb", "05_gen_savedir.ipynb"]
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def test_all_notebooks_exist():
    assert sorted(p.name for p in NOTEBOOKS.glob("*.ipynb")) == EXPECTED


@pytest.mark.parametrize("name", EXPECTED)
def test_notebook_runs(name, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")          # the kernel inherits the environment
    monkeypatch.setenv("NNCOMPILE_QUIET", "1")
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    client = NotebookClient(nb, timeout=400, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOKS)}})
    start = time.perf_counter()
    error = None
    try:
        client.execute()
    except CellExecutionError as e:          # its text: the cell's source and traceback
        error = ANSI.sub("", str(e))
    if error is not None:
        pytest.fail(f"{name}: a cell failed\n{error}", pytrace=False)
    print(f"{name}: {time.perf_counter() - start:.1f}s")
