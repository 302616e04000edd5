"""Random ops are exact under every plan: a split dropout draws the full tensor's mask on every
rank and keeps its slice (runtime/program/rng.py), so tp/data/autodist equal one device seeded alike."""
import pytest
import torch
import torch.nn.functional as F

import nncompile
from nncompile.runtime.program import rng
from nncompile.tools.simulate import run_ranks


def test_dropout_parity_under_tp_data_autodist(run_ranks, tmp_path):
    out = run_ranks("tests/workers/dropout.py", 2, "--savedir", str(tmp_path))
    assert out.count("ok dropout") == 6


def _split_vs_whole(fn, x, dim, n=2):
    """fn on the whole tensor vs fn on n simulated ranks' pieces (concatenated), same state."""
    state = torch.get_rng_state()
    with rng.rank_generator(state):
        whole = fn(x, None)
    pieces = run_ranks(n, lambda r: _on_rank(fn, x.chunk(n, dim)[r], dim, state))
    return whole, torch.cat(pieces, dim)


def _on_rank(fn, piece, dim, state):
    with rng.rank_generator(state):
        return fn(piece, dim)


@pytest.mark.parametrize("dim", [0, 1, 2])
def test_split_dropout_equals_whole(dim):
    x = torch.randn(4, 6, 8)
    whole, split = _split_vs_whole(
        lambda t, d: rng.dropout(t, 0.5, True, dim=d, group=None), x, dim)
    assert torch.equal(whole, split)
    assert 0.3 < (whole == 0).float().mean() < 0.7
    whole, split = _split_vs_whole(
        lambda t, d: rng.native_dropout(t, 0.25, True, dim=d, group=None)[0], x, dim)
    assert torch.equal(whole, split)


def test_dropout_matches_aten_on_the_default_generator():
    x = torch.randn(8, 32)
    torch.manual_seed(3)
    want = F.dropout(x, 0.5, True)
    torch.manual_seed(3)
    assert torch.equal(rng.dropout(x, 0.5, True, dim=None, group=None), want)
    torch.manual_seed(3)
    out, mask = torch.ops.aten.native_dropout(x, 0.3, True)
    torch.manual_seed(3)
    got, got_mask = rng.native_dropout(x, 0.3, True, dim=None, group=None)
    assert torch.equal(got, out) and torch.equal(got_mask, mask)


def test_dropout_edge_cases():
    x = torch.randn(4, 4)
    assert rng.dropout(x, 0.5, False, dim=0, group=None) is x         # eval
    assert rng.dropout(x, 0.0, True, dim=0, group=None) is x
    assert torch.equal(rng.dropout(x, 1.0, True, dim=None, group=None), torch.zeros(4, 4))
    out, mask = rng.native_dropout(x, 0.5, False, dim=None, group=None)
    assert torch.equal(out, x) and bool(mask.all())


@pytest.mark.parametrize("kind", ["causal", "bool_mask", "float_mask", "gqa", "scale"])
def test_attention_dropout_matches_eager(kind):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 8, 16) for _ in range(3))
    kw = {"is_causal": kind == "causal"}
    if kind == "bool_mask":
        kw["attn_mask"] = torch.rand(8, 8) > 0.3
        kw["attn_mask"][:, 0] = True
    if kind == "float_mask":
        kw["attn_mask"] = torch.randn(2, 1, 8, 8)
    if kind == "gqa":
        k, v = k[:, :2], v[:, :2]
        kw["enable_gqa"] = True
    if kind == "scale":
        kw["scale"] = 0.3
    torch.manual_seed(5)
    want = F.scaled_dot_product_attention(q, k, v, dropout_p=0.3, **kw)
    torch.manual_seed(5)
    got = rng.scaled_dot_product_attention(q, k, v, dropout_p=0.3, dim=None, group=None, **kw)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if kind in ("causal", "scale"):     # split heads: each rank's piece of the same draw
        state = torch.get_rng_state()
        with rng.rank_generator(state):
            whole = rng.scaled_dot_product_attention(q, k, v, dropout_p=0.3, dim=None,
                                                     group=None, **kw)

        def piece(r):
            with rng.rank_generator(state):
                return rng.scaled_dot_product_attention(
                    *(t.chunk(2, 1)[r] for t in (q, k, v)), dropout_p=0.3, dim=1, group=None,
                    **kw)
        torch.testing.assert_close(torch.cat(run_ranks(2, piece), 1), whole, rtol=1e-6, atol=1e-6)


def test_verify_in_process_with_dropout(tmp_path):
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = torch.nn.Linear(16, 64), torch.nn.Linear(64, 8)

        def forward(self, x, y):
            return F.cross_entropy(self.fc2(F.dropout(F.relu(self.fc1(x)), 0.5)), y)

    torch.manual_seed(0)
    report = nncompile.verify(Net(), (torch.randn(8, 16), torch.randint(0, 8, (8,))),
                              nncompile.ComputeConfig(2), "tp", gen_savedir=tmp_path)
    assert report.ok, str(report)
