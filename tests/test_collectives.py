"""Collectives on real gloo ranks: hypothesis over layout pairs (values preserved forward and
backward), nncompile.verify, and generate-once-then-wait (tests/workers/collectives.py)."""
import pytest


@pytest.mark.parametrize("world", [2, 4])
def test_collectives(world, run_ranks, tmp_path):
    out = run_ranks("tests/workers/collectives.py", world, str(tmp_path))
    assert "collectives worker: all checks passed" in out
    assert "nncompile.verify: OK" in out
