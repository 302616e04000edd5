"""Evaluating on rank 0 alone, as DDP scripts do (tests/workers/rank0_eval.py, 2 gloo ranks):
under dp and ZeRO-1 it runs as under DDP; under ZeRO-3 and tp, whose forwards need every rank
of the unit, the other ranks join rank 0's forwards while they wait at their training forward,
or, after the last step, at gather_params, save_checkpoint, nncompile.finish() or the end of
the program (runtime/protocol/lockstep.py). Every run trains and evaluates as when every rank
evaluates. Forwards that no single rank runs alone, and ranks at different calls, are one
ConfigError on every rank; a peer that left is a ConfigError on the ranks still there."""
import copy
import json
import os
import subprocess
import time
import sys

import pytest
import torch

import models
import nncompile
from conftest import ROOT, torchrun
from rank_launch import free_port
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
    for plan in ("zero3", "tp"):         # evaluating after the last step, alone or not
        for r, got in enumerate(ranks):
            alone, every = got[f"{plan}_end"], got[f"{plan}_end_all"]
            assert alone["error"] is None and every["error"] is None, (plan, r, alone, every)
            assert alone["losses"] == every["losses"] and alone["weights"] == every["weights"]
            assert alone["evals"] == (every["evals"] if r == 0 else []), (plan, r)
            assert len(every["evals"]) == 2
    # rank 0 evaluated a fresh tp module while rank 1 was in nncompile.finish(): the losses
    # a fresh module gives (the tp_all run's first evaluation is of batch 100 before training)
    finished = json.loads((tmp_path / "r.finish.json").read_text())["evals"]
    assert finished[0] == ranks[0]["tp_all"]["evals"][0], finished


def test_rank0_evaluating_while_the_others_leave(tmp_path):
    """ZeRO-3 on 2 ranks, rank 0 evaluating after the last step: while rank 1 returns from the
    function holding the module and ends the program (nncompile.finish(), then torch's
    destroy_process_group), it serves rank 0's forwards in finish() with the module it last
    ran (the values of every rank evaluating); while it destroys the group without finish(),
    or leaves at once (as a crash), rank 0 gets a ConfigError that says so."""
    ends = {}
    for how in ("exit", "bare", "gone"):
        torchrun("tests/workers/rank0_eval.py", 2, "--out", str(tmp_path / "ref"),
                 "--savedir", str(tmp_path / "gen"), "--end", how, timeout=300)
        ends[how] = json.loads((tmp_path / f"ref.{how}.json").read_text())
    exited = ends["exit"]
    assert "error" not in exited and len(exited["evals"]) == 2, exited
    for how in ("bare", "gone"):
        assert ends[how]["losses"] == exited["losses"], (how, ends[how])
        kind, message = ends[how]["error"]
        assert kind == "ConfigError", (how, ends[how])
        assert "rank 0 was at forward #3 and its group [0, 1]" in message, message
        assert "stopped answering" in message and "Another rank of it left" in message, message
        assert "nncompile.finish()" in message, message


def test_ranks_at_different_calls_are_refused_on_every_rank(tmp_path):
    """tp on 2 ranks: gather_params against save_checkpoint, and a training forward while the
    other rank waits at gather_params, are ConfigErrors on both ranks naming what each did."""
    model, batch = models.build("gpt"), models.batch("gpt", 0)

    def rank_fn(rank, case):
        pm = nncompile.parallelize(copy.deepcopy(model), batch, nncompile.ComputeConfig(2, 2),
                                   pas_policy="tp", gen_savedir=tmp_path)
        with pytest.raises(nncompile.ConfigError) as e:
            if case == "points":
                pm.gather_params() if rank == 0 else \
                    nncompile.save_checkpoint(tmp_path / "ckpt", pm)
            else:
                pm(**batch) if rank == 0 else pm.gather_params()
        return str(e.value)
    for message in run_ranks(2, lambda rank: rank_fn(rank, "points")):
        assert "rank 0: waiting at pm.gather_params()" in message, message
        assert "rank 1: waiting at nncompile.save_checkpoint" in message, message
    for message in run_ranks(2, lambda rank: rank_fn(rank, "train")):
        assert "rank 0: forward #1 in training mode with gradients" in message, message
        assert "rank 1: waiting at pm.gather_params()" in message, message
        assert "nor train while the others wait" in message, message


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


