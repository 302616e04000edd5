"""Per-pass tests: golden printed IR, numerical equivalence with eager, idempotence."""
import ast
import os

import pytest
import torch

import models
from nncompile import ComputeConfig
from nncompile.errors import ConfigError
from nncompile.frontend import trace
from nncompile.ir import (Stage, assert_graph_equal, parse_graph, print_graph, run_graph,
                          verify)
from nncompile.passes import (Plan, build_pipeline, constant_fold, dce, fuse_attention,
                              get_policy, insert_comm,
                              overlap_grad_sync,
                              localize, run_pipeline, tensor_ranks)

GOLDEN = os.path.join(os.path.dirname(__file__), "golden")


def traced(name="mlp"):
    model = models.build(name)
    example = models.batch(name, 0)
    return model, example, trace(model, example)


def stages(name="mlp", policy="tp", n=2):
    model, example, g = traced(name)
    cfg = ComputeConfig(plan_ngpus=n, runtime_ngpus=n)
    result = run_pipeline(g, build_pipeline(cfg, get_policy(policy)), check=True)
    return model, example, result


def state_of(model):
    s = dict(model.named_parameters(remove_duplicate=False))
    s.update(dict(model.named_buffers(remove_duplicate=False)))
    return {k: v.detach() for k, v in s.items()}


def test_pipeline_is_the_documented_list():
    cfg = ComputeConfig(plan_ngpus=2)
    names = [getattr(p, "name", getattr(p, "__name__", "")) for p in
             build_pipeline(cfg, get_policy("tp"))]
    assert names == ["constant_fold", "dce", "fuse_attention", "unfuse_projections",
                     "fuse_experts", "plan",
                     "sink_gathers", "insert_comm", "localize", "overlap_grad_sync"]
    cfg = ComputeConfig(plan_ngpus=2, constant_folding=False)
    assert "constant_fold" not in [getattr(p, "__name__", "") for p in
                                   build_pipeline(cfg, get_policy("tp"))]
    cfg = ComputeConfig(plan_ngpus=2, parallel={"overlap_grad_sync": False})
    assert "overlap_grad_sync" not in [getattr(p, "__name__", "") for p in
                                       build_pipeline(cfg, get_policy("tp"))]
    with pytest.raises(ConfigError, match="overlap_grad_sync.*True.*or False"):
        build_pipeline(ComputeConfig(plan_ngpus=2, parallel={"overlap_grad_sync": "yes"}),
                       get_policy("tp"))


@pytest.mark.parametrize("stage", ["trace", "constant_fold", "dce", "plan", "insert_comm",
                                   "localize"])
def test_golden_ir(stage):
    """The printed IR of the MLP after each pass (tp on 2 ranks) matches tests/golden/.
    Regenerate with NNCOMPILE_UPDATE_GOLDEN=1 after an intended change."""
    _, _, result = stages("mlp")
    graph = dict((n, g) for n, g, _ in result.history)[stage]
    text = print_graph(graph, local_n=2 if stage == "localize" else None)
    ast.parse(text)                                  # printed IR is valid Python
    path = os.path.join(GOLDEN, f"mlp_tp2_{stage}.py")
    if os.environ.get("NNCOMPILE_UPDATE_GOLDEN") == "1":
        os.makedirs(GOLDEN, exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
    with open(path) as f:
        assert text == f.read()


@pytest.mark.parametrize("name", ["mlp", "gpt", "hf_llama"])
def test_passes_preserve_values(name):
    """Every stage before localize computes what eager PyTorch computes (collectives are
    identities on full tensors)."""
    model, example, result = stages(name)
    want = model(**example)
    for stage, graph, _ in result.history:
        if Stage.LOCALIZED in graph.stages:
            continue
        got = run_graph(graph, state_of(model), list(example.values()))[0]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=stage)


def test_localize_with_one_rank_runs_like_eager():
    model, example, result = stages("gpt", "tp", n=1)
    got = run_graph(result.graph, state_of(model), list(example.values()))[0]
    torch.testing.assert_close(got, model(**example))


