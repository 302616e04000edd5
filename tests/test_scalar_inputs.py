"""Scalars that change per call (a token count, a loss scale) as run-time inputs of one program:
named in parallelize's `scalar_inputs`, passed as Python numbers or 0-d tensors, equal to one
device under each plan; undeclared, a changed value is an error that names the option."""
import copy

import pytest
import torch
from torch.distributed.tensor import DTensor

import models
import nncompile
from nncompile.tools.simulate import run_ranks

PLANS = {"dp": (1, 2, 0, "dp"), "tp": (2, 2, 0, "tp"), "zero3": (1, 2, 3, "dp"),
         "tp_zero3": (2, 4, 3, "tp")}
COUNTS = (41, 7, 1000)          # num_items_in_batch per call: one program for all of them


def _batch():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 64, (4, 16), generator=g)
    labels = ids.clone()
    labels[:, :5] = -100
    return {"input_ids": ids, "labels": labels}


def _llama():
    torch.manual_seed(0)
    return models.hf_llama().model          # LlamaForCausalLM itself (it takes loss kwargs)


def _grads(module):
    return {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
            for n, p in module.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("plan", PLANS)
def test_num_items_in_batch_as_a_changing_int_equals_one_device(plan, tmp_path):
    """Hugging Face's token-count normalisation (loss summed, divided by num_items_in_batch):
    a new int every call, one generated program, loss and every gradient as on one device."""
    plan_ngpus, world, zero, policy = PLANS[plan]
    base, batch = _llama(), _batch()
    want = []
    for n in COUNTS:
        ref = copy.deepcopy(base)
        loss = ref(**batch, num_items_in_batch=n, use_cache=False).loss
        loss.backward()
        want.append((loss.item(), _grads(ref)))

    def rank_fn(rank):
        module = copy.deepcopy(base)
        pm = nncompile.parallelize(
            module, {**batch, "num_items_in_batch": 5, "use_cache": False},
            nncompile.ComputeConfig(plan_ngpus, world, use_zero=zero), pas_policy=policy,
            gen_savedir=tmp_path, instance_name=plan, scalar_inputs=["num_items_in_batch"])
        got = []
        for n in COUNTS:
            pm.zero_grad()
            for p in module.parameters():
                p.grad = None
            loss = pm(**batch, num_items_in_batch=n, use_cache=False).loss
            loss.backward()
            got.append((loss.item(), _grads(module)))
        return got, [name for name, _, _ in pm.INPUTS]
    for got, inputs in run_ranks(world, rank_fn):
        assert "num_items_in_batch" in inputs          # an input of the program
        for (loss, grads), (ref_loss, ref_grads) in zip(got, want):
            assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (plan, loss, ref_loss)
            assert grads.keys() == ref_grads.keys()
            for name, g in grads.items():
                torch.testing.assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-6,
                                           msg=lambda m: f"{plan} {name}: {m}")
    assert len(list(tmp_path.glob(f"{plan}/gencode0.py"))) == 1


class Scaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x, scale, step):
        return (self.lin(x) * scale).pow(2).mean() + step * 1e-3


def test_float_and_int_scalars_pass_as_numbers_or_0d_tensors(tmp_path):
    model = Scaled()
    x = torch.randn(4, 8)
    pm = nncompile.parallelize(copy.deepcopy(model), {"x": x, "scale": 0.5, "step": 0},
                               nncompile.ComputeConfig(1), pas_policy="dp", gen_savedir=tmp_path,
                               scalar_inputs=["scale", "step"])
    for scale, step in ((0.5, 0), (2.0, 3), (torch.tensor(0.25), torch.tensor(7))):
        torch.testing.assert_close(pm(x, scale, step), model(x, scale, step))
    with pytest.raises(nncompile.InputMismatchError, match=r"input 'step' is torch.float32"):
        pm(x, 1.0, torch.tensor(2.0))                   # a float where an int was traced


def test_an_undeclared_changing_int_names_scalar_inputs(tmp_path):
    batch = _batch()
    pm = nncompile.parallelize(_llama(), {**batch, "num_items_in_batch": 5, "use_cache": False},
                               nncompile.ComputeConfig(1), pas_policy="dp", gen_savedir=tmp_path)
    pm(**batch, num_items_in_batch=5, use_cache=False)
    with pytest.raises(nncompile.InputMismatchError,
                       match=r"argument num_items_in_batch is 6, .* a constant compiled into the "
                             r"code; if it changes from call to call, parallelize with "
                             r"scalar_inputs=\['num_items_in_batch'\]"):
        pm(**batch, num_items_in_batch=6, use_cache=False)


@pytest.mark.parametrize("dummy, names, message", [
    ({"x": torch.randn(4, 8), "scale": 0.5, "step": 0}, ["bogus"],
     r"scalar_inputs names 'bogus', but dummy_args has no argument 'bogus'"),
    ({"x": torch.randn(4, 8), "scale": torch.ones(2), "step": 0}, ["scale"],
     r"dummy_args\['scale'\] is a float32\[2\] tensor; a scalar input is a Python int or float"),
    ({"x": torch.randn(4, 8), "scale": True, "step": 0}, ["scale"],
     r"dummy_args\['scale'\] is True"),
])
def test_a_wrong_declaration_is_a_clear_error(dummy, names, message, tmp_path):
    with pytest.raises(nncompile.ConfigError, match=message):
        nncompile.parallelize(Scaled(), dummy, nncompile.ComputeConfig(1), pas_policy="dp",
                              gen_savedir=tmp_path, scalar_inputs=names)
