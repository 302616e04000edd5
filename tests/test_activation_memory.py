"""Predicted activation bytes (nncompile/tools/activation_memory.py) against measurement.

The prediction is written to plan.json when the code is generated, before anything runs: it
comes from the compiled per-rank graph on fake tensors. It is checked against what a real
forward of the generated program saves for backward (saved_tensors_hooks, each storage once),
under dp, tp on 2 simulated ranks and recompute, for the GPT of tests/models.py and a Hugging
Face Llama large enough that activations dominate; and against nncompile.memory.profile's
measured activations (their largest moment), which the table's predicted column now shows.
"""
from __future__ import annotations

import copy
import json

import pytest
import torch
from torch.distributed.tensor import DTensor

import models
import nncompile
from nncompile import ComputeConfig
from nncompile.tools import activation_memory, memory
from nncompile.tools.simulate import run_ranks

TOL = 0.02          # saved bytes: the prediction runs the same ops (measured: exact)
PEAK_TOL = 0.10     # the profiler's largest activations also hold forward temporaries
RECOMPUTE = {"gpt": "Block", "hf_llama": "LlamaDecoderLayer"}


def _model(name: str):
    torch.manual_seed(0)
    if name == "gpt":
        return models.GPT(vocab_size=64, block_size=256, n_layer=2, n_head=4, n_embd=128).train()
    return models.hf_llama(vocab=256, hidden=128, inter=256, n_layer=2, n_head=4, n_kv=2,
                           max_pos=256).train()


def _batch(name: str):
    return models.batch(name, 0, batch_size=4, seq=256)


def saved_bytes(fn, held) -> tuple[int, object]:
    """What autograd saves while fn() runs: each storage once (by address), leaving out the
    storages of `held` (parameters, buffers, the batch)."""
    skip = {t.untyped_storage().data_ptr() for t in held}
    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in skip:
            seen.setdefault(s.data_ptr(), s.nbytes())
        return t                        # autograd keeps it: addresses stay unique
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(seen.values()), out


def _held(m, batch):
    params = [p.to_local() if isinstance(p, DTensor) else p for p in m.parameters()]
    return params + list(m.buffers()) + list(batch.values())


def _compile(model, batch, tmp_path, inst, n=1, recompute=None, **kw):
    cfg = ComputeConfig(n, n, parallel={"recompute_modules": [recompute]} if recompute
                        else {}, **kw)
    return nncompile.parallelize(model, batch, cfg, pas_policy="tp" if n > 1 else "dp",
                                 gen_savedir=tmp_path, instance_name=inst)


def _plan_memory(tmp_path, inst) -> dict:
    return json.loads((tmp_path / inst / "plan.json").read_text())["memory"]


@pytest.mark.parametrize("name", ["gpt", "hf_llama"])
@pytest.mark.parametrize("plan", ["dp", "tp2", "recompute"])
def test_predicted_equals_what_the_generated_forward_saves(name, plan, tmp_path):
    model, batch = _model(name), _batch(name)
    n = 2 if plan == "tp2" else 1
    rc = RECOMPUTE[name] if plan == "recompute" else None

    def rank_fn(rank):
        pm = _compile(copy.deepcopy(model), batch, tmp_path, "m", n, rc)
        pred = _plan_memory(tmp_path, "m")              # written before anything ran
        got, loss = saved_bytes(lambda: pm(**batch), _held(pm, batch))
        loss.backward()
        return pred, got
    out = run_ranks(n, rank_fn) if n > 1 else [rank_fn(0)]
    eager, _ = saved_bytes(lambda: model(**batch), _held(model, batch))
    for pred, got in out:
        act = pred["activations"]
        assert not act["unknown_ops"]
        assert act["saved_bytes"] == pytest.approx(got, rel=TOL), (act["saved_bytes"], got)
        assert pred["per_rank_bytes"]["activations"] == act["peak_bytes"]
        if plan == "dp":               # the generated program saves what the model saves
            assert got == pytest.approx(eager, rel=0.05)
            assert act["rerun_bytes"] == 0 and act["peak_bytes"] == act["saved_bytes"]
        elif plan == "tp2":            # a shard of the split layers' activations
            assert got < 0.8 * eager
        else:                          # recompute: block inputs only, rerun one at a time
            assert act["saved_bytes"] < 0.25 * eager
            assert act["saved_bytes"] < act["rerun_bytes"] < eager