@pytest.mark.parametrize("name", ["gpt", "hf_llama"])
def test_passes_are_idempotent(name):
    _, _, result = stages(name)
    g = dict((n, gr) for n, gr, _ in result.history)
    plan = Plan(get_policy("tp"))         # the graphs carry their ComputeConfig
    cases = [(constant_fold, g["constant_fold"]), (dce, g["dce"]),
             (fuse_attention, g["fuse_attention"]), (plan, g["plan"]),
             (insert_comm, g["insert_comm"]), (localize, g["localize"])]
    for p, graph in cases:
        again = verify(p(graph))
        assert print_graph(again) == print_graph(graph), getattr(p, "name", p)


def test_constant_fold_moves_masks_and_rotary_tables():
    _, _, g = traced("hf_llama")
    folded = constant_fold(g)
    names = {op.target_name for op in folded.const_ops}
    assert "aten.arange.default" in names                  # positions
    assert any("cos" in n or "sin" in n for n in names)    # rotary tables
    assert "aten.le.Tensor" in names or "aten.expand.default" in names   # causal mask
    fwd = {op.target_name for op in folded.ops}
    assert "aten.arange.default" not in fwd and "aten.cos.default" not in fwd
    assert all(not v.requires_grad for v in folded.consts)
    assert folded.consts                                  # the forward reads folded values


def test_dce_drops_unused_ops():
    class M(torch.nn.Module):
        def forward(self, x):
            unused = x * 3  # noqa: F841
            return x + 1
    g = trace(M(), (torch.ones(2),))
    assert len(g.ops) == 2
    assert [op.target_name for op in dce(g).ops] == ["aten.add.Tensor"]
    assert len(g.ops) == 2                                   # input graph untouched


def test_passes_do_not_mutate_their_input():
    _, _, g = traced("gpt")
    before = print_graph(g)
    cfg = ComputeConfig(plan_ngpus=2)
    run_pipeline(g, build_pipeline(cfg, get_policy("tp")))
    assert print_graph(g) == before


def test_tp_plan_is_megatron_like_for_the_gpt_mlp():
    _, _, result = stages("gpt")
    params = {v.fqn: repr(v.placement) for v in result.graph.params}
    assert params["h.0.mlp_fc.weight"] == "S(0)"       # column parallel
    assert params["h.0.mlp_proj.weight"] == "S(1)"     # row parallel
    assert params["h.0.attn.q_proj.weight"] == "S(0)"


def test_data_policy_splits_batch_and_replicates_weights():
    _, _, result = stages("gpt", "data")
    assert all(repr(v.placement) == "R" for v in result.graph.params)
    chunks = [op for op in result.graph.ops if op.target_name == "comm.chunk"]
    assert {op.kwargs["dim"] for op in chunks} == {0}


# ---- Before/Expected: printed IR in, printed IR out (parse_graph reads both) ----

def check_pass(p, before: str, expected: str):
    """Run pass `p` on the graph `before` prints and compare with `expected`; the result
    verifies and a second run changes nothing."""
    got = verify(p(parse_graph(before)))
    assert_graph_equal(got, parse_graph(expected))
    assert_graph_equal(p(got), got)
    return got


def _ir(stages: str, args: str, body: str, partial: str = "") -> str:
    """A small printed graph: header, `def forward(<args>):`, body (each one line)."""
    head = f"# nncompile IR: plan_ngpus=2 stages={stages}\n"
    if partial:
        head += f"# partial_grad_params: {partial}\n"
    args = "".join(f"    {a}\n" for a in args.strip().splitlines())
    return head + f"def forward(\n{args}):\n" + "".join(
        f"    {ln.strip()}\n" for ln in body.strip().splitlines())


PLANNED, COMM = "planned", "planned,comm_inserted"
XW = """x,  # f32[4, 8] S(1)
*,
w,  # param 'w' f32[6, 8] S(1)"""

