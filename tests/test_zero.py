"""ZeRO-3 in one process: the generated per-unit lines, gathered weights not kept for backward,
parity with the original module (with recompute too), and the config checks. Multi-rank
parity for every stage is in test_training.py (tests/workers/train.py --zero) and the
checkpoints in test_checkpoint.py."""
import gc

import pytest
import torch

import models
import nncompile
from nncompile.rows import param_rows
from nncompile import ComputeConfig


def compile_gpt(tmp_path, name="z3", **kw):
    return nncompile.parallelize(models.build("gpt"), models.batch("gpt", 0),
                                 ComputeConfig(1, 1, use_zero=3, **kw), pas_policy="dp",
                                 gen_savedir=tmp_path, instance_name=name)


def test_generated_code_gathers_prefetches_and_frees_per_unit(tmp_path):
    pm = compile_gpt(tmp_path)
    code = (tmp_path / "z3" / "gencode0.py").read_text()
    units = [u.path for u in pm.zero.units]
    assert units == ["wte", "wpe", "h.0", "h.1", "ln_f"], units
    # the flat pieces are stored per unit; named_parameters() shows the model's parameters
    assert [f.grad_fn is None and f.dim() for f in pm.stored_parameters()] == [1] * len(units)
    local = {row.name: row.fqn for row in param_rows(pm)}
    assert [n for n, _ in pm.named_parameters()] == [local[n] for u in pm.zero.units
                                                     for n in u.layout.names]
    lines = code.splitlines()
    gathers = [i for i, ln in enumerate(lines) if "comm.zero_gather(self.zero_" in ln]
    prefetches = [i for i, ln in enumerate(lines) if "comm.zero_prefetch(self.zero_" in ln]
    frees = [ln for ln in lines if ln.strip().startswith("del ") and "ZeRO-3" in ln]
    assert len(gathers) == len(units) and len(prefetches) == len(units)
    # unit k+1's gather is issued right after unit k's gather, before unit k computes
    for g, p in zip(gathers, prefetches[1:]):
        assert p == g + 1, (lines[g], lines[p])
    # every unit is freed after its last use; the tied embedding only after lm_head's matmul
    assert len(frees) == len(units)
    assert "del wte_weight" in frees[-1]
    i_h0 = next(i for i in gathers if "zero_h_0" in lines[i])
    i_free_h0 = next(i for i, ln in enumerate(lines) if ln.strip().startswith("del h0_"))
    i_h1 = next(i for i in gathers if "zero_h_1" in lines[i])
    assert i_h0 < i_free_h0 < i_h1, "h.0 is freed before h.1 is gathered"


def test_backward_does_not_keep_the_gathered_weights(tmp_path):
    """After forward no gathered unit is alive (autograd saved references, not tensors);
    backward gathers them again. Without the saved-tensor hooks they stay alive."""
    pm = compile_gpt(tmp_path)
    batch = models.batch("gpt", 0)

    def alive():
        gc.collect()
        return sum(r() is not None for u in pm.zero.units for r in u.live.values())
    loss = pm(**batch)
    assert alive() == 0
    loss.backward()
    assert all(u.again is None for u in pm.zero.units)       # backward's copies dropped
    pm.zero.pack = lambda t: t                                # hooks off: weights are kept
    loss = pm(**batch)
    assert alive() >= 4
    loss.backward()


