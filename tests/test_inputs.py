"""The inputs real training code passes: the same tensor twice (labels=input_ids)."""
import pytest
import torch

import models
import nncompile
from nncompile.frontend import trace


@pytest.mark.parametrize("policy", ["data", "tp"])
def test_the_same_tensor_passed_twice_stays_two_inputs(tmp_path, policy):
    """Compiled with labels=input_ids (one tensor object), then called with distinct ones:
    loss and every gradient equal the single-device run (rank threads, one process)."""
    model = models.build("hf_gpt2")
    t = torch.randint(0, 64, (4, 16))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 64, (4, 16), generator=g), torch.randint(0, 64, (4, 16), generator=g)
    for dummy, batch in (((t, t), (x, y)),
                         ({"input_ids": t, "labels": t}, {"input_ids": x, "labels": y})):
        report = nncompile.verify(model, dummy, nncompile.ComputeConfig(2), policy,
                                  gen_savedir=str(tmp_path), inputs=batch)
        assert report.ok, str(report)


def test_each_input_is_read_where_it_belongs():
    t = torch.randint(0, 64, (4, 16))
    graph = trace(models.build("hf_gpt2"), (t, t))
    ids, labels = graph.inputs
    first = next(op for op in graph.ops if ids in op.inputs() or labels in op.inputs())
    assert ids in first.inputs() and labels not in first.inputs()    # embedding reads ids
    # a view of another input (labels = input_ids[:, 1:] style) is a separate input too
    u = torch.randint(0, 64, (4, 17))
    graph = trace(models.build("hf_gpt2"), (u[:, :-1], u[:, 1:]))
    assert len(graph.inputs) == 2


def test_inputs_of_the_wrong_kind_dtype_or_device_are_named(tmp_path):
    import numpy as np
    pm = nncompile.parallelize(models.build("mlp"), models.batch("mlp", 0),
                               nncompile.ComputeConfig(plan_ngpus=1), pas_policy="dp",
                               gen_savedir=tmp_path)
    b = models.batch("mlp", 1)
    with pytest.raises(nncompile.InputMismatchError,
                       match=r"input 'x' is a numpy.ndarray, but the module was traced with a "
                             r"torch.float32\[4, 16\] tensor \(convert it with torch.as_tensor\)"):
        pm(np.zeros((4, 16), dtype=np.float32), b["y"])
    with pytest.raises(nncompile.InputMismatchError, match=r"input 'y' is a list, .*as_tensor"):
        pm(b["x"], b["y"].tolist())
    with pytest.raises(nncompile.InputMismatchError,
                       match=r"input 'x' is torch.float64 but the module was traced with "
                             r"torch.float32; convert it with .to\(torch.float32\)") as e:
        pm(b["x"].double(), b["y"])
    assert "shapes are static" not in str(e.value)
    with pytest.raises(nncompile.InputMismatchError,
                       match=r"input 'x' is on meta but this rank's module is on cpu"):
        pm(b["x"].to("meta"), b["y"])
