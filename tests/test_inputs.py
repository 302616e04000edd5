"""The inputs real training code passes: the same tensor twice (labels=input_ids), tensors of
the wrong kind, None/bool/int/float arguments, nested batches, Hugging Face's use_cache."""
import copy
import dataclasses

import pytest
import torch

import models
import nncompile
from nncompile.frontend import trace
from nncompile.tools.simulate import run_ranks


@pytest.mark.parametrize("policy", ["data", "tp"])
def test_the_same_tensor_passed_twice_stays_two_inputs(tmp_path, policy):
    """Compiled with labels=input_ids (one tensor object), then called with distinct ones:
    loss and every gradient equal the single-device run (rank threads, one process)."""
    model = models.build("hf_gpt2")
    t = torch.randint(0, 64, (4, 16))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 64, (4, 16), generator=g), torch.randint(0, 64, (4, 16), generator=g)
    for dummy, batch in (((t, t), (x, y)),
                         ({"input_ids": t, "labels": t}, {"input_ids": x, "labels": y})):
        report = nncompile.verify(model, dummy, nncompile.ComputeConfig(2), policy,
                                  gen_savedir=str(tmp_path), inputs=batch)
        assert report.ok, str(report)


def test_each_input_is_read_where_it_belongs():
    t = torch.randint(0, 64, (4, 16))
    graph = trace(models.build("hf_gpt2"), (t, t))
    ids, labels = graph.inputs
    first = next(op for op in graph.ops if ids in op.inputs() or labels in op.inputs())
    assert ids in first.inputs() and labels not in first.inputs()    # embedding reads ids
    # a view of another input (labels = input_ids[:, 1:] style) is a separate input too
    u = torch.randint(0, 64, (4, 17))
    graph = trace(models.build("hf_gpt2"), (u[:, :-1], u[:, 1:]))
    assert len(graph.inputs) == 2


def test_inputs_of_the_wrong_kind_dtype_or_device_are_named(tmp_path):
    import numpy as np
    pm = nncompile.parallelize(models.build("mlp"), models.batch("mlp", 0),
                               nncompile.ComputeConfig(plan_ngpus=1), pas_policy="dp",
                               gen_savedir=tmp_path)
    b = models.batch("mlp", 1)
    with pytest.raises(nncompile.InputMismatchError,
                       match=r"input 'x' is a numpy.ndarray, but the module was traced with a "
                             r"torch.float32\[4, 16\] tensor \(convert it with torch.as_tensor\)"):
        pm(np.zeros((4, 16), dtype=np.float32), b["y"])
    with pytest.raises(nncompile.InputMismatchError, match=r"input 'y' is a list, .*as_tensor"):
        pm(b["x"], b["y"].tolist())
    with pytest.raises(nncompile.InputMismatchError,
                       match=r"input 'x' is torch.float64 but the module was traced with "
                             r"torch.float32; convert it with .to\(torch.float32\)") as e:
        pm(b["x"].double(), b["y"])
    assert "shapes are static" not in str(e.value)
    with pytest.raises(nncompile.InputMismatchError,
                       match=r"input 'x' is on meta but this rank's module is on cpu"):
        pm(b["x"].to("meta"), b["y"])