@pytest.mark.parametrize("n", [1, 2])
def test_dropout_in_training_mode(n, tmp_path):
    """Dropout and attention dropout (a mode argument: dropout_p 0.1 in training) save their
    noise; on 2 ranks the runtime's split draws (runtime/program/rng.py) save a full-size noise."""
    torch.manual_seed(0)
    model = models.hf_gpt2(vocab=64, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                           pdrop=0.1).train()
    batch = models.batch("hf_gpt2", 0, batch_size=4, seq=64)

    def rank_fn(rank):
        pm = _compile(copy.deepcopy(model), batch, tmp_path, "d", n)
        pred = _plan_memory(tmp_path, "d")["activations"]["saved_bytes"]
        return pred, saved_bytes(lambda: pm(**batch), _held(pm, batch))[0]
    for pred, got in (run_ranks(n, rank_fn) if n > 1 else [rank_fn(0)]):
        assert pred == pytest.approx(got, rel=TOL), (pred, got)


@pytest.mark.parametrize("name,plan", [("gpt", "dp"), ("hf_llama", "dp"),
                                       ("gpt", "recompute"), ("hf_llama", "recompute"),
                                       ("gpt", "zero3")])
def test_profile_shows_predicted_activations_near_the_measured_peak(name, plan, tmp_path):
    model, batch = _model(name), _batch(name)
    pm = _compile(model, batch, tmp_path, "m", 1, RECOMPUTE[name] if plan == "recompute"
                  else None, use_zero=3 if plan == "zero3" else 0)
    predicted = _plan_memory(tmp_path, "m")["per_rank_bytes"]["activations"]
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)

    def step():
        pm(**batch).backward()
        opt.step()
        opt.zero_grad()
    prof = memory.profile(pm, step, steps=2, optimizer=opt)
    (m,) = prof.ranks
    assert prof.predicted["per_rank_bytes"]["activations"] == predicted
    assert "activations: the compiled graph's saved tensors" in prof.predicted["source"]
    assert m.max_bytes["activations"] == pytest.approx(predicted, rel=PEAK_TOL), \
        (m.max_bytes["activations"], predicted)
    row = next(ln for ln in prof.table().splitlines() if ln.startswith("activations"))
    assert row.split()[1] != "-" and float(row.split()[-1]) == pytest.approx(1.0, abs=PEAK_TOL)


def test_predict_runs_on_the_graph_alone(tmp_path):
    """The same number from the compiled graph alone (no model, no batch): nothing measured;
    per op, what each newly saves adds up to it."""
    from nncompile.api import compile_module
    compiled = compile_module(_model("gpt"), _batch("gpt"), ComputeConfig(2, 2),
                              pas_policy="tp", outdir=tmp_path / "g", reuse="override")
    a = activation_memory.predict(compiled.final)
    assert a.bytes == _plan_memory(tmp_path, "g")["activations"]["saved_bytes"] > 0
    assert a.per_op and sum(b for _, _, b in a.per_op) == a.bytes
    assert max(b for _, _, b in a.per_op) >= a.largest > 0


def test_plan_memory_replaces_autodist_activations():
    per_rank = {"parameters": 10, "gradients": 10, "optimizer_state": 20, "activations": 50,
                "communication_buffers": 0, "total": 90}
    plan = {"policy": "autodist", "autodist": {"memory": {"per_rank_bytes": dict(per_rank)}},
            "memory": {"source": "graph", "per_rank_bytes": {"activations": 30}}}
    got = memory.load_predicted(plan)
    assert got["per_rank_bytes"] == {**per_rank, "activations": 30, "total": 70}
    assert got["source"] == "autodist; activations: graph"
    assert memory.load_predicted({**plan, "autodist": None}) == {
        "source": "graph", "per_rank_bytes": {"activations": 30}}
    assert memory.load_predicted(plan["autodist"])["per_rank_bytes"] == per_rank
    assert memory.load_predicted({"policy": "dp", "autodist": None}) is None
