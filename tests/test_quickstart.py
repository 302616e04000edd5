"""The README's main job: the quickstart trains on 2 gloo ranks with tp and autodist side by
side, and says what each plan communicates and where the code is."""
import re


def test_quickstart(run_ranks):
    out = run_ranks("examples/quickstart.py", 2)
    rows = re.findall(r"^step +\d+  loss tp ([0-9.]+)  autodist ([0-9.]+)$", out, re.M)
    assert len(rows) == 20
    tp = [float(a) for a, _ in rows]
    assert tp[-1] < tp[0] / 2                     # it learns
    assert all(a == b for a, b in rows)           # both plans train the same model
    assert re.search(r"^tp: \.nncompile/GPT/\n  weights: .*S\(0\).*\n"
                     r"  collectives per step: 12 \(4 all_reduce, ", out, re.M), out
    assert re.search(r"^autodist: \.nncompile/autodist/GPT/\n", out, re.M), out
    assert "autodist estimate: " in out
    assert re.search(r"Generated code, one file per rank: .*\.nncompile/GPT/gencode\{0\.\.1\}"
                     r"\.py", out)
