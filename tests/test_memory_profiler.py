"""nncompile.memory: the memory profiler. The quickstart GPT compiled for one rank (plan_ngpus=1)
is profiled over 2 AdamW steps in this process: the categories, the parameter / gradient /
optimizer bytes against the tensors, the peak against a range computed here from the eager
model, the JSON file, the PNG, the predicted-vs-measured table and `python -m nncompile memory`.
Then the address-level replay on hand-made traces, and the tp plan on 2 gloo ranks (torchrun),
where the collectives' buffers show up."""
from __future__ import annotations

import dataclasses
import json
import os
import struct
import subprocess
import sys
import types
import warnings

import pytest
import torch

from conftest import ROOT

import nncompile
from nncompile import memory
from nncompile.errors import ConfigError
from nncompile.tools.memory_timeline import Alloc, _replay, comm_file

sys.path.insert(0, os.path.join(ROOT, "examples"))
from gpt import GPT  # noqa: E402

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "NNCOMPILE_QUIET": "1"}
VOCAB, BLOCK, BATCH = 16, 32, 8
MiB = 2 ** 20


def _batch():
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, VOCAB, (BATCH, BLOCK), generator=g)
    return idx, (idx + 1) % VOCAB


def _gpt():
    torch.manual_seed(0)
    return GPT(vocab_size=VOCAB, block_size=BLOCK, n_layer=2, n_head=4, n_embd=64)


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _is_png(path) -> tuple[int, int]:
    """(width, height) of a PNG file, asserting it is one."""
    data = open(path, "rb").read()
    assert len(data) > 1000 and data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The quickstart GPT at plan_ngpus=1, profiled for 2 steps; the saved profile and image."""
    tmp = tmp_path_factory.mktemp("memory")
    idx, targets = _batch()
    pm = nncompile.parallelize(_gpt(), {"idx": idx, "targets": targets},
                               nncompile.ComputeConfig(1), pas_policy="dp",
                               gen_savedir=tmp / "gen")
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)

    def step():
        pm(idx, targets).backward()
        opt.step()
        opt.zero_grad()

    prof = memory.profile(pm, step, steps=2, optimizer=opt)
    path = prof.save(tmp / "profile.json")
    png = prof.plot(tmp / "pics" / "memory.png")
    return types.SimpleNamespace(pm=pm, opt=opt, prof=prof, path=path, png=png, tmp=tmp)


def _saved_activation_bytes() -> int:
    """Bytes the eager model saves for backward on the same batch (its parameters left out)."""
    model, seen = _gpt(), {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(*_batch())
    return sum(n for ptr, n in seen.items() if ptr not in params)


def test_categories_and_persistent_bytes_match_the_tensors(run):
    (m,) = run.prof.ranks
    assert m.rank == 0 and m.device == "cpu" and run.prof.steps == 2
    for table in (m.bytes, m.at_peak, m.max_bytes):
        assert tuple(table) == memory.CATEGORIES
    assert len(m.times_ms) == len(m.events) == len(m.bytes["parameters"]) > 100
    assert [len(s) for s in m.steps_ms] == [2, 2]
    params = _nbytes(run.pm.parameters())
    state = _nbytes(v for s in run.opt.state.values() for v in s.values() if torch.is_tensor(v))
    assert state == 2 * params + 4 * len(list(run.pm.parameters()))      # AdamW: 2 + step
    counted = {"parameters": params, "gradients": params, "optimizer_state": state}
    assert m.tensors == counted
    assert {c: m.max_bytes[c] for c in counted} == counted                  # the profiler agrees
    assert memory.predicted_persistent(run.pm, run.opt) == counted
    assert m.bytes["parameters"][0] == params and m.max_bytes["communication_buffers"] == 0
    assert m.max_bytes["activations"] > 0 and m.at_peak["activations"] > 0
    assert m.bytes["gradients"][-1] == 0                  # zero_grad() set them to None
    assert m.bytes["optimizer_state"][-1] == state


def test_peak_within_the_range_computed_from_the_eager_model(run):
    (m,) = run.prof.ranks
    persistent = sum(m.tensors.values())
    saved = _saved_activation_bytes()
    # after the second backward every gradient, the state and the weights are alive at once;
    # at the end of a forward the weights and everything saved for backward are
    assert m.peak_bytes >= max(persistent, m.tensors["parameters"] + saved)
    # forward temporaries at most double what is saved; 1 MiB for the rest
    assert m.peak_bytes <= persistent + 2 * saved + MiB, (m.peak_bytes / MiB, saved / MiB)
    assert saved <= m.max_bytes["activations"] <= 2 * saved
    assert m.peak_bytes == max(sum(v) for v in zip(*m.bytes.values()))
    assert m.peak_bytes == sum(m.at_peak.values())


def test_json_round_trip_is_atomic_and_bad_files_are_refused(run, tmp_path):
    assert memory.load(run.path) == run.prof
    assert [p.name for p in run.path.parent.iterdir() if p.name.startswith(".")] == []
    d = json.loads(run.path.read_text())
    assert d["format"] == "nncompile-memory-profile" and d["version"] == 1
    cases = {"cut.json": run.path.read_text()[:500], "other.json": '{"format": "x"}',
             "list.json": "[1, 2]", "empty.json": "", "binary.json": b"\xff\xfe\x00"}
    d["ranks"][0]["bytes"].pop("gradients")
    cases["damaged.json"] = json.dumps(d)
    for name, text in cases.items():
        p = tmp_path / name
        p.write_bytes(text if isinstance(text, bytes) else text.encode())
        with pytest.raises(ConfigError, match="memory profile|not valid JSON"):
            memory.load(p)
    with pytest.raises(ConfigError, match="no memory profile at"):
        memory.load(tmp_path / "missing.json")
    with pytest.raises(ConfigError, match="it is a directory"):
        memory.load(tmp_path)


def test_png_has_one_panel_per_rank(run, tmp_path):
    w, h = _is_png(run.png)
    assert w > 600 and h > 200
    two = dataclasses.replace(run.prof, ranks=[run.prof.ranks[0],
                                               dataclasses.replace(run.prof.ranks[0], rank=1)])
    w2, h2 = _is_png(two.plot(tmp_path / "two.png", x="time"))
    assert h2 > h * 1.5                                    # a second panel below the first
    with pytest.raises(ConfigError, match="not an image format"):
        run.prof.plot(tmp_path / "memory.nope")


def test_table_puts_autodist_prediction_next_to_measured(run, tmp_path):
    (m,) = run.prof.ranks
    table = run.prof.table()
    assert "predicted: tensor shapes" in table             # no autodist estimate in plan.json
    lines = {ln.split()[0]: ln for ln in table.splitlines()[3:] if ln.strip()}
    assert set(memory.CATEGORIES) <= set(lines) and "total" in lines
    assert lines["parameters"].split()[-1] == "1.00"       # max / predicted
    ours = json.loads((run.tmp / "gen" / "GPT" / "plan.json").read_text())["memory"]
    act = ours["per_rank_bytes"]["activations"]             # counted from the compiled graph
    assert run.prof.predicted["per_rank_bytes"]["activations"] == act
    assert lines["activations"].split()[1] != "-"
    per_rank = {"parameters": m.tensors["parameters"], "gradients": m.tensors["gradients"],
                "optimizer_state": m.tensors["optimizer_state"], "activations": 2 * MiB,
                "communication_buffers": 0, "total": 4 * MiB}
    inst = tmp_path / "gen" / "GPT"
    inst.mkdir(parents=True)
    plan = json.loads((run.tmp / "gen" / "GPT" / "plan.json").read_text())
    plan["autodist"] = {"memory": {"choice": {"zero": 0}, "per_rank_bytes": per_rank}}
    (inst / "plan.json").write_text(json.dumps(plan))
    replaced = {**per_rank, "activations": act, "total": 4 * MiB - 2 * MiB + act}
    for where in (tmp_path / "gen", inst, inst / "plan.json", plan, plan["autodist"]):
        got = memory.load_predicted(where)          # the compiled graph's activations
        assert got["per_rank_bytes"] == (per_rank if where is plan["autodist"] else replaced), \
            where
    table = dataclasses.replace(run.prof, predicted=memory.load_predicted(inst)).table()
    assert f"predicted: autodist ({inst / 'plan.json'})" in table
    total = next(ln for ln in table.splitlines() if ln.startswith("total / peak"))
    want = replaced["total"]
    assert memory._fmt(want) in total and f"{m.peak_bytes / want:.2f}" in total
    assert memory.load_predicted({"policy": "tp", "autodist": None}) is None
    assert "predicted: none" in dataclasses.replace(run.prof, predicted=None).table()
    (tmp_path / "gen" / "Other").mkdir()
    (tmp_path / "gen" / "Other" / "plan.json").write_text("{}")
    with pytest.raises(ConfigError, match="holds 2 instances"):
        memory.load_predicted(tmp_path / "gen")


def test_cli_prints_the_table_and_draws_the_timeline(run, tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(run.path.read_text()[:-200])
    out = tmp_path / "cli.png"
    proc = subprocess.run([sys.executable, "-m", "nncompile", "memory", str(run.path), "-o",
                           str(out), "--x", "time"], cwd=ROOT, env=ENV, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "rank 0 (cpu): peak" in proc.stdout and "communication_buffers" in proc.stdout
    assert f"wrote {out}" in proc.stdout
    _is_png(out)
    from nncompile.__main__ import main
    assert main(["memory", str(bad), "-o", str(tmp_path / "no.png")]) == 2
    err = capsys.readouterr().err
    assert "nncompile memory:" in err and "not valid JSON" in err and "profile again" in err
    assert not (tmp_path / "no.png").exists()
    assert main(["memory", str(tmp_path / "none.json")]) == 2
    assert "nncompile memory: no memory profile at" in capsys.readouterr().err
    assert main(["memory", str(run.path), "--predicted", str(tmp_path)]) == 2
    assert "no plan.json at" in capsys.readouterr().err


def test_comm_files_are_matched_by_module_path():
    import nncompile.runtime.program.comm as comm
    program = os.path.dirname(comm.__file__)
    runtime = os.path.dirname(program)
    assert comm_file(os.path.join(program, "comm.py")) == "comm.py"
    assert comm_file(os.path.join(runtime, "store", "zero.py")) == "zero.py"
    assert comm_file("/venv/site-packages/nncompile/runtime/program/reducer.py") == "reducer.py"
    assert comm_file(os.path.join(ROOT, "runtime", "program", "comm.py")) == "comm.py"  # checkout
    assert comm_file(os.path.join(program, "module.py")) == ""
    assert comm_file(os.path.join(runtime, "program", "zero.py")) == ""     # not its package
    assert comm_file("/elsewhere/comm.py") == ""


def test_replay_ends_buffers_whose_free_was_not_traced():
    """The profiler misses frees made on the gloo worker thread: an address used again ends its
    old allocation, and a runtime/program/comm.py buffer ends when its function returned."""
    other = lambda who, version: "other"      # noqa: E731
    raw = [Alloc(10, 0xA, 100, None, None, comm=True, until=20),   # comm.py local, no free
           Alloc(12, 0xB, 50, None, None),                           # free seen at 30
           Alloc(14, 0xC, 30, None, None, comm=True),                # reducer.py: no end
           Alloc(30, 0xB, -50, None, None),
           Alloc(40, 0xD, 7, None, None),                            # reused at 50, no free
           Alloc(50, 0xD, 9, None, None),
           Alloc(60, 0xE, 8, None, None)]                            # the optimizer keeps it
    events = _replay(raw, [], other, {0xE: "optimizer_state"})
    live: dict[str, int] = {}
    curve = []
    for t, cat, delta in events:
        live[cat] = live.get(cat, 0) + delta
        curve.append((t, dict(live)))
    assert live == {"communication_buffers": 30, "other": 9, "optimizer_state": 8}
    at = dict(curve)
    assert at[14]["communication_buffers"] == 130 and at[20]["communication_buffers"] == 30
    assert at[50]["other"] == 9


def test_without_torch_categories_allocations_are_still_counted(monkeypatch):
    """A plain module works too; when PyTorch's memory profiler fails every allocation counts,
    as other (or activations, inside the module's forward file)."""
    import nncompile.tools.memory_timeline as mt

    def broken(*a, **k):
        raise AssertionError("simulated")
    monkeypatch.setattr(torch.profiler.profile, "_memory_profile", broken)
    monkeypatch.setattr(mt, "_relaxed_memory_profile", broken)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    x = torch.randn(16, 32)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step():
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prof = memory.profile(model, step, steps=2, optimizer=opt, predicted=False)
    assert any("memory profiler failed" in str(w.message) for w in caught)
    (m,) = prof.ranks
    assert m.source == "torch.profiler allocations (by address and frames only)"
    params = _nbytes(model.parameters())
    assert m.tensors == {"parameters": params, "gradients": params, "optimizer_state": params}
    assert m.bytes["optimizer_state"][-1] == params          # momentum buffers, by address
    assert m.peak_bytes >= params and "predicted: none" in prof.table()


def test_two_ranks_tp_show_communication_buffers(run_ranks, tmp_path):
    out = tmp_path / "tp.json"
    text = run_ranks("tests/workers/memory_profile.py", 2, "--savedir", str(tmp_path / "gen"),
                     "--out", str(out))
    prof = memory.load(out)
    assert [m.rank for m in prof.ranks] == [0, 1] and prof.plan_ngpus == 2
    assert "rank 1 (cpu): peak" in text and prof.steps == 1
    for m in prof.ranks:
        assert m.max_bytes["communication_buffers"] > 0, m.max_bytes
        assert m.max_bytes["parameters"] == m.tensors["parameters"]
        assert m.max_bytes["optimizer_state"] == m.tensors["optimizer_state"]
        assert m.max_bytes["activations"] > 0
        assert m.bytes["communication_buffers"][-1] <= 64 * 1024      # ended, not leaked
    _, h = _is_png(prof.plot(tmp_path / "tp.png"))
    assert h > 400


def test_offload_copies_are_on_the_timeline(tmp_path):
    """ZeRO-3 with offload_params (one rank; on a CPU host and device are one memory, the copies
    still run): every unit's copies are spans of the profile, saved, loaded and drawn."""
    idx, targets = _batch()
    pm = nncompile.parallelize(_gpt(), {"idx": idx, "targets": targets},
                               nncompile.ComputeConfig(1, 1, use_zero=3, offload_params=True),
                               pas_policy="dp", gen_savedir=tmp_path / "gen")
    opt = nncompile.build_optimizer(pm, torch.optim.AdamW, lr=1e-2)

    def step():
        pm(idx, targets).backward()
        opt.step()
        opt.zero_grad()

    prof = memory.profile(pm, step, steps=2, optimizer=opt)
    copies = prof.ranks[0].copies_ms
    names = [name for _, _, name in copies]
    units = [u.path for u in pm.zero.units]
    for unit in units:                       # per step: to the device in forward, back once
        assert names.count(f"to_host {unit}") == 2, (unit, names)
        assert names.count(f"to_device {unit}") >= 2, (unit, names)
    assert all(a <= b for a, b, _ in copies)
    steps = prof.ranks[0].steps_ms
    assert all(steps[0][0] <= a and b <= steps[-1][1] for a, b, _ in copies)
    again = memory.load(prof.save(tmp_path / "offload.json"))
    assert again.ranks[0].copies_ms == copies
    w, _ = _is_png(again.plot(tmp_path / "offload.png"))
    assert w > 600
