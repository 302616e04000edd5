"""Evaluating on rank 0 alone, as DDP scripts do (tests/workers/rank0_eval.py, 2 gloo ranks):
under dp and ZeRO-1 it works and training is unchanged; under ZeRO-3 and tp, whose forwards
need every rank of the unit, every rank raises the same clear ConfigError at that forward
(runtime/lockstep.py), never a transport error or a hang."""
import json

from conftest import torchrun


def test_rank0_only_evaluation_works_or_fails_clearly_on_every_rank(tmp_path):
    torchrun("tests/workers/rank0_eval.py", 2, "--out", str(tmp_path / "r"),
             "--savedir", str(tmp_path / "gen"), timeout=600)
    ranks = [json.loads((tmp_path / f"r.rank{r}.json").read_text()) for r in range(2)]
    alone = [r["dp_alone"]["losses"] for r in ranks]
    for plan in ("dp", "zero1"):
        for r, got in enumerate(ranks):
            assert got[plan]["error"] is None, (plan, r, got[plan]["error"])
            assert len(got[plan]["losses"]) == 4
            for a, b in zip(got[plan]["losses"], alone[r]):
                assert abs(a - b) <= 1e-6 * abs(b), (plan, r, a, b)
        assert len(ranks[0][plan]["evals"]) == 2 and not ranks[1][plan]["evals"]
    for plan in ("zero3", "tp"):
        for r, got in enumerate(ranks):
            kind, message = got[plan]["error"]
            assert kind == "ConfigError", (plan, r, kind, message)
            assert "rank 0: forward #1 in eval mode without gradients" in message, message
            assert "rank 1: forward #1 in training mode with gradients" in message, message
            assert "Evaluate on every rank and print or log on rank 0" in message, message
            assert got[plan]["losses"] == []          # at the first step, before any update
