"""Reading a number out of pm's DTensors (runtime/store/value_reads.py): one device's value through
nncompile.grad_norms(pm) or .full_tensor(), a ValueReadError for `.item()` of a value spread
over the ranks, and torch's own behaviour for DTensors on a mesh nncompile did not make."""
from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import models
import nncompile
from nncompile import ComputeConfig
from nncompile.tools.simulate import run_ranks


def _batch():
    b = models.batch("gpt", 0, batch_size=2, seq=16)
    return b


@pytest.mark.parametrize("plan,zero", [(2, 0), (1, 3)])
def test_grad_norms_equal_one_device_and_item_of_a_partial_is_refused(tmp_path, plan, zero):
    base = models.build("gpt")
    ref = copy.deepcopy(base)
    ref(**_batch()).backward()
    want = {n: float(p.grad.norm()) for n, p in ref.named_parameters()}

    def rank_fn(rank):
        pm = nncompile.parallelize(copy.deepcopy(base), _batch(), ComputeConfig(plan, 2,
                                                                                use_zero=zero),
                                   pas_policy="tp" if plan > 1 else "dp", gen_savedir=tmp_path,
                                   instance_name=f"values_{plan}_{zero}")
        pm(**_batch()).backward()
        norms = nncompile.grad_norms(pm)
        p = next(p for _, p in pm.named_parameters()
                 if any(pl.is_shard() for pl in p.grad.placements))
        with pytest.raises(nncompile.ValueReadError, match="full_tensor"):
            p.grad.norm().item()
        with pytest.raises(nncompile.ValueReadError):
            float(p.grad.sum())
        full = float(p.grad.norm().full_tensor())
        return norms, full, next(n for n, q in pm.named_parameters() if q is p)
    for norms, full, name in run_ranks(2, rank_fn):
        assert set(norms) == set(want)
        for n, v in want.items():
            assert abs(norms[n] - v) <= 1e-5 * max(v, 1e-3), (n, norms[n], v)
        assert abs(full - want[name]) <= 1e-5 * max(want[name], 1e-3)


def test_a_mesh_nncompile_did_not_make_keeps_torchs_behaviour(tmp_path):
    """A DTensor over the user's own mesh answers `.item()` as torch does (this rank's part),
    also after nncompile made its own mesh in the same process."""
    base = models.build("gpt")

    def rank_fn(rank):
        nncompile.parallelize(copy.deepcopy(base), _batch(), ComputeConfig(2, 2),
                              pas_policy="tp", gen_savedir=tmp_path, instance_name="values_own")
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("mine",))
        w = torch.arange(8.0).reshape(4, 2)
        d = distribute_tensor(w, mesh, [Shard(0)])
        return d.norm().item(), float(w.chunk(2)[rank].norm())
    for got, local in run_ranks(2, rank_fn):
        assert got == pytest.approx(local)
