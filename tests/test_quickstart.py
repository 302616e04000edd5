"""The README's main job: the quickstart trains on 2 gloo ranks and says where the code is."""
import re


def test_quickstart(run_ranks):
    out = run_ranks("examples/quickstart.py", 2)
    losses = [float(x) for x in re.findall(r"^step +\d+  loss ([0-9.]+)$", out, re.M)]
    assert len(losses) == 20
    assert losses[-1] < losses[0] / 2            # it learns
    assert re.search(r"Generated code, one file per rank: .*\.nncompile/GPT/gencode\{0\.\.1\}"
                     r"\.py", out)