# one row of insert_comm's transition table each: (before, expected) after the plan pass
INSERT_COMM = {
    "partial_to_replicate_all_reduce_shared": (_ir(PLANNED, XW, """
        y = aten.linear.default(x, w)  # f32[4, 6] P  [split k]
        a = aten.relu.default(y)  # f32[4, 6] R  [replicate]  wants (R)
        b = aten.tanh.default(y)  # f32[4, 6] R  [replicate]  wants (R)
        return (a, b)"""), _ir(COMM, XW, """
        y = aten.linear.default(x, w)  # f32[4, 6] P  [split k]
        y_all_reduce = comm.all_reduce(y, group=PLAN_GROUP)  # f32[4, 6] R  [all_reduce]
        a = aten.relu.default(y_all_reduce)  # f32[4, 6] R  [replicate]
        b = aten.tanh.default(y_all_reduce)  # f32[4, 6] R  [replicate]
        return (a, b)""")),
    "replicate_to_shard_chunk": (_ir(PLANNED, "x,  # f32[4, 8] R", """
        h = aten.relu.default(x)  # f32[4, 8] S(0)  [split dim 0]  wants (S(0))
        return (h,)"""), _ir(COMM, "x,  # f32[4, 8] R", """
        x_chunk = comm.chunk(x, dim=0, group=PLAN_GROUP)  # f32[4, 8] S(0)  [chunk]
        h = aten.relu.default(x_chunk)  # f32[4, 8] S(0)  [split dim 0]
        h_all_gather = comm.all_gather(h, dim=0, group=PLAN_GROUP)  # f32[4, 8] R  [all_gather]
        return (h_all_gather,)""")),
    "shard_to_replicate_all_gather": (_ir(PLANNED, "x,  # f32[4, 8] S(1)", """
        h = aten.relu.default(x)  # f32[4, 8] S(1)  [split dim 1]
        z = aten.softmax.int(h, 1)  # f32[4, 8] R  [replicate]  wants (R)
        return (z,)"""), _ir(COMM, "x,  # f32[4, 8] S(1)", """
        h = aten.relu.default(x)  # f32[4, 8] S(1)  [split dim 1]
        h_all_gather = comm.all_gather(h, dim=1, group=PLAN_GROUP)  # f32[4, 8] R  [all_gather]
        z = aten.softmax.int(h_all_gather, 1)  # f32[4, 8] R  [replicate]
        return (z,)""")),
    "partial_to_shard_reduce_scatter": (_ir(PLANNED, XW, """
        y = aten.linear.default(x, w)  # f32[4, 6] P  [split k]
        h = aten.relu.default(y)  # f32[4, 6] S(0)  [split dim 0]  wants (S(0))
        return (h,)"""), _ir(COMM, XW, """
        y = aten.linear.default(x, w)  # f32[4, 6] P  [split k]
        y_reduce_scatter = comm.reduce_scatter(y, dim=0, group=PLAN_GROUP)  # f32[4, 6] S(0)  [reduce_scatter]
        h = aten.relu.default(y_reduce_scatter)  # f32[4, 6] S(0)  [split dim 0]
        h_all_gather = comm.all_gather(h, dim=0, group=PLAN_GROUP)  # f32[4, 6] R  [all_gather]
        return (h_all_gather,)""")),
    "shard_to_shard_all_to_all": (_ir(PLANNED, "x,  # f32[4, 8] S(1)", """
        h = aten.relu.default(x)  # f32[4, 8] S(1)  [split dim 1]
        z = aten.softmax.int(h, 1)  # f32[4, 8] S(0)  [split dim 0]  wants (S(0))
        return (z,)"""), _ir(COMM, "x,  # f32[4, 8] S(1)", """
        h = aten.relu.default(x)  # f32[4, 8] S(1)  [split dim 1]
        h_all_to_all = comm.all_to_all(h, src_dim=1, dst_dim=0, group=PLAN_GROUP)  # f32[4, 8] S(0)  [all_to_all]
        z = aten.softmax.int(h_all_to_all, 1)  # f32[4, 8] S(0)  [split dim 0]
        z_all_gather = comm.all_gather(z, dim=0, group=PLAN_GROUP)  # f32[4, 8] R  [all_gather]
        return (z_all_gather,)""")),
    "replicate_to_partial_bias": (_ir(PLANNED, XW + "\nb,  # param 'b' f32[6] R", """
        y = aten.linear.default(x, w, b)  # f32[4, 6] P  [split k]  wants (S(1), S(1), P)
        return (y,)"""), _ir(COMM, XW + "\nb,  # param 'b' f32[6] R", """
        b_to_partial = comm.to_partial(b, group=PLAN_GROUP)  # f32[6] P  [to_partial]
        y = aten.linear.default(x, w, b_to_partial)  # f32[4, 6] P  [split k]
        y_all_reduce = comm.all_reduce(y, group=PLAN_GROUP)  # f32[4, 6] R  [all_reduce]
        return (y_all_reduce,)""")),
    "shard_to_partial_gather_then_to_partial": (_ir(PLANNED, XW + "\nb,  # param 'b' f32[6] S(0)", """
        y = aten.linear.default(x, w, b)  # f32[4, 6] P  [split k]  wants (S(1), S(1), P)
        return (y,)"""), _ir(COMM, XW + "\nb,  # param 'b' f32[6] S(0)", """
        b_all_gather = comm.all_gather(b, dim=0, group=PLAN_GROUP)  # f32[6] R  [all_gather]
        b_all_gather_to_partial = comm.to_partial(b_all_gather, group=PLAN_GROUP)  # f32[6] P  [to_partial]
        y = aten.linear.default(x, w, b_all_gather_to_partial)  # f32[4, 6] P  [split k]
        y_all_reduce = comm.all_reduce(y, group=PLAN_GROUP)  # f32[4, 6] R  [all_reduce]
        return (y_all_reduce,)""")),
}

