"""Mistakes that used to fail late, raw or silently, each now a clear error or warning (or the
right result): a checkpoint path that cannot be created (every rank fails at once, nothing
written), a `sharded` checkpoint's optimizer state loaded under another ZeRO layout, a tensor
input whose dim 0 only happens to equal the batch under micro-batches, and tp_sp on a dynamic
sequence that is not a declared multiple of the plan. One process; ranks are threads
(nncompile.tools.simulate.run_ranks)."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import models
import nncompile
from nncompile.tools.simulate import run_ranks


# ---- a checkpoint path that cannot be created ----------------------------------------------
@pytest.fixture(scope="module")
def blocked(tmp_path_factory):
    """A directory holding a regular file `afile`, and an MLP to compile on 2 ranks."""
    d = tmp_path_factory.mktemp("blocked")
    (d / "afile").write_text("not a directory\n")
    (d / "gen").mkdir()
    return d, models.build("mlp"), models.batch("mlp", 0)


def _save_on_two_ranks(d, model, batch, path, fmt):
    """Every rank saves to `path`; returns each rank's (error type, message)."""
    def rank_fn(rank):
        pm = nncompile.parallelize(copy.deepcopy(model), batch, nncompile.ComputeConfig(2),
                                   pas_policy="tp", gen_savedir=d / "gen")
        opt = nncompile.build_optimizer(pm, torch.optim.AdamW, lr=1e-3)
        pm(**batch).backward()
        opt.step()
        try:
            nncompile.save_checkpoint(path, pm, opt, format=fmt)
        except Exception as e:      # noqa: BLE001 - returned so every rank's error is seen
            return type(e).__name__, str(e)
        return None
    # a rank still waiting after 60 s is the bug: run_ranks raises RankFailed ("did not finish")
    return run_ranks(2, rank_fn, timeout_s=60)


@pytest.mark.parametrize("fmt", ["sharded", "deduped", "dcp"])
def test_uncreatable_checkpoint_path_fails_every_rank_at_once(blocked, fmt):
    d, model, batch = blocked
    before = sorted(p.name for p in d.iterdir())
    for path, why in [(d / "afile" / "ck", "is a file, not a directory"),
                      (d / "afile", "exists and is not a directory")]:
        errors = _save_on_two_ranks(d, model, batch, path, fmt)
        for rank, err in enumerate(errors):
            assert err is not None, f"rank {rank} saved into {path}"
            kind, msg = err
            assert kind == "CheckpointError", (rank, err)
            assert f"cannot save a checkpoint to {path}" in msg and why in msg, (rank, msg)
            assert "rank 0:" in msg, msg            # which rank found it
        assert errors[0] == errors[1]
    assert sorted(p.name for p in d.iterdir()) == before      # no partial directory left
    assert (d / "afile").read_text() == "not a directory\n"


def test_a_write_failing_on_one_rank_fails_every_rank_and_keeps_the_last_checkpoint(
        blocked, monkeypatch):
    from nncompile.runtime.checkpoints import checkpoint as ck
    d, model, batch = blocked
    path = d / "ck_full"
    assert _save_on_two_ranks(d, model, batch, path, "sharded") == [None, None]
    meta = (path / "checkpoint.json").read_text()
    files = sorted(p.name for p in path.iterdir())
    save = ck.save_torch

    def disk_full_on_rank_1(obj, where):
        if torch.distributed.get_rank() == 1:
            raise OSError(28, "No space left on device", str(where))
        save(obj, where)
    monkeypatch.setattr(ck, "save_torch", disk_full_on_rank_1)
    errors = _save_on_two_ranks(d, model, batch, path, "sharded")
    for kind, msg in errors:
        assert kind == "CheckpointError", msg
        assert f"saving the checkpoint {path} failed: rank 1: OSError" in msg, msg
        assert "No space left on device" in msg, msg
    assert (path / "checkpoint.json").read_text() == meta           # the last one, untouched
    assert sorted(p.name for p in path.iterdir()) == files
    assert not (d / ".ck_full.partial").exists()


