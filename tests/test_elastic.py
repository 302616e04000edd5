"""Elastic restart (docs/operations.md): under torchrun --max-restarts=1, rank 1 killed with
SIGKILL before step 4 restarts the job; every rank resumes from nncompile.latest_checkpoint
and the job finishes by itself with the weights of an uninterrupted run (tests/workers/
elastic.py: tp 2, the tests' GPT, AdamW, a sharded checkpoint after each step)."""
import json

import torch

from conftest import torchrun

import nncompile


def test_a_killed_rank_restarts_the_job_which_ends_like_an_uninterrupted_run(tmp_path):
    plain, killed = tmp_path / "plain", tmp_path / "killed"
    plain.mkdir()
    killed.mkdir()
    torchrun("tests/workers/elastic.py", 2, str(plain), timeout=300)
    torchrun("tests/workers/elastic.py", 2, str(killed), "--kill-at", "4", timeout=300,
             launcher=("--max-restarts=1",))
    attempts = [json.loads(line) for line in (killed / "attempts.jsonl").read_text().splitlines()]
    assert attempts == [{"attempt": 0, "resumed_at": 0}, {"attempt": 1, "resumed_at": 4}]
    want = torch.load(plain / "final.pt", weights_only=True)
    got = torch.load(killed / "final.pt", weights_only=True)
    assert want.keys() == got.keys() and len(want) > 0
    assert all(torch.equal(want[k], got[k]) for k in want)
    assert nncompile.latest_checkpoint(killed / "ckpt").name == "step_6"
