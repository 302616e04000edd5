"""nncompile.register_op in one process: tracing keeps the op a leaf, its annotation is its
sharding rule, generated code calls it, and bad registrations say what to fix. (Multi-rank
parity of the custom-op model: tests/test_parity.py, model 'custom'.)"""
import pytest
import torch

import custom_model
import models
import nncompile
from nncompile import ComputeConfig
from nncompile.frontend import trace
from nncompile.ir.interpret import run_graph
from nncompile.rules import strategies


def _custom_ops(graph):
    return [op for op in graph.ops if op.target_name.startswith("custom.")]


def test_traced_as_a_leaf_and_interpreted_like_eager():
    model, inputs = models.build("custom"), models.batch("custom", 0)
    g = trace(model, inputs)
    ops = _custom_ops(g)
    assert [op.target_name for op in ops] == ["custom.my_linear", "custom.my_linear",
                                              "custom.row_softmax"]
    assert not any(op.target_name == "aten.softmax.int" for op in g.ops)   # not inlined
    assert ops[0].source.code.startswith("h = F.gelu(my_linear(x, self.up))")
    state = dict(model.named_parameters())
    (loss,) = run_graph(g, state, [inputs["x"], inputs["target"]])
    torch.testing.assert_close(loss, model(**inputs))


def test_annotation_is_the_sharding_rule():
    g = trace(models.build("custom"), models.batch("custom", 0))
    lin, _, soft = _custom_ops(g)
    notes = [s.note for s in strategies(lin, 2)]
    assert {"split n", "split k", "split *0"} <= set(notes) and notes[-1] == "replicate"
    k_split = next(s for s in strategies(lin, 2) if s.note == "split k")
    assert repr(k_split.outputs[0]) == "P"               # contracting k leaves partial sums
    # `d^`: the normalized dim is never split
    assert all(s.note != "split d" for s in strategies(soft, 2))
    assert {"split *0", "split *1"} <= {s.note for s in strategies(soft, 2)}
    # autodist's cost model counts the annotated contraction's FLOPs: 2 * (4*4) * 16 * 32
    from nncompile.passes.autodist.cost_model import flops
    assert flops(lin) == 2 * 4 * 4 * 16 * 32


def test_generated_code_calls_the_function(tmp_path):
    out = nncompile.parallelize(models.build("custom"), models.batch("custom", 0),
                                ComputeConfig(2, 2), pas_policy="tp", gen_savedir=tmp_path,
                                load_module=False)
    code = (out / "gencode0.py").read_text()
    assert "from nncompile.custom_ops import custom" in code
    assert "#   custom.my_linear = custom_model.MyLinear.apply   [* k+, n k+ -> * n]" in code
    assert "my_linear = custom.my_linear(x, self.up)" in code
    assert "custom.row_softmax(" in code and ", 0.5)" in code


def test_runs_in_process_with_its_own_backward(tmp_path):
    model, inputs = models.build("custom"), models.batch("custom", 0)
    pm = nncompile.parallelize(model, inputs, ComputeConfig(1, 1), pas_policy="dp",
                               gen_savedir=tmp_path)
    calls = []
    original = custom_model.MyLinear.backward

    def counting_backward(ctx, grad):
        calls.append(grad.shape)
        return original(ctx, grad)

    custom_model.MyLinear.backward = staticmethod(counting_backward)
    try:
        pm(**inputs).backward()
    finally:
        custom_model.MyLinear.backward = staticmethod(original)
    assert len(calls) == 2                      # the user's backward ran for both linears
    model(**inputs).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(getattr(pm, name.replace(".", "_")).grad, p.grad)


def test_bad_registrations_say_what_to_fix():
    with pytest.raises(nncompile.ConfigError, match="names 1 operand.*takes 2 tensor"):
        nncompile.register_op(custom_model.MyLinear, "* k -> * k", name="bad_linear")
    with pytest.raises(nncompile.ConfigError, match="takes \\*xs"):
        nncompile.register_op(lambda *xs: xs[0], "a -> a", name="bad_varargs")
    with pytest.raises(nncompile.ConfigError, match="einsum-like string"):
        nncompile.register_op(custom_model.row_softmax, 3, name="bad_rule")
    with pytest.raises(nncompile.ConfigError, match="already registered"):
        nncompile.register_op(custom_model.MyLinear, "a, b -> a", name="row_softmax")


def test_missing_registration_names_the_op():
    from nncompile.custom_ops import custom
    with pytest.raises(nncompile.NNCompileError, match="'not_there'.*register_op"):
        custom.not_there


def test_registering_again_swaps_the_implementation():
    x = torch.randn(3, 5)

    def double(t):
        return t * 2

    def triple(t):
        return t * 3

    op = nncompile.register_op(double, "* d -> * d", name="scale_rows")
    assert torch.equal(torch.ops.nncompile.scale_rows(x), x * 2)
    op2 = nncompile.register_op(triple, "* d -> * d", name="scale_rows")  # a re-run cell
    assert torch.equal(torch.ops.nncompile.scale_rows(x), x * 3)
    assert torch.equal(op2(x), x * 3) and torch.equal(op(x), x * 2)
