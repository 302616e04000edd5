"""nncompile.DataParallelSampler and what a checkpoint carries for a resume besides the weights
(runtime/checkpoints/resume_state.py): every layout of a global batch sees the same global sequence, the
sampler's state continues it on another layout, torchdata's StatefulDataLoader saves it, and
save_checkpoint / load_checkpoint put back the data position and the random-number state.
One process; tests/test_resume_world.py resumes real jobs on other world sizes."""
import random

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import models
import nncompile
from nncompile.runtime.checkpoints import resume_state


def global_batches(units: int, micro: int, accum: int, steps: int, n: int = 40, seed: int = 3,
                   state: dict | None = None, **kw) -> tuple[list[list[int]], dict]:
    """The global batches (unit order within a micro-step) `steps` optimizer steps see when
    `units` units draw micro-batches of `micro`, `accum` per step, and the state after (`kw`:
    the samplers' other arguments)."""
    samplers = [nncompile.DataParallelSampler(n, micro, dp_rank=u, dp_units=units, seed=seed,
                                              **kw) for u in range(units)]
    if state is not None:
        for s in samplers:
            s.load_state_dict(state)
    out, iters = [], [None] * units
    for _ in range(steps):
        batch = []
        for _ in range(accum):
            for u, s in enumerate(samplers):
                try:
                    b = next(iters[u]) if iters[u] is not None else None
                except StopIteration:
                    b = None
                if b is None:                  # a new epoch: iterate again, as a loop would
                    iters[u] = iter(s)
                    b = next(iters[u])
                batch += b
        out.append(batch)
    states = [s.state_dict() for s in samplers]
    assert all(st == states[0] for st in states)      # the state is the same on every unit
    return out, states[0]


def test_every_layout_of_a_global_batch_sees_the_same_global_batches():
    # global batch 8 over 12 steps of 40 samples: 5 steps an epoch, so two epoch boundaries
    want, _ = global_batches(units=1, micro=8, accum=1, steps=12)
    for units, micro, accum in [(2, 4, 1), (1, 4, 2), (4, 2, 1), (2, 2, 2), (8, 1, 1)]:
        assert global_batches(units, micro, accum, steps=12)[0] == want, (units, micro, accum)
    first = want[:5]                                 # an epoch is a permutation of the data
    assert sorted(i for b in first for i in b) == list(range(40))
    assert want[5:10] != first                        # and the next epoch another one


def test_the_state_continues_the_same_sequence_on_another_layout():
    want, _ = global_batches(units=2, micro=4, accum=1, steps=9)
    head, state = global_batches(units=2, micro=4, accum=1, steps=3)
    assert state == {"seed": 3, "epoch": 0, "position": 24, "num_samples": 40, "shuffle": True,
                     "global_batch": 8, "drop_last": True}
    for units, micro, accum in [(1, 4, 2), (4, 2, 1), (2, 4, 1)]:
        tail, _ = global_batches(units, micro, accum, steps=6, state=state)
        assert head + tail == want, (units, micro, accum)


@pytest.mark.parametrize("drop_last", [True, False])
def test_a_dataset_that_does_not_divide_the_global_batch_resumes_on_any_layout(drop_last):
    # a global batch of 8 saved under 4 units x 2 after every step of two epochs, resumed as
    # 4 x 2, 2 x 2 x 2 accumulation, 1 x 2 x 4 and 1 x 4 x 2: the uninterrupted global batches
    layouts = [(4, 2, 1), (2, 2, 2), (1, 2, 4), (1, 4, 2)]
    for n in range(17, 25):
        per_epoch = n // 8 if drop_last else -(-n // 8)
        steps = 4 * per_epoch
        want, _ = global_batches(4, 2, 1, steps, n=n, global_batch=8, drop_last=drop_last)
        for units, micro, accum in layouts:               # every layout, uninterrupted
            got, _ = global_batches(units, micro, accum, steps, n=n, global_batch=8,
                                    drop_last=drop_last)
            assert got == want, (n, units, micro, accum)
        epoch = sorted(i for b in want[:per_epoch] for i in b)
        if drop_last:                                     # the first 8 * (n // 8) of a perm
            assert len(set(epoch)) == len(epoch) == 8 * per_epoch
        else:                                             # all, the first few twice
            assert set(epoch) == set(range(n)) and len(epoch) == 8 * per_epoch
        for saved_after in range(2 * per_epoch + 1):
            head, state = global_batches(4, 2, 1, saved_after, n=n, global_batch=8,
                                         drop_last=drop_last)
            for units, micro, accum in layouts:
                tail, _ = global_batches(units, micro, accum, steps - saved_after, n=n,
                                         state=state, global_batch=8, drop_last=drop_last)
                assert head + tail == want, (n, saved_after, units, micro, accum)