# ---- non-tensor and nested arguments ---------------------------------------------------------
class Flags(torch.nn.Module):
    """Optional mask, a flag, a float and an int, as real forwards take them."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x, mask=None, flag=True, scale=1.0, n=2, name="a"):
        y = self.lin(x) * scale
        if mask is not None:
            y = y + mask
        if flag:
            y = y * n
        return y.pow(2).mean()


def _x():
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("policy", ["dp", "tp"])
def test_none_bool_int_float_arguments_are_constants(tmp_path, policy):
    model = Flags()
    mask = torch.randn(4, 8)
    dummy = {"x": _x(), "mask": None, "flag": False, "scale": 0.5, "n": 3}
    pm = nncompile.parallelize(model, dummy, nncompile.ComputeConfig(1), pas_policy=policy,
                               gen_savedir=tmp_path)
    code = open(pm.gencode_path).read()
    assert "('flag', '*', [('const', False)])" in code and "('mask', '*', [('const', None)])" in code
    for call in (lambda m: m(_x(), None, False, 0.5, 3),
                 lambda m: m(x=_x(), mask=None, flag=False, scale=0.5, n=3, name="a")):
        torch.testing.assert_close(call(pm), call(model))
    with pytest.raises(nncompile.InputMismatchError,
                       match=r"argument flag is True, but the module was traced with False, a "
                             r"constant compiled into the code; call parallelize again"):
        pm(_x(), None, True, 0.5, 3)
    with pytest.raises(nncompile.InputMismatchError, match=r"argument mask is a float32\[4, 8\] "
                                                           r"tensor, but .* traced with None"):
        pm(_x(), mask, False, 0.5, 3)
    with pytest.raises(nncompile.InputMismatchError, match=r"argument scale is 1, but"):
        pm(_x(), None, False, 1, 3)                        # int where a float was traced
    with pytest.raises(nncompile.InputMismatchError,
                       match=r"argument 'name' is 'b', but the module was traced without it "
                             r"\(with its default 'a'\); add it to dummy_args"):
        pm(_x(), None, False, 0.5, 3, name="b")
    with pytest.raises(nncompile.InputMismatchError, match=r"unexpected argument 'bogus'"):
        pm(_x(), None, False, 0.5, 3, bogus=1)
    with pytest.raises(nncompile.InputMismatchError, match=r"missing argument 'n'"):
        pm(_x(), None, False, 0.5)
    # a mask given as a tensor compiles as an input
    pm2 = nncompile.parallelize(model, {"x": _x(), "mask": mask}, nncompile.ComputeConfig(1),
                                pas_policy=policy, gen_savedir=tmp_path, instance_name="masked")
    torch.testing.assert_close(pm2(_x(), mask), model(_x(), mask))


def test_unsupported_argument_values_are_refused(tmp_path):
    with pytest.raises(nncompile.ConfigError, match=r"dummy_args\['scale'\] holds a dtype; "
                                                    r"arguments may be tensors, None, bool"):
        nncompile.parallelize(Flags(), {"x": _x(), "scale": torch.float32},
                              nncompile.ComputeConfig(1), pas_policy="dp", gen_savedir=tmp_path,
                              load_module=False)


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    y: torch.Tensor


class BatchModel(torch.nn.Module):
    """forward(self, batch) with a dict, tuple or dataclass batch."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(8, 32), torch.nn.Linear(32, 8)

    def forward(self, batch):
        if isinstance(batch, Batch):
            x, y = batch.x, batch.y
        elif isinstance(batch, dict):
            x, y = batch["x"], batch["y"]
        else:
            x, y = batch
        return torch.nn.functional.mse_loss(self.fc2(torch.relu(self.fc1(x))), y)


@pytest.mark.parametrize("kind", ["dict", "tuple", "dataclass"])
def test_nested_batch_is_called_like_the_module(tmp_path, kind):
    make = {"dict": lambda x, y: {"x": x, "y": y}, "tuple": lambda x, y: (x, y),
            "dataclass": Batch}[kind]
    g = torch.Generator().manual_seed(0)
    dummy = make(torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g))
    batch = make(torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g))
    torch.manual_seed(0)
    model = BatchModel()
    report = nncompile.verify(model, (dummy,), nncompile.ComputeConfig(2), "tp",
                              gen_savedir=str(tmp_path), inputs=(batch,))
    assert report.ok and report.divergence is None, str(report)

    def rank_fn(rank):
        pm = nncompile.parallelize(copy.deepcopy(model), (dummy,), nncompile.ComputeConfig(2),
                                   pas_policy="tp", gen_savedir=tmp_path)
        loss = pm(batch)                                  # called as the module is
        loss.backward()
        return loss.detach(), pm.gather_grads()
    loss, grads = run_ranks(2, rank_fn)[0]
    ref = copy.deepcopy(model)
    want = ref(batch)
    want.backward()
    torch.testing.assert_close(loss, want.detach())
    for n, p in ref.named_parameters():
        torch.testing.assert_close(grads[n], p.grad)


def test_nested_batch_of_another_structure_is_named(tmp_path):
    dummy = {"x": torch.randn(8, 8), "y": torch.randn(8, 8)}
    pm = nncompile.parallelize(BatchModel(), (dummy,), nncompile.ComputeConfig(1),
                               pas_policy="dp", gen_savedir=tmp_path)
    with pytest.raises(nncompile.InputMismatchError,
                       match=r"argument 'batch' has the structure .*\['x'\].* but the module "
                             r"was traced with .*\['x', 'y'\]"):
        pm({"x": torch.randn(8, 8)})