def test_a_copy_evaluated_alone_is_served_with_the_copy(tmp_path):
    """tp on 2 ranks: after a step, `ema = copy.deepcopy(pm)`, then another step of pm. Rank 0
    alone evaluates the copy while rank 1 waits at pm.gather_params(): rank 1 joins with the
    copy's pieces (its own lockstep number), so the loss equals every rank evaluating the
    copy, and differs from the trained module's."""
    model, batch = models.build("gpt"), models.batch("gpt", 0)
    probe = models.batch("gpt", 7)

    def rank_fn(rank, alone):
        pm = nncompile.parallelize(copy.deepcopy(model), batch, nncompile.ComputeConfig(2, 2),
                                   pas_policy="tp", gen_savedir=tmp_path)
        opt = torch.optim.SGD(pm.parameters(), lr=0.5)
        for step in range(2):
            pm(**models.batch("gpt", step)).backward()
            opt.step()
            opt.zero_grad()
            if step == 0:
                ema = copy.deepcopy(pm)
        ema.eval()
        out = {}
        if rank == 0 or not alone:
            with torch.no_grad():
                out["ema"] = ema(**probe).item()
        pm.gather_params()
        pm.eval()
        with torch.no_grad():
            out["pm"] = pm(**probe).item()
        return out
    alone, every = run_ranks(2, lambda r: rank_fn(r, True)), run_ranks(2, lambda r: rank_fn(r, False))
    assert alone[0]["ema"] == every[0]["ema"] == every[1]["ema"], (alone, every)
    assert abs(alone[0]["ema"] - alone[0]["pm"]) > 1e-4, (alone, every)
    assert "ema" not in alone[1] and alone[1]["pm"] == every[1]["pm"]


@pytest.mark.parametrize("plan,call,world", [("tp", "barrier", 2), ("zero3", "all_reduce", 2),
                                             ("tp_zero3", "broadcast", 4)])
def test_a_lone_forward_against_a_torch_collective_is_one_clear_error(tmp_path, plan, call,
                                                                       world):
    """Rank 0 evaluates alone after the last step while the others are in a torch.distributed
    call of the script's own (tests/workers/lone_collectives.py): each waits for the other, so
    rank 0 raises nncompile's ConfigError at once naming every other rank's call and script
    line, not the transport's timeout (60 s here); torchrun then stops the others. Under
    torchrun itself, whose agent keeps the store the watches answer through."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}",
           f"--master_port={free_port()}", "tests/workers/lone_collectives.py", "--plan", plan,
           "--call", call, "--savedir", str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NNCOMPILE_QUIET": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    error = next((line for line in out.splitlines()
                  if "ConfigError: rank 0 is at forward #3" in line), None)
    assert error is not None, out[-3000:]
    code = {"barrier": "dist.barrier()", "all_reduce": "dist.all_reduce(logged)",
            "broadcast": "dist.broadcast(flag, src=0)"}[call]
    for r in range(1, world):
        assert f"rank {r}: {call}" in error, error
    assert f"`{code}`" in error and "script lone_collectives.py:" in error, error
    assert "waits for rank 0 in turn" in error and "nncompile.finish()" in error, error
    assert "rank 0 evaluated alone" not in out and "passed the" not in out, out[-3000:]
    assert "Timed out waiting" not in out and "stopped answering" not in out, out[-3000:]


@pytest.mark.parametrize("plan,world", [("zero1", 2), ("tp_zero1", 4)])
def test_the_zero12_optimizer_state_gathered_alone_is_one_clear_error(tmp_path, plan, world):
    """Under ZeRO-1/2 forwards exchange nothing, so the data-parallel replicas cannot serve
    `full_optimizer_state_dict` called by rank 0 alone (the optimizer state is spread over
    them): while they wait in the next step's gradient reduction for rank 0, rank 0 raises
    the ConfigError that says to call it on every rank, naming where each waits, within
    seconds (not the transport's 60 s), and the job ends (tests/workers/lone_collectives.py)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}",
           f"--master_port={free_port()}", "tests/workers/lone_collectives.py", "--plan", plan,
           "--call", "full_optimizer_state_dict", "--savedir", str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NNCOMPILE_QUIET": "1"}
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    took = time.monotonic() - start
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    error = next((line for line in out.splitlines() if "ConfigError: rank 0 called "
                  "nncompile.full_optimizer_state_dict and waits" in line), None)
    assert error is not None, out[-3000:]
    others = [r for r in range(1, world) if f"rank {r}: " in error]
    assert others, error                 # (a replica waits on rank 0; a unit peer may not)
    assert "call it on every rank" in error and "reducer" in error, error
    assert "gathered the optimizer state alone" not in out and "passed the" not in out, out
    assert "Timed out waiting" not in out and took < 50, (took, out[-3000:])  # timeout 60 s
