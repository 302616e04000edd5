"""benchmarks/compile_speedup.py's loss check: float32 contenders must match eager's losses;
bf16 ones are measured by their drift from a float32 reference, so eager and compiled bf16 runs
that part ways by rounding alone (each as close to float32 as the other) pass, while a compiled
run that drifts far beyond eager's fails."""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def bench():
    path = os.path.join(ROOT, "benchmarks")
    sys.path.insert(0, path)                  # its run_record helper, for the import only
    try:
        spec = importlib.util.spec_from_file_location(
            "compile_speedup", os.path.join(path, "compile_speedup.py"))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(path)
    return module


def _losses(start, rate, wobble, steps=23):
    return [start - rate * i + wobble * (-1) ** i for i in range(steps)]


def test_float32_compares_with_eager(bench):
    args = argparse.Namespace(loss_rtol=1e-4, dtype="float32")
    eager = _losses(6.3, 0.05, 0.0)
    ok, diff = bench.loss_check(args, {"eager": eager, "compiled": [x * (1 + 3e-7) for x in eager]})
    assert ok and diff["compiled"] < 1e-6
    ok, _ = bench.loss_check(args, {"eager": eager, "compiled": [x * (1 + 1e-3) for x in eager]})
    assert not ok


def test_bfloat16_measures_drift_from_float32(bench):
    args = argparse.Namespace(loss_rtol=2e-2, dtype="bfloat16")
    ref = _losses(6.3, 0.05, 0.0)
    eager = [x * (1 + 0.05) for x in ref]           # bf16 rounding: 5 % off float32
    compiled = [x * (1 - 0.046) for x in ref]       # the other way: 9.6e-2 from eager
    ok, drift = bench.loss_check(args, {"eager": eager, "compiled": compiled,
                                        bench.REFERENCE: ref})
    assert ok, drift
    assert drift["compiled"] == pytest.approx(0.046) and drift["eager"] == pytest.approx(0.05)
    wrong = [x * 1.3 for x in ref]                  # a real error: far beyond eager's drift
    ok, drift = bench.loss_check(args, {"eager": eager, "compiled": wrong,
                                        bench.REFERENCE: ref})
    assert not ok
    small = [x * (1 + 1e-3) for x in ref]           # below the floor: always fine
    assert bench.loss_check(args, {"eager": ref, "compiled": small, bench.REFERENCE: ref})[0]