def test_uncreatable_merged_output_is_a_checkpoint_error(tmp_path):
    pm = nncompile.parallelize(models.build("mlp"), models.batch("mlp", 0),
                               nncompile.ComputeConfig(1), pas_policy="dp",
                               gen_savedir=tmp_path / "gen")
    ck = nncompile.save_checkpoint(tmp_path / "ck", pm)
    (tmp_path / "afile").write_text("x")
    with pytest.raises(nncompile.CheckpointError, match="afile is a file, not a directory"):
        nncompile.merge_checkpoint([ck], tmp_path / "afile" / "merged.pt")
    with pytest.raises(nncompile.CheckpointError, match="is a directory; pass a file path"):
        nncompile.merge_checkpoint([ck], ck)
    one = tmp_path / "one"
    with pytest.raises(nncompile.CheckpointError, match="exists and is not a directory"):
        nncompile.save_checkpoint(tmp_path / "afile", pm)
    assert not one.exists() and (tmp_path / "afile").read_text() == "x"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "ck", "gen"]


# ---- a sharded checkpoint's optimizer state under another ZeRO layout -----------------------
def _gpt(tmp_path, name, zero):
    return nncompile.parallelize(models.build("gpt"), models.batch("gpt", 0),
                                 nncompile.ComputeConfig(1, 1, use_zero=zero), pas_policy="dp",
                                 gen_savedir=tmp_path, instance_name=name)


def _trained(pm):
    opt = nncompile.build_optimizer(pm, torch.optim.AdamW, lr=1e-2)
    pm(**models.batch("gpt", 0)).backward()
    opt.step()
    return opt


@pytest.mark.parametrize("saved_zero, loaded_zero", [(3, 0), (0, 3), (1, 0)])
def test_sharded_optimizer_state_under_another_zero_stage_is_refused(tmp_path, saved_zero,
                                                                     loaded_zero):
    src = _gpt(tmp_path, "src", saved_zero)
    ck = nncompile.save_checkpoint(tmp_path / "ck", src, _trained(src), format="sharded")
    pm = _gpt(tmp_path, "dst", loaded_zero)
    opt = _trained(pm)
    before = {k: v.clone() for k, v in pm.local_state_dict().items() if torch.is_tensor(v)}
    with pytest.raises(nncompile.CheckpointError) as e:
        nncompile.load_checkpoint(ck, pm, opt)
    msg = str(e.value)
    assert "sharded format is tied to its ZeRO layout" in msg, msg
    assert ("ZeRO-3" in msg) == (3 in (saved_zero, loaded_zero)), msg
    assert "format='deduped' or format='dcp'" in msg and "nncompile merge" in msg, msg
    after = pm.local_state_dict()
    assert all(torch.equal(v, after[k]) for k, v in before.items())    # nothing loaded
    # the model weights alone load across ZeRO stages, equal to the saved ones
    nncompile.load_checkpoint(ck, pm)
    want = {k: v for k, v in src.local_state_dict().items() if torch.is_tensor(v)}
    got = pm.local_state_dict()
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=0, atol=0, msg=k)


# ---- tp_sp on a dynamic sequence that is not a declared multiple of the plan ----------------
@pytest.mark.parametrize("multiple_of", [1, 2])
def test_tp_sp_says_when_a_dynamic_sequence_turns_sequence_parallelism_off(tmp_path,
                                                                           multiple_of):
    seq = {"name": "seq", "max": 16, "multiple_of": multiple_of}
    dims = {k: {0: "batch", 1: seq} for k in ("idx", "targets")}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = nncompile.parallelize(models.build("gpt"), models.batch("gpt", 0),
                                    nncompile.ComputeConfig(2, 2), pas_policy="tp_sp",
                                    gen_savedir=tmp_path, load_module=False,
                                    dynamic_dims=dims)
    said = [str(w.message) for w in caught if "sequence parallelism" in str(w.message)]
    code = (out / "gencode0.py").read_text()
    if multiple_of == 2:          # split on the sequence: reduce-scatters, nothing to say
        assert not said and "reduce_scatter" in code, said
        return
    assert "reduce_scatter" not in code             # what the warning is about
    assert len(said) == 1, said
    msg = said[0]
    assert "tp_sp at plan 2 runs without sequence parallelism" in msg, msg
    assert "'seq' (dim 1 of input 'idx')" in msg and "any value in [2, 16]" in msg, msg
    assert "dynamic_dims={'idx': {1: {'name': 'seq', 'multiple_of': 2}}}" in msg, msg


# ---- micro-batches: an input whose dim 0 only happens to equal the batch --------------------
class _Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, h):
        return h + torch.tanh(self.fc(h))