# gradients: a split op reading a replicated value that needs a gradient leaves partial
# gradients; sync_grad (or a gather that reduce-scatters its gradient) sums them, and a
# replicated parameter read only that way is summed by the runtime instead (partial_grad)
W12 = """x,  # f32[4, 8] R
*,
w1,  # param 'w1' f32[8, 8] R
w2,  # param 'w2' f32[6, 8] S(0)"""
W12S = W12.replace("f32[8, 8] R", "f32[8, 8] S(0)")
LN = """x,  # f32[4, 8] S(0)
*,
w,  # param 'ln.weight' f32[8] R
b,  # param 'ln.bias' f32[8] R
frozen,  # frozen param 'ln.frozen' f32[8] R"""
INSERT_COMM.update({
    "replicate_sync_grad": (_ir(PLANNED, W12, """
        h = aten.linear.default(x, w1)  # f32[4, 8] R  [replicate]
        y = aten.linear.default(h, w2)  # f32[4, 6] S(1)  [split n]
        return (y,)"""), _ir(COMM, W12, """
        h = aten.linear.default(x, w1)  # f32[4, 8] R  [replicate]
        h_sync_grad = comm.sync_grad(h, group=PLAN_GROUP)  # f32[4, 8] R  [sync_grad]
        y = aten.linear.default(h_sync_grad, w2)  # f32[4, 6] S(1)  [split n]
        y_all_gather = comm.all_gather(y, dim=1, group=PLAN_GROUP)  # f32[4, 6] R  [all_gather]
        return (y_all_gather,)""")),
    "shard_to_replicate_gather_reduces_grad": (_ir(PLANNED, W12S, """
        h = aten.linear.default(x, w1)  # f32[4, 8] S(1)  [split n]
        y = aten.linear.default(h, w2)  # f32[4, 6] S(1)  [split n]  wants (R, S(0))
        return (y,)"""), _ir(COMM, W12S, """
        h = aten.linear.default(x, w1)  # f32[4, 8] S(1)  [split n]
        h_all_gather = comm.all_gather(h, dim=1, reduce_grad=True, group=PLAN_GROUP)  # f32[4, 8] R  [all_gather]
        y = aten.linear.default(h_all_gather, w2)  # f32[4, 6] S(1)  [split n]
        y_all_gather = comm.all_gather(y, dim=1, group=PLAN_GROUP)  # f32[4, 6] R  [all_gather]
        return (y_all_gather,)""")),
    "param_partial_grad_or_sync_grad": (_ir(PLANNED, LN, """
        h = aten.layer_norm.default(x, [8], w, b, 1e-05, False)  # f32[4, 8] S(0)  [split dim 0]
        g = aten.mul.Tensor(h, frozen)  # f32[4, 8] S(0)  [split dim 0]
        o = aten.add.Tensor(g, b)  # f32[4, 8] R  [replicate]  wants (R, R)
        return (o,)"""), _ir(COMM, LN, """
        b_sync_grad = comm.sync_grad(b, group=PLAN_GROUP)  # f32[8] R  [sync_grad]
        h = aten.layer_norm.default(x, [8], w, b_sync_grad, 1e-05, False)  # f32[4, 8] S(0)  [split dim 0]
        g = aten.mul.Tensor(h, frozen)  # f32[4, 8] S(0)  [split dim 0]
        g_all_gather = comm.all_gather(g, dim=0, group=PLAN_GROUP)  # f32[4, 8] R  [all_gather]
        o = aten.add.Tensor(g_all_gather, b)  # f32[4, 8] R  [replicate]
        return (o,)""", partial="w")),
})