class HFNoFlag(torch.nn.Module):
    """A Hugging Face causal LM returning its whole output, with its config's default
    use_cache=True unless told otherwise."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, labels, use_cache=None):
        kw = {} if use_cache is None else {"use_cache": use_cache}
        return self.model(input_ids=input_ids, labels=labels, **kw)


def test_hf_cache_output_says_use_cache_false(tmp_path):
    model = HFNoFlag(models.hf_gpt2().model)
    b = models.batch("hf_gpt2", 0)
    with pytest.raises(nncompile.TraceError,
                       match=r"returns a transformers\.cache_utils\.DynamicCache .* Pass "
                             r"use_cache=False .* or set model\.config\.use_cache = False"):
        nncompile.parallelize(model, b, nncompile.ComputeConfig(1), pas_policy="dp",
                              gen_savedir=tmp_path, load_module=False)
    # use_cache=False as a dummy_args value: traced as a constant, called the same way
    report = nncompile.verify(model, {**b, "use_cache": False}, nncompile.ComputeConfig(2), "tp",
                              gen_savedir=str(tmp_path))
    assert report.ok, str(report)


class _Trunk(torch.nn.Module):
    """A trunk fed an activation computed outside it (an embedding the user keeps, a
    gradient penalty's input): its gradient is what the caller trains with."""

    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(8, 32), torch.nn.Linear(32, 8)

    def forward(self, h):
        return self.down(torch.tanh(self.up(h))).pow(2).mean()


@pytest.mark.parametrize("policy,overlap", [("tp", True), ("tp", False), ("autodist", True)])
def test_an_input_that_needs_a_gradient(tmp_path, policy, overlap):
    """Traced with a dummy that requires grad, the input's gradient is summed over the plan
    unit and equals one device's; traced without, a call with such an input is refused (each
    rank would hold only its part of the gradient); a second derivative through the plan is
    an error, never a wrong number."""
    torch.manual_seed(0)
    model = _Trunk()
    h = torch.randn(4, 8)
    ref = copy.deepcopy(model)
    h_ref = h.clone().requires_grad_()
    ref(h_ref).backward()
    cfg = nncompile.ComputeConfig(2, parallel={"overlap_grad_sync": overlap})

    def rank_fn(rank):
        out = {}
        for traced_grad in (True, False):
            dummy = h.clone().requires_grad_(traced_grad)
            pm = nncompile.parallelize(copy.deepcopy(model), (dummy,), cfg, pas_policy=policy,
                                       gen_savedir=tmp_path, instance_name=f"grad_{traced_grad}")
            x = h.clone().requires_grad_()
            try:
                pm(x).backward()
                out[traced_grad] = (x.grad, pm.gather_grads())
            except nncompile.InputMismatchError as e:
                out[traced_grad] = str(e)
        x = h.clone().requires_grad_()
        pm = nncompile.parallelize(copy.deepcopy(model), (h.clone().requires_grad_(),), cfg,
                                   pas_policy=policy, gen_savedir=tmp_path,
                                   instance_name="grad_True")
        pm.zero_grad()
        (g,) = torch.autograd.grad(pm(x), [x], create_graph=True)
        try:
            g.pow(2).sum().backward()
            out["double"] = pm.gather_grads()
        except RuntimeError as e:
            out["double"] = str(e)
        return out

    penalized = copy.deepcopy(model)            # the gradient penalty on one device
    x = h.clone().requires_grad_()
    (g,) = torch.autograd.grad(penalized(x), [x], create_graph=True)
    g.pow(2).sum().backward()

    for out in run_ranks(2, rank_fn):
        x_grad, grads = out[True]
        torch.testing.assert_close(x_grad, h_ref.grad)
        for n, p in ref.named_parameters():
            torch.testing.assert_close(grads[n], p.grad)
        if isinstance(out[False], str):
            assert "input 'h' requires grad, but the module was traced with a dummy 'h' " \
                   "that does not" in out[False] and "h.requires_grad_()" in out[False]
        else:           # a plan whose ranks all see the whole input gradient needs no sum
            torch.testing.assert_close(out[False][0], h_ref.grad)
        if isinstance(out["double"], str):
            assert "differentiate twice" in out["double"], out["double"]
        else:           # no collective on the way (a replicated plan): it must be right
            for n, p in penalized.named_parameters():
                torch.testing.assert_close(out["double"][n], p.grad)
