"""Evaluating on rank 0 alone, as DDP scripts do (tests/workers/rank0_eval.py, 2 gloo ranks):
under dp and ZeRO-1 it runs as under DDP; under ZeRO-3 and tp, whose forwards need every rank
of the unit, the other ranks join rank 0's forwards while they wait at their training forward
(runtime/lockstep.py). Every run trains and evaluates as when every rank evaluates. Forwards
that no single rank runs alone are one ConfigError on every rank."""
import copy
import json

import pytest
import torch

import models
import nncompile
from conftest import torchrun
from nncompile.tools.simulate import run_ranks


def test_rank0_only_evaluation_trains_and_evaluates_as_every_rank_evaluating(tmp_path):
    torchrun("tests/workers/rank0_eval.py", 2, "--out", str(tmp_path / "r"),
             "--savedir", str(tmp_path / "gen"), timeout=600)
    ranks = [json.loads((tmp_path / f"r.rank{r}.json").read_text()) for r in range(2)]
    for plan, like in (("dp", "dp_all"), ("zero1", "dp_all"), ("zero3", "dp_all"),
                       ("tp", "tp_all")):
        for r, got in enumerate(ranks):
            assert got[plan]["error"] is None, (plan, r, got[plan]["error"])
            want = got[like]
            assert len(got[plan]["losses"]) == 4
            for a, b in zip(got[plan]["losses"] + got[plan]["evals"],
                            want["losses"] + (want["evals"] if r == 0 else [])):
                assert abs(a - b) <= 1e-6 * abs(b), (plan, r, a, b)
        assert len(ranks[0][plan]["evals"]) == 2 and not ranks[1][plan]["evals"]
    for r, got in enumerate(ranks):       # rank 0's forwards did not use up the input check
        kind, message = got["tp_skewed"]["error"]
        assert kind == "InputMismatchError" and "differs across the ranks" in message, message
        assert got["tp_skewed"]["losses"] == [], got["tp_skewed"]


def test_forwards_no_single_rank_runs_alone_are_refused_on_every_rank(tmp_path):
    """4 ranks of one tp unit: ranks 0 and 1 evaluate while 2 and 3 train."""
    model, batch = models.build("gpt"), models.batch("gpt", 0)

    def rank_fn(rank):
        pm = nncompile.parallelize(copy.deepcopy(model), batch, nncompile.ComputeConfig(4, 4),
                                   pas_policy="tp", gen_savedir=tmp_path)
        if rank < 2:
            pm.eval()
        with torch.set_grad_enabled(rank >= 2):
            with pytest.raises(nncompile.ConfigError) as e:
                pm(**batch)
        return str(e.value)
    for message in run_ranks(4, rank_fn):
        assert "rank 0: forward #1 in eval mode without gradients" in message, message
        assert "rank 3: forward #1 in training mode with gradients" in message, message
        assert "One rank may evaluate alone" in message, message
