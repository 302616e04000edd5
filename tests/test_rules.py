"""Every op rule checked numerically against the unsplit op (nncompile/tools/rule_check.py): OpInfo
samples plus hand-written ones, every split strategy at n = 2 and 4, forward and backward, on
simulated ranks. A deliberately broken rule must be caught."""
import pytest

from nncompile.tools.rule_check import check_rules, collect_cases
from nncompile.rules import RULES
from nncompile.rules.einsum import einsum_strategies
from nncompile.rules.pointwise import elementwise


@pytest.fixture(scope="module")
def cases():
    """Every rule's samples, collected once (~17 s): a module fixture, so this file's tests
    run on one worker (conftest.py) and share them."""
    return collect_cases()


def test_every_rule_is_checked_and_sound(capsys, cases):
    report = check_rules(cases=cases)
    with capsys.disabled():
        print("\n" + str(report))
    assert report.ok, str(report)
    builtin = {name for name in RULES if "::" not in name}
    assert set(report.checked) == builtin
    for rule, seen in report.checked.items():
        assert {n for n, _ in seen} == {2, 4}, (rule, seen)


def _of(cases, rule):
    return [c for c in cases if c.rule == rule]


def test_a_flipped_contraction_annotation_is_caught(monkeypatch, cases):
    # the bias no longer marked additive ('=n' -> 'n'): when k is split it stays replicated
    # instead of partial, so every rank adds it and the sum counts it n times
    monkeypatch.setitem(RULES, "linear", lambda op, n: einsum_strategies(
        op, [op.args[0], op.args[1], op.args[2] if len(op.args) > 2 else None],
        "* k+, n k+, n -> * n", n))
    report = check_rules(["linear"], cases=_of(cases, "linear"))
    assert not report.ok
    assert any("linear [split k]" in f and "output 0 (P)" in f for f in report.failures), report


def test_splitting_the_softmax_dim_is_caught(monkeypatch, cases):
    monkeypatch.setitem(RULES, "softmax", lambda op, n: elementwise(op, n))
    report = check_rules(["softmax"], cases=_of(cases, "softmax"))
    assert not report.ok
    assert any("softmax [split dim" in f for f in report.failures), report


def test_grouped_attention_heads_left_whole_on_kv_is_caught(monkeypatch, cases):
    """enable_gqa: splitting q's heads while k and v stay whole pairs each rank's q heads with
    the wrong k/v groups; the samples with grouped k/v (rule_samples.py) catch it."""
    from nncompile.ir import Replicate, Shard
    from nncompile.rules.registry import make

    def q_heads_only(op, n):
        q, k, v = op.args[:3]
        return [make(op, {q: Shard(1), k: Replicate(), v: Replicate()}, [Shard(1)],
                     "split q heads")] if q.meta.shape[1] % n == 0 else []
    gqa = [c for c in _of(cases, "scaled_dot_product_attention")
           if c.op.kwargs.get("enable_gqa")]
    assert len(gqa) >= 2
    assert check_rules(["scaled_dot_product_attention"], cases=gqa).ok
    monkeypatch.setitem(RULES, "scaled_dot_product_attention", q_heads_only)
    report = check_rules(["scaled_dot_product_attention"], cases=gqa)
    assert not report.ok
    assert any("split q heads" in f for f in report.failures), report
