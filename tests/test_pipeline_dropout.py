"""Dropout and inference under a pipeline, one process: each rank's file lists every stage's
random draws, and `rng.replay` of a stage's list leaves the generator exactly where that
stage's forward leaves it (so a rank can start each (micro-batch, stage) forward from one
device's state). The multi-rank parity (1F1B, interleaved, with tp inside the stages; losses
and validation against one device) runs in tests/workers/pipeline.py."""
import copy
import os
import sys

import pytest
import torch

import nncompile
from nncompile import ComputeConfig, ConfigError, PipelineError
from nncompile.runtime.program.loader import load_rank_module
from nncompile.runtime.program import rng

sys.path.insert(0, os.path.dirname(__file__))
import models  # noqa: E402

M = 4


def _batch():
    g = torch.Generator().manual_seed(0)
    return {"input_ids": torch.randint(0, 64, (8, 16), generator=g),
            "labels": torch.randint(0, 64, (8, 16), generator=g)}


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    torch.manual_seed(0)
    model = models.hf_gpt2(n_layer=4, pdrop=0.3).train()
    out = nncompile.parallelize(
        model, _batch(), ComputeConfig(2, 2, parallel={"pp": 2,
                                                         "microbatches": M}),
        pas_policy="tp", gen_savedir=tmp_path_factory.mktemp("pp"), load_module=False,
        instance_name="gpt2_dropout")
    return model, out


def _inputs(metas):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(shape, generator=g) if dtype.startswith("float") else
            torch.randint(0, 64, shape, generator=g) for shape, dtype, _ in metas]


@pytest.mark.parametrize("rank", [0, 1])
def test_replay_ends_where_the_stage_forward_ends(compiled, rank):
    model, out = compiled
    pm = load_rank_module(out, rank, copy.deepcopy(model))     # one model per rank, as processes
    draws = pm.PIPELINE["draws"]
    assert sorted(draws) == [0, 1]
    kinds = {d[0] for d in draws[rank]}
    assert kinds == {"dropout", "sdpa"}, kinds          # residual/embedding and attention
    (stage, _, _, metas, _, _), = pm.STAGES
    args = _inputs(metas)
    torch.manual_seed(5)
    getattr(pm, f"stage_{stage}")(*args)
    after_forward = torch.get_rng_state()
    torch.manual_seed(5)
    rng.replay(draws[stage], pm.device)
    assert torch.equal(torch.get_rng_state(), after_forward)
    torch.manual_seed(5)                 # and the draws are not empty: the state moves
    assert not torch.equal(torch.get_rng_state(), after_forward)


def test_plan_without_random_ops_lists_no_draws(tmp_path):
    torch.manual_seed(0)
    model = models.hf_gpt2(n_layer=4, pdrop=0.0)
    out = nncompile.parallelize(
        model, _batch(), ComputeConfig(2, 2, parallel={"pp": 2,
                                                         "microbatches": M}),
        pas_policy="tp", gen_savedir=tmp_path, load_module=False, instance_name="nodrop")
    assert "'draws'" not in (out / "gencode0.py").read_text()


def test_inference_forward_needs_the_process_group(compiled):
    model, out = compiled
    pm = load_rank_module(out, 0, copy.deepcopy(model))
    with pytest.raises(PipelineError, match=r"pm.train_step\(\*args, \*\*kwargs\).*"
                                            r"torch.no_grad\(\) or after pm.eval\(\)"):
        pm(**_batch())
    with torch.no_grad(), pytest.raises(ConfigError, match="init_process_group"):
        pm(**_batch())


def test_eval_mode_refused_where_the_eval_forward_differs(tmp_path):
    """A branch on self.training: the stages hold the training forward only, so eval mode is
    a PipelineError naming the way out (training mode under no_grad still runs)."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
    from gpt import GPT

    class Branchy(GPT):
        def forward(self, idx, targets):
            loss = super().forward(idx, targets)
            return loss * 2 if self.training else loss

    torch.manual_seed(0)
    model = Branchy(n_layer=4)
    g = torch.Generator().manual_seed(0)
    batch = {"idx": torch.randint(0, 64, (8, 16), generator=g),
             "targets": torch.randint(0, 64, (8, 16), generator=g)}
    out = nncompile.parallelize(
        model, batch, ComputeConfig(2, 2, parallel={"pp": 2, "microbatches": M}),
        pas_policy="tp", gen_savedir=tmp_path, load_module=False, instance_name="branchy")
    pm = load_rank_module(out, 0, model)
    pm.eval()
    with pytest.raises(PipelineError, match="differs in eval mode.*plan without "
                                            "a pipeline"):
        pm(**batch)