@pytest.mark.parametrize("case", list(INSERT_COMM))
def test_insert_comm_before_expected(case):
    before, expected = INSERT_COMM[case]
    check_pass(insert_comm, before, expected)


LOCAL = "planned,comm_inserted,localized"
LOCALIZE = {
    "size_args_become_local_and_view_reshape": (_ir(COMM, "x,  # f32[4, 8] S(1)", """
        v = aten.view.default(x, [4, 2, -1])  # f32[4, 2, 4] S(1)  [split dim 1]
        e = aten.expand.default(v, [4, 2, 4])  # f32[4, 2, 4] S(1)  [split dim 1]
        z = aten.new_zeros.default(e, [4, 2, 4], dtype=torch.float32)  # f32[4, 2, 4] S(1)  [split dim 1]
        z_all_gather = comm.all_gather(z, dim=1, group=PLAN_GROUP)  # f32[4, 2, 4] R  [all_gather]
        return (z_all_gather,)"""), _ir(LOCAL, "x,  # f32[4, 4] of [4, 8] S(1)", """
        v = aten.reshape.default(x, [4, 1, 4])  # f32[4, 1, 4] of [4, 2, 4] S(1)  [split dim 1]
        e = aten.expand.default(v, [4, 1, 4])  # f32[4, 1, 4] of [4, 2, 4] S(1)  [split dim 1]
        z = aten.new_zeros.default(e, [4, 1, 4], dtype=torch.float32)  # f32[4, 1, 4] of [4, 2, 4] S(1)  [split dim 1]
        z_all_gather = comm.all_gather(z, dim=1, group=PLAN_GROUP)  # f32[4, 2, 4] of [4, 2, 4] R  [all_gather]
        return (z_all_gather,)""")),
    "dropout_draws_through_rng_with_its_split_dim": (_ir(COMM, "x,  # f32[4, 8] S(1)", """
        d = aten.dropout.default(x, 0.5, True)  # f32[4, 8] S(1)  [split dim 1]
        d_all_gather = comm.all_gather(d, dim=1, group=PLAN_GROUP)  # f32[4, 8] R  [all_gather]
        e = aten.dropout.default(d_all_gather, 0.1, True)  # f32[4, 8] R  [replicate]
        f = aten.dropout.default(e, 0.0, True)  # f32[4, 8] R  [replicate]
        return (f,)"""), _ir(LOCAL, "x,  # f32[4, 4] of [4, 8] S(1)", """
        d = rng.dropout(x, 0.5, True, dim=1, group=PLAN_GROUP)  # f32[4, 4] of [4, 8] S(1)  [split dim 1]
        d_all_gather = comm.all_gather(d, dim=1, group=PLAN_GROUP)  # f32[4, 8] of [4, 8] R  [all_gather]
        e = rng.dropout(d_all_gather, 0.1, True, dim=None, group=PLAN_GROUP)  # f32[4, 8] of [4, 8] R  [replicate]
        f = aten.dropout.default(e, 0.0, True)  # f32[4, 8] of [4, 8] R  [replicate]
        return (f,)""")),
    "local_target_cross_entropy_rows": (_ir(COMM, "x,  # f32[4, 8] S(0)\ny,  # i64[4] S(0)", """
        loss = aten.cross_entropy_loss.default(x, y)  # f32[] P  [split rows]
        loss_all_reduce = comm.all_reduce(loss, group=PLAN_GROUP)  # f32[] R  [all_reduce]
        return (loss_all_reduce,)"""), _ir(LOCAL, "x,  # f32[2, 8] of [4, 8] S(0)\ny,  # i64[2] of [4] S(0)", """
        loss = comm.cross_entropy_rows(x, y, group=PLAN_GROUP)  # f32[] of [] P  [split rows]
        loss_all_reduce = comm.all_reduce(loss, group=PLAN_GROUP)  # f32[] of [] R  [all_reduce]
        return (loss_all_reduce,)""")),
}


