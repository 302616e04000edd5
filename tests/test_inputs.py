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
