"""Generated code says what its lines do not: each collective's backward (a comment above it),
the gradient reduction the runtime does after backward (a header section with groups and
bytes), and an inserted collective sits under the source line of the op it serves."""
from __future__ import annotations

import json
import re

import pytest
import torch

import models
import nncompile
from nncompile.collectives import by_name
from nncompile.comm_stats import fmt_bytes

COMM = re.compile(r"^\s+\w+(?:, \w+)*,? = comm\.(\w+)\(")


def _compile(name, policy, runtime, tmp_path):
    torch.manual_seed(0)
    nncompile.parallelize(models.build(name), models.batch(name, 0),
                          nncompile.ComputeConfig(2, runtime), pas_policy=policy,
                          load_module=False, gen_savedir=tmp_path, instance_name="m")
    inst = tmp_path / "m"
    return inst, json.loads((inst / "manifest.json").read_text())


@pytest.mark.parametrize("name,policy", [("mlp", "tp"), ("gpt", "tp"), ("gpt", "tp_sp"),
                                         ("gpt", "data")])
def test_every_collective_names_its_backward(name, policy, tmp_path):
    inst, _ = _compile(name, policy, 2, tmp_path)
    plan = json.loads((inst / "plan.json").read_text())
    lines = (inst / "gencode0.py").read_text().splitlines()
    seen, fused = [], 0
    for i, line in enumerate(lines):
        m = COMM.match(line)
        if not m:
            continue
        kind, above = m[1], lines[i - 1].strip()
        seen.append(kind)
        assert above.startswith(f"# {kind} "), (line, above)
        row = plan["collective_ops"][len(seen) - 1]         # one row per line, in order
        assert row["kind"] == kind and (row["name"] == line.split(" = ")[0].strip()
                                        or f"comm.{kind}({row['input']}," in line), (row, line)
        if row["backward"] == "-":
            assert "no backward" in above, above
        elif kind in ("cross_entropy_rows",):
            assert "backward: local" in above, above
        else:
            dual = row["backward"]
            assert f"(backward: {dual}" in above, (above, dual)
            if "linears=" in line:                                # passes/overlap_grad_sync
                assert f"(backward: {dual} of the input gradient, overlapped with the " \
                       "weight gradients)" in above, above
                fused += 1
            elif by_name(kind).syncs_grad:
                assert "(backward: all_reduce of the gradient)" in above
    assert seen == [r["kind"] for r in plan["collective_ops"]]      # one comment each
    # the column regions (q/k/v, fc; 2 per block) fuse with their sync_grad (tp) or their
    # reduce-scattering all_gather (tp_sp)
    assert fused == (2 * 2 if name == "gpt" and policy in ("tp", "tp_sp") else 0), fused


def test_inserted_collective_sits_under_the_op_it_serves(tmp_path):
    inst, _ = _compile("gpt", "tp", 2, tmp_path)
    lines = (inst / "gencode1.py").read_text().splitlines()
    i = next(i for i, ln in enumerate(lines) if "h0_mlp_proj_bias_to_partial = comm" in ln)
    # the bias's to_partial is for mlp_proj: no op of another source line between them
    nxt = next(ln for ln in lines[i + 1:] if not ln.strip().startswith("#"))
    assert "h0_mlp_proj_linear = aten.linear" in nxt
    src = next(ln for ln in reversed(lines[:i]) if re.match(r"\s+# \S+\.py:\d+", ln))
    assert "mlp_proj" in src, src
    # an all_reduce of a linear's partial output stays under the linear's line
    j = next(i for i, ln in enumerate(lines) if "h0_mlp_proj_linear_all_reduce = comm" in ln)
    prev = [ln for ln in lines[:j] if not ln.strip().startswith(("#", "del "))][-1]
    assert "h0_mlp_proj_linear = aten.linear" in prev and \
        "# all_reduce" in lines[j - 1] and not re.match(r"\s+# \S+\.py:\d+", lines[j - 2])


def _header(text: str) -> list[str]:
    start = text.index("# Gradient reduction after backward")
    return text[start:text.index("\n\n", start)].splitlines()


@pytest.mark.parametrize("policy,runtime", [("data", 2), ("tp", 4), ("tp", 2)])
def test_header_lists_the_gradient_reductions(policy, runtime, tmp_path):
    inst, manifest = _compile("gpt", policy, runtime, tmp_path)
    for rank in range(runtime):
        header = _header((inst / f"gencode{rank}.py").read_text())
        params = manifest["ranks"][str(rank)]["params"]
        partial = [p for p in params if p["partial_sum_count"] > 1 and p["trainable"]]
        other = [p for p in params if p["partial_sum_count"] == 1 and p["trainable"]]

        def nbytes(ps):
            return sum(eval("*".join(str(b - a) for a, b in p["slices"])) * 4 for p in ps)
        text = "\n".join(header)
        if partial:
            assert re.search(rf"partial-sum gradients: summed over .*: {len(partial)} tensors, "
                             rf"{nbytes(partial):,} B \({re.escape(fmt_bytes(nbytes(partial)))}"
                             r"\) from this rank, 1 bucket", text), text
        if runtime > 2:
            assert re.search(rf"other trainable gradients: averaged \(x 0.5\) over the "
                             rf"data-parallel group \(2 ranks\): {len(other)} tensors, "
                             rf"{nbytes(other):,} B", text), text
        if not partial and runtime == 2:
            assert "none: one data-parallel unit and no partial-sum gradients" in text


def test_comments_are_deterministic(tmp_path):
    a, _ = _compile("gpt", "tp_sp", 4, tmp_path / "a")
    b, _ = _compile("gpt", "tp_sp", 4, tmp_path / "b")
    for r in range(4):
        assert (a / f"gencode{r}.py").read_bytes() == (b / f"gencode{r}.py").read_bytes()