def test_a_resume_that_would_cut_epochs_elsewhere_is_refused():
    _, state = global_batches(4, 2, 1, 1, n=20)                      # global batches of 8
    with pytest.raises(nncompile.ConfigError, match=r"into global batches of 8 \(drop_last="
                       r"True: 16 samples an epoch\), this one into global batches of 4 .*"
                       r"build it with global_batch=8, drop_last=True"):
        global_batches(1, 4, 2, 1, n=20, state=state)                # global_batch forgotten
    with pytest.raises(nncompile.ConfigError, match="drop_last=False: 24"):
        global_batches(1, 4, 2, 1, n=20, state=state, global_batch=8, drop_last=False)
    # where every cut hands out the same samples the global batches agree: accepted
    _, state = global_batches(4, 2, 1, 1, n=24)
    assert global_batches(1, 4, 2, 2, n=24, state=state)[0] == \
        global_batches(4, 2, 1, 3, n=24)[0][1:]
    # a state saved before it held the cut (no global_batch) continues at its position
    old = {"seed": 3, "epoch": 0, "position": 8, "num_samples": 20, "shuffle": True}
    assert global_batches(1, 4, 2, 3, n=20, state=old, global_batch=8)[0] == \
        global_batches(4, 2, 1, 4, n=20)[0][1:]


def test_epochs_and_orders():
    s = nncompile.DataParallelSampler(list(range(10)), 3, shuffle=False)
    assert len(s) == 3 and list(s) == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]   # the rest dropped
    assert s.state_dict()["epoch"] == 0 and list(s)[0] == [0, 1, 2]      # the next epoch
    assert s.state_dict()["epoch"] == 1
    shuffled = nncompile.DataParallelSampler(10, 5, seed=0)
    e0 = list(shuffled)
    shuffled.set_epoch(0)                                # the epoch under way: a no-op
    assert list(shuffled) != e0 and shuffled.state_dict()["epoch"] == 1
    shuffled.set_epoch(4)
    g = torch.Generator().manual_seed(4)
    assert sum(list(shuffled), []) == torch.randperm(10, generator=g).tolist()


def test_bad_arguments_and_states_say_what_to_change():
    with pytest.raises(nncompile.ConfigError, match="micro_batch=0 must be a positive"):
        nncompile.DataParallelSampler(10, 0)
    with pytest.raises(nncompile.ConfigError, match="dp_rank=2 is not a unit of 0..1"):
        nncompile.DataParallelSampler(10, 1, dp_rank=2, dp_units=2)
    with pytest.raises(nncompile.ConfigError, match="fewer than one global batch"):
        nncompile.DataParallelSampler(10, 4, dp_rank=0, dp_units=4)
    with pytest.raises(nncompile.ConfigError, match="choose a micro-batch that divides 6"):
        nncompile.DataParallelSampler(40, 4, dp_rank=0, dp_units=2, global_batch=12)
    saved = nncompile.DataParallelSampler(40, 4, seed=1)
    next(iter(saved))
    with pytest.raises(nncompile.ConfigError, match="build the sampler with the saved seed"):
        nncompile.DataParallelSampler(40, 4, seed=2).load_state_dict(saved.state_dict())
    with pytest.raises(nncompile.ConfigError, match="not a whole number of this job's global"):
        nncompile.DataParallelSampler(40, 8, seed=1).load_state_dict(saved.state_dict())