class ClassWeighted(nn.Module):
    """A classifier whose loss weighs classes: class_weight has one entry per class, and
    there are as many classes as the batch has rows."""

    def __init__(self, d_in=8, d=16, classes=4, lookup=False):
        super().__init__()
        self.inp = nn.Linear(d_in, d)
        self.h = nn.ModuleList(_Block(d) for _ in range(4))
        self.head = nn.Linear(d, classes)
        self.lookup = lookup

    def forward(self, x, y, class_weight):
        h = self.inp(x)
        for block in self.h:
            h = block(h)
        logits = self.head(h)
        if self.lookup:            # a table looked up by label: its size is tied to nothing
            return (F.cross_entropy(logits, y, reduction="none") * class_weight[y]).mean()
        return F.cross_entropy(logits, y, weight=class_weight)


def _weighted_batch(seed=0, rows=4):
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(rows, 8, generator=g), "y": torch.randint(0, 4, (rows,), generator=g),
            "class_weight": torch.rand(4, generator=g) + 0.5}


def _one_device_steps(model, batches, m):
    """The loop train_step stands for: each batch in m micro-batches along dim 0 of x and y,
    class_weight whole in each, (loss / m) accumulated, then an SGD step."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for b in batches:
        total = 0.0
        for x, y in zip(b["x"].chunk(m), b["y"].chunk(m)):
            loss = model(x, y, b["class_weight"]) / m
            loss.backward()
            total += float(loss.detach())
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses


@pytest.mark.parametrize("lookup, declared", [(False, None), (True, None),
                                              (True, ["x", "y"])])
def test_micro_batches_split_only_inputs_tied_to_the_batch(tmp_path, lookup, declared):
    torch.manual_seed(0)
    model = ClassWeighted(lookup=lookup)
    batches = [_weighted_batch(s) for s in range(3)]
    assert batches[0]["class_weight"].shape[0] == batches[0]["x"].shape[0]
    pas = {"microbatches": 2, **({"batched_inputs": declared} if declared else {})}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pm = nncompile.parallelize(copy.deepcopy(model), batches[0],
                                   nncompile.ComputeConfig(1, 1, parallel=pas),
                                   pas_policy="dp", gen_savedir=tmp_path)
    assert pm.BATCHED == ["x", "y"]
    said = [str(w.message) for w in caught if "batched_inputs" in str(w.message)]
    if lookup and not declared:      # ambiguous: passed whole, with a warning naming the fix
        assert len(said) == 1 and "['class_weight']" in said[0], said
        assert "parallel.batched_inputs = ['x', 'y']" in said[0], said
    else:
        assert not said, said
    opt = torch.optim.SGD(pm.parameters(), lr=0.1)
    got = []
    for b in batches:
        got.append(float(pm.train_step(**b)))
        opt.step()
        opt.zero_grad()
    want = _one_device_steps(copy.deepcopy(model), batches, 2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_pipeline_stages_pass_a_per_class_input_whole(tmp_path):
    """The same decision for a pipelined plan: its schedule chunks only the batched inputs
    (the multi-rank pipeline parity is tests/workers/pipeline.py's)."""
    out = nncompile.parallelize(ClassWeighted(), _weighted_batch(),
                                nncompile.ComputeConfig(2, 2, parallel={
                                    "pp": 2, "microbatches": 2}),
                                pas_policy="dp", gen_savedir=tmp_path, load_module=False)
    for rank in range(2):
        code = (out / f"gencode{rank}.py").read_text()
        assert "'batched': ['x', 'y']" in code, code[:3000]


def test_batched_inputs_declaration_is_checked(tmp_path):
    def compile_with(declared):
        nncompile.parallelize(ClassWeighted(), _weighted_batch(),
                              nncompile.ComputeConfig(1, 1, parallel={
                                  "microbatches": 2, "batched_inputs": declared}),
                              pas_policy="dp", gen_savedir=tmp_path, load_module=False)
    with pytest.raises(nncompile.ConfigError, match=r"names \['labels'\].*\['x', 'y', "
                                                    r"'class_weight'\]"):
        compile_with(["x", "labels"])
    with pytest.raises(nncompile.ConfigError,
                       match="batched_inputs=.x.: a list of forward argument names"):
        compile_with("x")


def test_pipeline_with_class_weights_equals_one_device(run_ranks, tmp_path):
    """pipeline_stages=2 on 2 gloo ranks: 3 steps' losses and weights equal the one-device
    micro-batch loop (before, the class weights were cut into micro-batches: a trace error)."""
    out = run_ranks("tests/workers/class_weight_pipeline.py", 2, "--savedir", str(tmp_path))
    assert out.count("ok class weights whole under a pipeline") == 2, out[-3000:]