@pytest.mark.parametrize("case", list(LOCALIZE))
def test_localize_before_expected(case):
    before, expected = LOCALIZE[case]
    check_pass(localize, before, expected)


def test_localize_on_one_rank_keeps_dropout_and_makes_view_a_reshape():
    """One rank draws its own random numbers (aten.dropout stays); a traced view becomes a
    reshape even there, since real kernels may return other strides than the traced fake
    ones (the CPU attention kernel under Hugging Face T5)."""
    before = _ir(COMM, "x,  # f32[4, 8] R", """
        v = aten.view.default(x, [4, 2, -1])  # f32[4, 2, 4] R  [replicate]
        d = aten.dropout.default(v, 0.5, True)  # f32[4, 2, 4] R  [replicate]
        return (d,)""").replace("plan_ngpus=2", "plan_ngpus=1")
    expected = before.replace("aten.view.default(x, [4, 2, -1])",
                              "aten.reshape.default(x, [4, 2, 4])").replace(COMM, LOCAL)
    check_pass(localize, before, expected)


# overlap_grad_sync: a sync_grad whose every user is a column linear becomes one op whose
# backward all-reduces the input gradient while the weight gradients are computed
QKV = """x,  # f32[4, 8] of [4, 8] R requires_grad
*,
w0,  # param 'w0' f32[8, 8] of [8, 8] R
wq,  # param 'wq' f32[3, 8] of [6, 8] S(0)
bq,  # param 'bq' f32[3] of [6] S(0)
wk,  # param 'wk' f32[3, 8] of [6, 8] S(0)"""
OVERLAP = {
    "column_linears_fuse": (_ir(LOCAL, QKV, """
        h = aten.linear.default(x, w0)  # f32[4, 8] of [4, 8] R  [replicate]
        h_sync_grad = comm.sync_grad(h, group=PLAN_GROUP)  # f32[4, 8] of [4, 8] R  [sync_grad]
        q = aten.linear.default(h_sync_grad, wq, bq)  # f32[4, 3] of [4, 6] S(1)  [split n]
        k = aten.linear.default(h_sync_grad, wk)  # f32[4, 3] of [4, 6] S(1)  [split n]
        a = aten.add.Tensor(q, k)  # f32[4, 3] of [4, 6] S(1)  [split dim 1]
        a_all_gather = comm.all_gather(a, dim=1, group=PLAN_GROUP)  # f32[4, 6] of [4, 6] R  [all_gather]
        return (a_all_gather,)"""), _ir(LOCAL, QKV, """
        h = aten.linear.default(x, w0)  # f32[4, 8] of [4, 8] R  [replicate]
        q, k = comm.sync_grad(h, group=PLAN_GROUP, linears=((wq, bq), (wk, None)))  # f32[4, 3] of [4, 6] S(1); f32[4, 3] of [4, 6] S(1)  [sync_grad + column linears]
        a = aten.add.Tensor(q, k)  # f32[4, 3] of [4, 6] S(1)  [split dim 1]
        a_all_gather = comm.all_gather(a, dim=1, group=PLAN_GROUP)  # f32[4, 6] of [4, 6] R  [all_gather]
        return (a_all_gather,)""")),
    # tp_sp: an all_gather whose backward reduce-scatters fuses the same way
    "reduce_grad_gather_fuses": (_ir(LOCAL, QKV.replace("f32[4, 8] of [4, 8] R requires_grad",
                                                       "f32[2, 8] of [4, 8] S(0) requires_grad"), """
        h = aten.linear.default(x, w0)  # f32[2, 8] of [4, 8] S(0)  [split dim 0]
        h_all_gather = comm.all_gather(h, dim=0, reduce_grad=True, group=PLAN_GROUP)  # f32[4, 8] of [4, 8] R  [all_gather]
        q = aten.linear.default(h_all_gather, wq, bq)  # f32[4, 3] of [4, 6] S(1)  [split n]
        q_all_gather = comm.all_gather(q, dim=1, group=PLAN_GROUP)  # f32[4, 6] of [4, 6] R  [all_gather]
        return (q_all_gather,)"""), _ir(LOCAL, QKV.replace("f32[4, 8] of [4, 8] R requires_grad",
                                                          "f32[2, 8] of [4, 8] S(0) requires_grad"), """
        h = aten.linear.default(x, w0)  # f32[2, 8] of [4, 8] S(0)  [split dim 0]
        q, = comm.all_gather(h, dim=0, reduce_grad=True, group=PLAN_GROUP, linears=((wq, bq),))  # f32[4, 3] of [4, 6] S(1)  [all_gather + column linears]
        q_all_gather = comm.all_gather(q, dim=1, group=PLAN_GROUP)  # f32[4, 6] of [4, 6] R  [all_gather]
        return (q_all_gather,)""")),
    # another user of the synced value (here a mul): nothing to fuse
    "other_user_stays": (_ir(LOCAL, QKV, """
        h = aten.linear.default(x, w0)  # f32[4, 8] of [4, 8] R  [replicate]
        h_sync_grad = comm.sync_grad(h, group=PLAN_GROUP)  # f32[4, 8] of [4, 8] R  [sync_grad]
        q = aten.linear.default(h_sync_grad, wq, bq)  # f32[4, 3] of [4, 6] S(1)  [split n]
        m = aten.mul.Tensor(h_sync_grad, h_sync_grad)  # f32[4, 8] of [4, 8] R  [replicate]
        q_all_gather = comm.all_gather(q, dim=1, group=PLAN_GROUP)  # f32[4, 6] of [4, 6] R  [all_gather]
        return (q_all_gather, m)"""), None),
}