@pytest.mark.parametrize("recompute", [False, True])
def test_one_rank_parity_and_plain_adamw(tmp_path, recompute):
    """A plain AdamW over pm's ZeRO-3 parameters, its zero_grad() after a step or between
    forward and backward: one device's gradients and weights."""
    ref = models.build("gpt")
    pm = compile_gpt(tmp_path, name=f"z3rc{int(recompute)}",
                     parallel={"recompute_modules": ["Block"]} if recompute else {})
    if recompute:
        code = (tmp_path / "z3rc1" / "gencode0.py").read_text()
        # the block's unit is gathered inside its checkpointed function (gathered again when
        # backward recomputes it)
        inner = code.split("def recompute_h_0(")[1].split("checkpoint(")[0]
        assert "comm.zero_gather(self.zero_h_0" in inner
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)         # steps the pieces of each
    for step in range(3):
        batch = models.batch("gpt", step)
        want = ref(**batch)
        got = pm(**batch)
        if step == 2:               # Lightning's order: cleared after forward, before backward
            opt_ref.zero_grad()
            opt.zero_grad()
        want.backward()
        got.backward()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        grads = pm.gather_grads()
        for n, p in ref.named_parameters():
            torch.testing.assert_close(grads[n], p.grad, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, n=n: f"{n}: {m}")
        opt_ref.step()
        opt.step()
        if step != 1:
            opt_ref.zero_grad()
            opt.zero_grad()
    full = pm.gather_params()
    for n, p in ref.named_parameters():
        torch.testing.assert_close(full[n], p.detach(), rtol=1e-5, atol=1e-6)
    sd = pm.local_state_dict()                                   # local names, as without ZeRO
    assert not any(k.startswith("zero_") for k in sd) and "h0_mlp_fc_weight" in sd


def test_auto_needs_autodist_and_zero3_needs_its_code(tmp_path):
    with pytest.raises(nncompile.ConfigError, match="autodist"):
        nncompile.parallelize(models.build("gpt"), models.batch("gpt", 0),
                              ComputeConfig(1, 1, use_zero="auto"), pas_policy="dp",
                              gen_savedir=tmp_path, instance_name="auto")
    pm = nncompile.parallelize(models.build("gpt"), models.batch("gpt", 0),
                               ComputeConfig(1, 1, use_zero=1), pas_policy="dp",
                               gen_savedir=tmp_path, instance_name="z1")
    with pytest.raises(nncompile.ConfigError, match="parallelize again|regenerate"):
        type(pm)(models.build("gpt"), compute_config=ComputeConfig(1, 1, use_zero=3))


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_row_shard_layout_cuts_rows_as_dtensor_shard0(size):
    """A ZeRO-3 unit's pieces: each tensor's rows cut as torch.chunk (Shard(0)) cuts them,
    padded per tensor; the gathered pieces copy out into the tensors' order and back."""
    from nncompile.runtime.store.layouts import RowShardLayout
    shapes = [(3, 2), (5,), (), (1, 4), (0, 3), (7, 3)]
    tensors = [torch.randn(s) for s in shapes]
    names = [f"t{i}" for i in range(len(shapes))]
    layouts = [RowShardLayout(names, shapes, r, size) for r in range(size)]
    pieces = [lay.owned(tensors) for lay in layouts]
    assert {p.numel() for p in pieces} == {layouts[0].chunk}
    gathered = torch.cat(pieces)
    flat = torch.cat([t.reshape(-1) for t in tensors])
    assert torch.equal(layouts[0].to_full(gathered), flat)
    assert torch.equal(layouts[0].from_full(flat), gathered)
    for lay, piece in zip(layouts, pieces):
        for i, t in enumerate(tensors):
            at, s, e = lay.run_of(i, lay.rank)
            assert torch.equal(piece[at:at + e - s], t.reshape(-1)[s:e])
            if t.dim():
                chunks = torch.chunk(t, size) if t.shape[0] else ()
                mine = chunks[lay.rank] if lay.rank < len(chunks) else t[:0]
                assert torch.equal(mine.reshape(-1), t.reshape(-1)[s:e])
                assert lay.local_rows(i) == mine.shape[0]


def test_offload_copies_are_named_on_the_profilers_timeline(tmp_path):
    """offload_params: each unit's copy to the device (forward and backward gathers) and its
    gradient's copy to the host; offload_optimizer: the step's copies too."""
    pm = compile_gpt(tmp_path, "z3off", offload_params=True, offload_optimizer=True)
    opt = nncompile.build_optimizer(pm, torch.optim.AdamW, lr=1e-3)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        pm(**models.batch("gpt", 0)).backward()
        opt.step()
    names = [e.name for e in prof.events()]
    for unit in pm.zero.units:
        assert names.count(f"nncompile.offload.to_host {unit.path}") == 1, unit.path
        # forward's gather, and backward's where backward reads the weights (not wpe's)
        want = 1 if unit.path == "wpe" else 2
        assert names.count(f"nncompile.offload.to_device {unit.path}") == want, unit.path
    assert opt.inner.defaults["fused"] is True      # the host step's fused kernel
