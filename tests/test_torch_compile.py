"""ComputeConfig(compile=True) / ParallelModule.compile in one process: a runtime option (same
plan and fingerprint), checked like the other fields, refused where it cannot compile, and a
compiled forward that is one graph computing what the uncompiled one does. The multi-rank
inductor runs are in the parity matrix (tests/workers/parity.py, COMPILED) and the collectives
worker."""
import json

import pytest
import torch

import models
import nncompile
from nncompile import ComputeConfig


def test_compile_is_a_runtime_option(tmp_path):
    assert ComputeConfig(2, compile=True).plan_json() == ComputeConfig(2).plan_json()
    dirs = [nncompile.parallelize(models.build("mlp"), models.batch("mlp", 0),
                                  ComputeConfig(2, compile=c), pas_policy="tp",
                                  gen_savedir=tmp_path, instance_name=f"c{c}", load_module=False)
            for c in (False, True)]
    prints = [json.loads((d / "manifest.json").read_text())["fingerprint"] for d in dirs]
    assert prints[0] == prints[1]


@pytest.mark.parametrize("kw, words", [
    ({"use_zero": 3}, "ZeRO-3"),
    ({"parallel": {"pp": 2}}, "pipelined plan"),
])
def test_compile_refuses_what_it_cannot_trace(kw, words):
    with pytest.raises(nncompile.ConfigError, match=words):
        ComputeConfig(2, compile=True, **kw)


def test_compiled_forward_is_one_graph_and_equal(tmp_path):
    """backend="eager" (dynamo's trace, no inductor): the same ops, so the same numbers."""
    from torch._dynamo.utils import counters
    batch = models.batch("gpt", 0)
    lazy = nncompile.parallelize(models.build("gpt"), batch, ComputeConfig(1, compile=True),
                                 pas_policy="dp", gen_savedir=tmp_path)
    assert lazy.compile_options == {"backend": "inductor"}      # compiles on the first call
    out = {}
    for compiled in (False, True):
        pm = nncompile.parallelize(models.build("gpt"), batch, ComputeConfig(1),
                                   pas_policy="dp", gen_savedir=tmp_path)
        if compiled:
            counters.clear()
            assert pm.compile(backend="eager", fullgraph=True) is pm
        loss = pm(**batch)
        loss.backward()
        out[compiled] = (loss.detach(), {n: p.grad for n, p in pm.named_parameters()})
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    torch.testing.assert_close(out[True], out[False], rtol=0, atol=0)
    torch._dynamo.reset()