@pytest.mark.parametrize("case", list(OVERLAP))
def test_overlap_grad_sync_before_expected(case):
    before, expected = OVERLAP[case]
    check_pass(overlap_grad_sync, before, expected or before)


@pytest.mark.parametrize("parallel, ranks, axes", [
    ({}, 4, {}),                    # the plan unit's ranks: config.plan_ngpus
    ({"cp": 2}, 2, {"cp": 2}),      # a cp axis takes its share
    ({"pp": 2}, 2, {}),             # each stage's ranks
])
def test_the_policy_gets_the_users_config_and_its_mesh_in_the_graph(parallel, ranks, axes):
    """The config is never rewritten: the policy receives the very ComputeConfig given, and
    the graph carries the mesh it plans on (its tensor ranks, the other axes); no pass holds
    a config, and every graph the passes return carries the same one."""
    seen = []

    def recording(graph, config):
        seen.append((config, tensor_ranks(graph, config), dict(graph.axes)))
        return get_policy("tp")(graph, config)
    _, _, g = traced("gpt")
    cfg = ComputeConfig(4, 4, parallel=parallel)
    passes = build_pipeline(cfg, recording)
    assert not any(isinstance(v, ComputeConfig) for p in passes
                   for v in getattr(p, "__dict__", {}).values())
    result = run_pipeline(g, passes)
    assert [(c is cfg, n, a) for c, n, a in seen] == [(True, ranks, axes)]
    assert cfg == ComputeConfig(4, 4, parallel=parallel)
    assert all(graph.config is cfg for _, graph, _ in result.history)
    assert result.graph.plan_ngpus == ranks and result.graph.mesh.size("plan") == ranks


def test_a_pass_that_needs_the_request_names_itself():
    _, _, g = traced()
    with pytest.raises(ConfigError, match="pass 'plan' reads the compile's ComputeConfig"):
        Plan(get_policy("tp"))(g)
