"""The conformance suite: a user's training loop (AdamW with two parameter groups, warmup +
cosine LambdaLR, clipping, accumulation, eval()/no_grad() validation, a checkpoint in every
format and its resume, dropout, BatchNorm) under every plan equals the same loop on one device
(tests/conformance.py says how, and why that reference). A new plan or runtime feature adds a
cell to conformance.CELLS.

With -s the matrix (plan x feature -> max |error|) is printed at the end; it is also written
to <pytest's basetemp>/conformance_matrix.txt. `python tests/conformance.py --matrix` prints
it without pytest.
"""
from __future__ import annotations

import time
from dataclasses import replace

import pytest
import torch
from torch.distributed.tensor import DTensor

import conformance as c
import conformance_reference as ref
import conformance_run as run
from conftest import launch_ranks
import nncompile

THREADED = [cell for cell in c.CELLS if not cell.process]
PROCESS = [cell for cell in c.CELLS if cell.process]


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    rows: dict = {}
    times: dict = {}
    yield rows, times
    if rows:
        order = [cell.name for cell in c.CELLS if cell.name in rows]
        text = run.format_matrix({n: rows[n] for n in order}, times)
        if "(torchrun launch)" in times:
            text += f"\nthe process cells ran in torchrun launches (one per world size) of " \
                    f"{times['(torchrun launch)']:.0f}s (in the total)"
        path = tmp_path_factory.getbasetemp() / "conformance_matrix.txt"
        path.write_text(text + "\n")
        print(f"\nconformance matrix ({path}):\n{text}")


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """Every process cell, one torchrun launch per world size."""
    root = tmp_path_factory.mktemp("conformance_launch")
    t0 = time.time()
    results, out = run.launch(root, [cell.name for cell in PROCESS], ranks=launch_ranks)
    return root, results, out, time.time() - t0


def _run(cell, workdir, matrix, results=None, output=""):
    rows, times = matrix
    t0 = time.time()
    try:
        rows[cell.name], _ = run.run_cell(cell, workdir, results)
    except ref.Mismatch as e:
        rows[cell.name] = e.row
        raise
    except Exception as e:
        rows[cell.name] = {"train": c._short(e)}
        if output:
            pytest.fail(f"{cell.name}: {c._short(e)}\n---- launch output ----\n{output[-3000:]}")
        raise
    finally:
        times[cell.name] = time.time() - t0


@pytest.mark.parametrize("cell", THREADED, ids=[cell.name for cell in THREADED])
def test_plan_trains_like_one_device(cell, tmp_path, matrix):
    _run(cell, tmp_path, matrix)


@pytest.mark.parametrize("cell", PROCESS, ids=[cell.name for cell in PROCESS])
def test_process_plan_trains_like_one_device(cell, launched, matrix):
    root, results, output, seconds = launched
    matrix[1].setdefault("(torchrun launch)", seconds)
    _run(cell, root / cell.name, matrix, results, output)


# ---- the suite fails when a known-good case is broken on purpose ------------------------------
def _ignore_group_weight_decay(monkeypatch):
    """build_optimizer gives the no-decay group the first group's weight decay."""
    real = nncompile.build_optimizer

    def broken(pm, cls, **kw):
        opt = real(pm, cls, **kw)
        for g in opt.param_groups:
            g["weight_decay"] = opt.param_groups[0]["weight_decay"]
        return opt
    monkeypatch.setattr(nncompile, "build_optimizer", broken)


class _FixedLR(dict):
    """A parameter group whose lr a scheduler cannot change."""

    def __setitem__(self, key, value):
        if key != "lr" or "lr" not in self:
            super().__setitem__(key, value)


def _schedule_misses_a_group(monkeypatch):
    """The LR scheduler's writes do not reach the second group."""
    real = nncompile.build_optimizer

    def broken(pm, cls, **kw):
        opt = real(pm, cls, **kw)
        opt.param_groups[1] = _FixedLR(opt.param_groups[1])
        return opt
    monkeypatch.setattr(nncompile, "build_optimizer", broken)


def _clip_by_local_norm(monkeypatch):
    """Clipping by the norm of this rank's shards only (not summed over the plan unit)."""
    def local_clip(pm, max_norm):
        grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                 for p in pm.parameters() if p.grad is not None]    # this rank's pieces
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g)
                                                     for g in grads]))
        if norm > max_norm:
            for g in grads:
                g.mul_(max_norm / (norm + 1e-6))
        return norm
    monkeypatch.setattr(nncompile, "clip_grad_norm_", local_clip)


@pytest.mark.parametrize("breakage, caught_by", [
    (_ignore_group_weight_decay, "weights"),
    (_schedule_misses_a_group, "weights"),
    (_clip_by_local_norm, "norm"),
], ids=["weight-decay-of-one-group-ignored", "schedule-misses-a-group", "clip-by-local-norm"])
def test_the_suite_catches_a_broken_known_good_case(breakage, caught_by, tmp_path, monkeypatch):
    """The tp cell (a known-good case), without checkpoints and shorter, broken on purpose:
    the comparison names the first step and value that differ."""
    loop = replace(c.BY_NAME["tp"].loop, steps=4, formats=())
    cell = replace(c.BY_NAME["tp"], name="tp_broken", loop=loop)
    breakage(monkeypatch)
    with pytest.raises(ref.Mismatch) as e:
        run.run_cell(cell, tmp_path)
    assert caught_by in e.value.row.get("out of tolerance", []), str(e.value)
    assert "one device" in str(e.value) and "tp_broken" in str(e.value)
