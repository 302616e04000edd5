"""`nncompile plot`: boxes labelled with module paths and their weights' placements, repeated
blocks drawn once (the first expanded, the identical rest summarized), a sane aspect ratio."""
from __future__ import annotations

import json

import pytest
import torch

import models
import nncompile
from nncompile.tools import inspection
from nncompile.tools.plot import block_of, condensed_graph


def _compile(model, example, tmp_path, name):
    nncompile.parallelize(model, example, nncompile.ComputeConfig(2, 2), pas_policy="tp",
                          load_module=False, gen_savedir=tmp_path, instance_name=name)
    inst = tmp_path / name
    return (inst, json.loads((inst / "plan.json").read_text()),
            json.loads((inst / "manifest.json").read_text()))


@pytest.fixture(scope="module")
def gpt(tmp_path_factory):
    torch.manual_seed(0)
    return _compile(models.build("gpt"), models.batch("gpt", 0),
                    tmp_path_factory.mktemp("plot_gpt"), "GPT")


@pytest.fixture(scope="module")
def llama8(tmp_path_factory):
    """A Hugging Face Llama of 8 layers, built on the meta device (no weights in memory)."""
    with torch.device("meta"):
        model = models.hf_llama(n_layer=8)
    return _compile(model, models.batch("hf_llama", 0), tmp_path_factory.mktemp("plot_llama"),
                    "Llama")


def _check_blocks(plan, manifest, family, n_blocks):
    g, expanded = condensed_graph(plan, manifest)
    nodes = dict(g.nodes(data=True))
    assert expanded == [f"{family}.0"]                       # one block expanded
    summaries = [d for d in nodes.values() if d["kind"] == "summary"]
    assert len(summaries) == 1
    assert summaries[0]["blocks"] == [f"{family}.{i}" for i in range(1, n_blocks)]
    if n_blocks > 2:
        assert f"x {n_blocks - 1} identical blocks" in summaries[0]["label"]
    # no box of a summarized block is drawn on its own
    assert not any(d.get("block") not in (None, f"{family}.0") for d in nodes.values())
    return g, nodes


def test_gpt_boxes_name_modules_and_weights(gpt, tmp_path):
    inst, plan, manifest = gpt
    g, nodes = _check_blocks(plan, manifest, "h", 2)
    labels = {d["label"] for d in nodes.values()}
    assert "attn.q_proj: linear" in labels and "mlp_fc: linear" in labels
    q = next(d for d in nodes.values() if d["label"] == "attn.q_proj: linear")
    assert q["block"] == "h.0" and ("weight", plan["params"]["h.0.attn.q_proj.weight"]) \
        in q["weights"]
    proj = next(d for d in nodes.values() if d["label"] == "mlp_proj: linear")
    assert ("weight", "S(1)") in proj["weights"] and proj["placement"] == "P"
    kinds = [d["label"].split()[0] for d in nodes.values() if d["kind"] == "collective"]
    assert "all_reduce" in kinds and "sync_grad" in kinds
    # an inserted collective of a parameter belongs to the parameter's block
    assert all(d["block"] == "h.0" for d in nodes.values() if d["kind"] == "collective"
               and d["label"].startswith("to_partial"))
    _check_png(inst, tmp_path / "gpt.png")


def test_many_layers_draw_like_one(llama8, tmp_path):
    inst, plan, manifest = llama8
    assert len(plan["ops"]) > 400
    g, nodes = _check_blocks(plan, manifest, "model.model.layers", 8)
    labels = {d["label"] for d in nodes.values()}
    for label in ("self_attn.q_proj: linear", "self_attn.o_proj: linear",
                  "mlp.down_proj: linear"):
        assert label in labels, sorted(labels)
    assert g.number_of_nodes() < 40                         # 8 layers draw as about 1
    _check_png(inst, tmp_path / "llama.png")


def _check_png(inst, png):
    import matplotlib.image
    assert inspection.plot(inst, png) == png
    h, w = matplotlib.image.imread(png).shape[:2]
    assert 1 / 3 < w / h < 3, (w, h)                         # neither a strip nor a tower
    assert 300 < w < 6000 and 300 < h < 6000


def test_block_of():
    assert block_of("model.layers.3.self_attn.q_proj") == ("model.layers.3", "model.layers", 3,
                                                           "self_attn.q_proj")
    assert block_of("h.0") == ("h.0", "h", 0, "")
    assert block_of("lm_head") is None and block_of("") is None