def test_torchdata_stateful_dataloader_saves_the_sampler():
    from torchdata.stateful_dataloader import StatefulDataLoader
    ds = TensorDataset(torch.arange(32))
    loader = StatefulDataLoader(ds, batch_sampler=nncompile.DataParallelSampler(ds, 4, seed=5))
    it = iter(loader)
    for _ in range(3):
        next(it)
    state = loader.state_dict()
    rest = [next(it)[0].tolist() for _ in range(5)]
    again = StatefulDataLoader(ds, batch_sampler=nncompile.DataParallelSampler(ds, 4, seed=5))
    again.load_state_dict(state)
    assert [b[0].tolist() for b in again] == rest


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 1-rank dp GPT with dropout (its attention and MLP) after one step."""
    d = tmp_path_factory.mktemp("resume_state")
    model = models.build("gpt")
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.2
    pm = nncompile.parallelize(model, models.batch("gpt", 0), nncompile.ComputeConfig(1),
                               pas_policy="dp", gen_savedir=d / "gen")
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    pm(**models.batch("gpt", 0)).backward()
    opt.step()
    return pm, opt


@pytest.mark.parametrize("fmt", ["sharded", "deduped"])
def test_a_checkpoint_puts_back_the_data_position_and_the_random_numbers(trained, tmp_path, fmt):
    pm, opt = trained
    ds = TensorDataset(torch.arange(40))
    sampler = nncompile.DataParallelSampler(ds, 4, seed=9)
    it = iter(DataLoader(ds, batch_sampler=sampler))
    next(it), next(it)
    torch.manual_seed(123)
    random.seed(4)
    np.random.seed(5)
    path = nncompile.save_checkpoint(tmp_path / "ck", pm, opt, format=fmt, data=sampler)
    want_loss = pm(**models.batch("gpt", 1)).item()          # dropout draws after the save
    want = (torch.rand(3), random.random(), np.random.rand(), next(it)[0].tolist())
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    fresh = nncompile.DataParallelSampler(ds, 4, seed=9)
    nncompile.load_checkpoint(path, pm, opt, data=fresh)
    assert pm(**models.batch("gpt", 1)).item() == want_loss   # the same dropout masks
    got = (torch.rand(3), random.random(), np.random.rand(),   # (a new DataLoader iterator
           next(iter(DataLoader(ds, batch_sampler=fresh)))[0].tolist())   # draws a seed)
    assert torch.equal(got[0], want[0]) and got[1:] == want[1:]
    seeded = torch.manual_seed(0).get_state()
    nncompile.load_checkpoint(path, pm, opt, rng=False)      # rng=False: left alone
    assert torch.equal(torch.get_rng_state(), seeded)


def test_resume_state_errors_and_layout_changes(trained, tmp_path):
    pm, opt = trained
    plain = nncompile.save_checkpoint(tmp_path / "plain", pm, opt)
    sampler = nncompile.DataParallelSampler(8, 2)
    with pytest.raises(nncompile.ConfigError, match="saved without data="):
        nncompile.load_checkpoint(plain, pm, opt, data=sampler)
    with pytest.raises(nncompile.ConfigError, match="has no state_dict"):
        nncompile.save_checkpoint(tmp_path / "bad", pm, opt, data=[1, 2])
    # another layout: the generators all ranks saved alike are restored, differing ones are not
    a, b = resume_state.rng_state(), resume_state.rng_state()
    b["torch"] = torch.manual_seed(77).get_state()
    saved = [{"rng": a, "data": {"k": 1}}, {"rng": b, "data": {"k": 1}}]
    layout = {"plan_ngpus": 1, "runtime_ngpus": 2, "pipe_ranks": 1}
    mine = {"plan_ngpus": 1, "runtime_ngpus": 1, "pipe_ranks": 1}
    got = {}

    class Probe:
        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            got.update(state)
    random.seed(1)
    with pytest.warns(UserWarning, match="different torch random-number states"):
        resume_state.restore(saved, layout, mine, Probe(), where="ck")
    assert got == {"k": 1} and random.getstate() == tuple(a["python"])
    saved[1]["data"] = {"k": 2}
    with pytest.raises(nncompile.ConfigError, match="different data states"):
        resume_state.restore(saved, layout, mine, Probe(), where="ck")
