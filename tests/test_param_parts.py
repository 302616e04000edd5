"""A parameter the compiler holds as several parts (rows of one original fused parameter) is
invisible at every boundary with the original module: rows, take/put, merge, load, DCP."""
from __future__ import annotations

import copy

import pytest
import torch

import nncompile
from nncompile import ComputeConfig
from nncompile.errors import CheckpointError
from nncompile.ir.placement import Replicate, Shard
from nncompile.runtime.checkpoints.checkpoint import load_torch
from nncompile.rows import ParamRow, param_rows, put, take
from nncompile.runtime.checkpoints.state import with_members
from nncompile.tools.simulate import run_ranks


def test_row_reads_old_and_new_tuples():
    old5 = ("a", "l.weight", [4, 2], "S(0)", [[0, 2], [0, 2]])
    old6 = ("a", "l.weight", (4, 2), "R", ((0, 4), (0, 2)), True)
    # c.weight [6, 2] viewed (3, 2, 2); part 1 is view[1] ([2, 2]), split on its dim 1: rank 1
    new7 = ["a", "c.weight[1/3]", [2, 2], "S(1)", [[1, 2], [0, 2], [1, 2]], False,
            ["c.weight", [6, 2], [3, 2, 2]]]
    r5, r6, r7 = (ParamRow.of(r) for r in (old5, old6, new7))
    assert r5.part is None and r5.source == "l.weight" and r5.local_shape == (2, 2)
    assert r6.partial_grad and r6.placement == Replicate() and r6.local_shape == (4, 2)
    assert r7.part == ("c.weight", (6, 2), (3, 2, 2)) and r7.source == "c.weight"
    assert r7.local_shape == (2, 1) and r7.source_shape == (6, 2)
    assert ParamRow.of(list(r7.plain())) == r7          # saved plan_info round trip
    assert param_rows({"params": [new7]})[0] == r7
    assert len(r6.plain()) == 6                         # an ordinary row prints as before
    w = torch.arange(12.).reshape(6, 2)
    assert torch.equal(take(r7, w), w[2:4, 1:2])


def test_take_put_roundtrip_rows_and_interleaved():
    # nanoGPT: c_attn [3C, C], C = 2: q, k, v rows, each split in 2 by rows
    full = torch.arange(24.).reshape(6, 4)
    out = torch.zeros(6, 4)
    for rank in range(2):
        for i in range(3):
            r = ParamRow(f"w{i}", f"w[{i}/3]", (2, 4), Shard(0),
                         ((2 * i + rank, 2 * i + rank + 1), (0, 4)), False, ("w", (6, 4), (6, 4)))
            local = take(r, full)
            assert tuple(local.shape) == r.local_shape == (1, 4)
            assert torch.equal(local, full[2 * i + rank:2 * i + rank + 1])
            put(r, out, local)
    assert torch.equal(out, full)
    # interleaved (GPT-NeoX style): [heads * 3 * d, C] viewed as (heads, 3, d, C); part k = [:, 1]
    H, d, C = 4, 2, 3
    full = torch.randn(H * 3 * d, C)
    view = (H, 3, d, C)
    k_full = full.reshape(view)[:, 1].reshape(H * d, C)
    out = torch.zeros_like(full)
    got = []
    for rank in range(2):
        box = ((rank * 2, rank * 2 + 2), (1, 2), (0, d), (0, C))
        r = ParamRow("k", "qkv.weight[1/3]", (H * d, C), Shard(0), box, False,
                     ("qkv.weight", tuple(full.shape), view))
        local = take(r, full)
        assert r.local_shape == (H * d // 2, C)
        got.append(local)
        put(r, out, local)
    assert torch.equal(torch.cat(got), k_full)
    assert torch.equal(out.reshape(view)[:, 1], full.reshape(view)[:, 1])
    assert torch.count_nonzero(out.reshape(view)[:, 0]) == 0
    # a replicated part and a Shard(1) part
    r = ParamRow("q", "qkv.weight[0/3]", (H * d, C), Replicate(), ((0, H), (0, 1), (0, d), (0, C)),
                 False, ("qkv.weight", tuple(full.shape), view))
    assert r.local_shape == (H * d, C)
    assert torch.equal(take(r, full), full.reshape(view)[:, 0].reshape(H * d, C))
    w = torch.randn(6, 4)
    r = ParamRow("v", "w[2/3]", (2, 4), Shard(1), ((4, 6), (2, 4)), False, ("w", (6, 4), (6, 4)))
    assert r.local_shape == (2, 2) and torch.equal(take(r, w), w[4:6, 2:4])
    # a plain row and a non-contiguous target
    p = ParamRow("p", "l.weight", (4, 6), Shard(1), ((0, 4), (3, 6)))
    assert torch.equal(take(p, w.t()), w.t()[:, 3:])
    tgt = torch.zeros(4, 6).t()
    put(r, tgt, take(r, w))
    assert torch.equal(tgt[4:6, 2:4], w[4:6, 2:4])


# ---- merge and load_merged with hand-made plans ----------------------------------------------
def _rank_rows(rank: int, n: int, layout: str) -> list[ParamRow]:
    """The rows rank `rank` of `n` holds of a small attention block in one of two layouts:
    "mqa" (c_attn [C + 2d, C]: q split by heads, k and v replicated; c_proj split by columns)
    or "neox" (qkv [H * 3 * d, C] interleaved per head, viewed as (H, 3, d, C))."""
    C, H, d = 8, 4, 2
    rows = []
    if layout == "mqa":
        w, b = ("attn.c_attn.weight", (C + 2 * d, C)), ("attn.c_attn.bias", (C + 2 * d,))
        for src, shape in (w, b):
            tail = shape[1:]
            starts = (0, C, C + d)
            sizes = (C, d, d)
            for i, (lo, size) in enumerate(zip(starts, sizes)):
                if i == 0:
                    s = size // n
                    box, place = ((lo + rank * s, lo + (rank + 1) * s),), Shard(0)
                else:
                    box, place = ((lo, lo + size),), Replicate()
                rows.append(ParamRow(f"{src.replace('.', '_')}_{i}", f"{src}[{i}/3]",
                                     (size, *tail), place, box + tuple((0, t) for t in tail),
                                     False, (src, shape, shape)))
    else:
        for src, shape, view in (("attn.qkv.weight", (H * 3 * d, C), (H, 3, d, C)),
                                 ("attn.qkv.bias", (H * 3 * d,), (H, 3, d))):
            h = H // n
            for i in range(3):
                box = ((rank * h, (rank + 1) * h), (i, i + 1), *((0, t) for t in view[2:]))
                rows.append(ParamRow(f"{src.replace('.', '_')}_{i}", f"{src}[{i}/3]",
                                     (H * d, *shape[1:]), Shard(0), box, False,
                                     (src, shape, view)))
    s = C // n
    rows.append(ParamRow("attn_c_proj_weight", "attn.c_proj.weight", (C, C), Shard(1),
                         ((0, C), (rank * s, (rank + 1) * s)), True))
    return rows


def _order(layout: str) -> list[str]:
    return (["attn.c_attn.weight", "attn.c_attn.bias"] if layout == "mqa" else
            ["attn.qkv.weight", "attn.qkv.bias"]) + ["attn.c_proj.weight"]


def _plan(rank: int, n: int, layout: str) -> dict:
    order = _order(layout)
    return {"fingerprint": "f", "policy": "tp", "rank": rank, "plan_ngpus": n,
            "runtime_ngpus": n, "params": [list(r.plain()) for r in _rank_rows(rank, n, layout)],
            "buffers": [], "param_order": order, "frozen": [],
            "state_keys": [[k, k] for k in order], "pipe_ranks": 1}


def _full_state(layout: str, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = {r.source: r.source_shape for r in _rank_rows(0, 2, layout)}
    return {k: torch.randn(shapes[k], generator=g) for k in _order(layout)}


@pytest.mark.parametrize("layout", ["mqa", "neox"])
def test_merge_parts_from_two_ranks_gives_the_original(layout):
    full = _full_state(layout)
    moments = _full_state(layout, seed=1)
    model_sds, opt_sds = [], []
    for rank in range(2):
        rows = _rank_rows(rank, 2, layout)
        model_sds.append({**{r.name: take(r, full[r.source]).clone() for r in rows},
                          "_extra_state": _plan(rank, 2, layout)})
        opt_sds.append({"state": {i: {"step": torch.tensor(3.0),
                                      "exp_avg": take(r, moments[r.source]).clone()}
                                  for i, r in enumerate(rows)},
                        "param_groups": [{"lr": 0.1, "params": list(range(len(rows)))}]})
    model, opt = nncompile.merge_state_dicts(model_sds, opt_sds)
    assert list(model) == _order(layout)
    for k in full:
        assert torch.equal(model[k], full[k]), k
    assert opt["param_groups"][0]["param_names"] == _order(layout)
    for i, k in enumerate(_order(layout)):
        assert torch.equal(opt["state"][i]["exp_avg"], moments[k]), k
        assert float(opt["state"][i]["step"]) == 3.0
    # one rank alone does not cover the split parts
    with pytest.raises(CheckpointError, match="do not cover"):
        nncompile.merge_state_dicts(model_sds[:1])


class _FakePM(torch.nn.Module):
    """What load_merged_state_dict reads of a ParallelModule: its rows and local tensors."""

    def __init__(self, rank: int, layout: str):
        super().__init__()
        info = _plan(rank, 2, layout)
        self.PARAMS, self.BUFFERS = info["params"], []
        self.PARAM_ORDER, self.FROZEN = info["param_order"], []
        self.STATE_KEYS = [tuple(k) for k in info["state_keys"]]
        self.zero = None
        for r in param_rows(self):
            self.register_parameter(r.name, torch.nn.Parameter(torch.zeros(r.local_shape)))

    def load_local_tensors(self, tensors):
        with torch.no_grad():
            for n, t in tensors.items():
                getattr(self, n).copy_(t)


@pytest.mark.parametrize("layout", ["mqa", "neox"])
def test_load_merged_gives_each_rank_its_parts(layout):
    full = _full_state(layout)
    moments = _full_state(layout, seed=1)
    order = _order(layout)
    merged_opt = {"state": {i: {"step": torch.tensor(5.0), "exp_avg": moments[k]}
                            for i, k in enumerate(order)},
                  "param_groups": [{"lr": 0.5, "params": list(range(len(order))),
                                    "param_names": order}]}
    for rank in range(2):
        pm = _FakePM(rank, layout)
        opt = torch.optim.AdamW(pm.parameters(), lr=0.1)
        nncompile.load_merged_state_dict(pm, full, opt, merged_opt)
        for r in param_rows(pm):
            assert torch.equal(getattr(pm, r.name), take(r, full[r.source])), r.fqn
            st = opt.state[getattr(pm, r.name)]
            assert torch.equal(st["exp_avg"], take(r, moments[r.source])), r.fqn
            assert float(st["step"]) == 5.0
        steps = [opt.state[p]["step"] for p in pm.parameters()]
        assert len({id(s) for s in steps}) == len(steps)     # one step counter per part
        assert opt.param_groups[0]["lr"] == 0.5
    bad = {**full, order[0]: full[order[0]][1:]}
    with pytest.raises(CheckpointError, match="shape"):
        nncompile.load_merged_state_dict(_FakePM(0, layout), bad)


# ---- end to end: a fused c_attn under tp at plan 2, simulated ranks --------------------------
class _Attn(torch.nn.Module):
    def __init__(self, C: int, H: int):
        super().__init__()
        self.C, self.H = C, H
        self.c_attn = torch.nn.Linear(C, 3 * C)
        self.c_proj = torch.nn.Linear(C, C)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(self.C, dim=2)
        q, k, v = (t.view(B, T, self.H, C // self.H).transpose(1, 2) for t in (q, k, v))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class _MQAttn(torch.nn.Module):
    """GPT-BigCode's multi-query layout: c_attn [C + 2d, C] cut into q | k | v."""

    def __init__(self, C: int, H: int):
        super().__init__()
        self.H, self.d = H, C // H
        self.c_attn = torch.nn.Linear(C, C + 2 * self.d)
        self.c_proj = torch.nn.Linear(C, C)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split([C, self.d, self.d], dim=2)
        q = q.view(B, T, self.H, self.d).transpose(1, 2)
        k, v = (t.view(B, T, 1, self.d).transpose(1, 2).expand(B, self.H, T, self.d)
                for t in (k, v))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


class _NeoXAttn(torch.nn.Module):
    """GPT-NeoX's interleaved layout: per head [q_h; k_h; v_h] rows of one fused weight."""

    def __init__(self, C: int, H: int):
        super().__init__()
        self.H, self.d = H, C // H
        self.qkv = torch.nn.Linear(C, 3 * C)
        self.dense = torch.nn.Linear(C, C)

    def forward(self, x):
        B, T, C = x.shape
        qkv = self.qkv(x).view(B, T, self.H, 3 * self.d).permute(0, 2, 1, 3)
        d = self.d
        q, k, v = qkv[..., :d], qkv[..., d:2 * d], qkv[..., 2 * d:]
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.dense(y.transpose(1, 2).reshape(B, T, C))


ATTN = {"nanogpt": (_Attn, "c_attn"), "mqa": (_MQAttn, "c_attn"), "neox": (_NeoXAttn, "qkv")}


class _TinyGPT(torch.nn.Module):
    """nanoGPT's layout, one block: a fused q/k/v projection, MLP, untied head."""

    def __init__(self, attn: str, V: int = 32, C: int = 16, H: int = 4, T: int = 8):
        super().__init__()
        self.wte, self.wpe = torch.nn.Embedding(V, C), torch.nn.Embedding(T, C)
        self.ln_1, self.attn = torch.nn.LayerNorm(C), ATTN[attn][0](C, H)
        self.ln_2, self.ln_f = torch.nn.LayerNorm(C), torch.nn.LayerNorm(C)
        self.fc, self.proj = torch.nn.Linear(C, 4 * C), torch.nn.Linear(4 * C, C)
        self.head = torch.nn.Linear(C, V, bias=False)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        x = x + self.attn(self.ln_1(x))
        x = x + self.proj(torch.nn.functional.gelu(self.fc(self.ln_2(x))))
        logits = self.head(self.ln_f(x))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


WORLD, STEPS = 2, 3


def _adamw(named):
    """nanoGPT's groups (weight decay on the 2-D weights: c_attn's weight parts are 2-D, its
    bias parts 1-D). eps well above the rounding noise of c_attn's k bias, whose exact
    gradient is zero (a per-query constant in the scores): Adam would blow it up to steps."""
    named = list(named)
    return torch.optim.AdamW([
        {"params": [p for _, p in named if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0}], lr=1e-2, eps=1e-3)


def _batches(n: int = STEPS + 1) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [{"idx": torch.randint(0, 32, (4, 8), generator=g),
             "targets": torch.randint(0, 32, (4, 8), generator=g)} for _ in range(n)]


def _mine(b: dict, rank: int, plan: int, world: int = WORLD) -> dict:
    """This rank's data-parallel unit's rows of a global batch."""
    units = world // plan
    rows, unit = b["idx"].shape[0] // units, rank // plan
    return {k: v[unit * rows:(unit + 1) * rows] for k, v in b.items()}


def _step(model, opt, b) -> float:
    """One step; the gradients' global norm (clipping at a bound it never reaches)."""
    model(**b).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
    opt.step()
    opt.zero_grad()
    return float(norm)


@pytest.fixture(scope="module", params=list(ATTN))
def tiny(request):
    torch.manual_seed(0)
    model = _TinyGPT(request.param)
    ref = copy.deepcopy(model)
    opt = _adamw(ref.named_parameters())
    states = []
    for b in _batches():
        norm = _step(ref, opt, b)
        states.append((copy.deepcopy(ref.state_dict()), copy.deepcopy(opt.state_dict()), norm))
    return model, states, request.param    # states[i]: after i + 1 steps on one device


def _close(got: dict, want: dict, what: str) -> None:
    assert list(got) == list(want), what
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{what} {k}: {m}")


def _parallelize(model, gen, plan: int, policy: str, rank: int, world: int = WORLD, **cfg):
    return nncompile.parallelize(copy.deepcopy(model), _mine(_batches(1)[0], rank, plan, world),
                                 ComputeConfig(plan, world, **cfg), pas_policy=policy,
                                 gen_savedir=gen, instance_name=f"parts_{policy}{plan}x{world}"
                                 + "".join(f"_{k}{v}" for k, v in cfg.items()))


def test_tp_parts_checkpoint_merge_dcp_end_to_end(tiny, tmp_path):
    model, ref, kind = tiny
    fused = f"attn.{ATTN[kind][1]}"
    gen, ck = tmp_path / "gen", tmp_path / "ck"

    def train(rank):
        module = copy.deepcopy(model)
        opt = _adamw(module.named_parameters())    # built before, as nanoGPT does
        pm = nncompile.parallelize(module, _batches(1)[0], ComputeConfig(2, WORLD),
                                   pas_policy="tp", gen_savedir=gen, instance_name="parts_tp2")
        parts = [r for r in param_rows(pm) if r.part is not None]
        norms = [_step(pm, opt, b) for b in _batches(STEPS)]
        for fmt in ("dcp", "sharded", "deduped"):
            nncompile.save_checkpoint(ck / f"tp_{fmt}", pm, opt, format=fmt)
        opt_sd = with_members(pm, opt, opt.state_dict())       # each group's members by FQN
        return parts, pm.gather_params(), pm.local_state_dict(), opt_sd, norms
    out = run_ranks(WORLD, train)
    parts = out[0][0]
    assert {r.source for r in parts} == {f"{fused}.weight", f"{fused}.bias"}, parts
    assert any(r.sharded for r in parts)                       # q, k and v split by heads
    want_sd, want_opt, _ = ref[STEPS - 1]
    for rank in range(WORLD):     # parts split or replicated, each counted once in the norm
        assert out[rank][4] == pytest.approx([r[2] for r in ref[:STEPS]], rel=1e-5)
    for rank in range(WORLD):
        _close(out[rank][1], want_sd, f"gather_params rank {rank}")
    merged, merged_opt = nncompile.merge_state_dicts([o[2] for o in out], [o[3] for o in out])
    _check_merged(merged, merged_opt, want_sd, want_opt, "merge_state_dicts")
    for fmt in ("dcp", "sharded", "deduped"):
        blob = load_torch(nncompile.merge_checkpoint([ck / f"tp_{fmt}"], ck / f"{fmt}.pt"))
        _check_merged(blob["model"], blob["optimizer"], want_sd, want_opt, f"merged {fmt}")

    def resume(rank):
        got = {}
        pm = _parallelize(model, gen, 2, "tp", rank)            # merged -> tp with parts
        opt = _adamw(pm.named_parameters())
        nncompile.load_merged_state_dict(pm, merged, opt, merged_opt)
        _step(pm, opt, _batches()[STEPS])
        got["merged"] = pm.gather_params()
        for fmt in ("sharded", "deduped"):                      # the same plan's own shards
            pm = _parallelize(model, gen, 2, "tp", rank)
            opt = _adamw(pm.named_parameters())
            nncompile.load_checkpoint(ck / f"tp_{fmt}", pm, opt)
            _step(pm, opt, _batches()[STEPS])
            got[fmt] = pm.gather_params()
        pm = _parallelize(model, gen, 1, "dp", rank)            # dcp: tp with parts -> dp
        opt = _adamw(pm.named_parameters())
        nncompile.load_checkpoint(ck / "tp_dcp", pm, opt)
        nncompile.save_checkpoint(ck / "dp", pm, opt, format="dcp")
        _step(pm, opt, _mine(_batches()[STEPS], rank, 1))
        got["dcp tp->dp"] = pm.gather_params()
        pm = _parallelize(model, gen, 2, "tp", rank)            # dcp: dp -> tp with parts
        opt = _adamw(pm.named_parameters())
        nncompile.load_checkpoint(ck / "dp", pm, opt)
        _step(pm, opt, _batches()[STEPS])
        got["dcp dp->tp"] = pm.gather_params()
        module = copy.deepcopy(model)          # nanoGPT's resume: the original module and its
        module.load_state_dict(merged)         # optimizer loaded, then parallelized: the
        opt = _adamw(module.named_parameters())      # optimizer adopts the parts, moments cut
        opt.load_state_dict(copy.deepcopy(merged_opt))    # (ranks are threads: own copies)
        pm = nncompile.parallelize(module, _batches(1)[0], ComputeConfig(2, WORLD),
                                   pas_policy="tp", gen_savedir=gen, instance_name="parts_tp2")
        _step(pm, opt, _batches()[STEPS])
        got["adopted"] = pm.gather_params()
        module = copy.deepcopy(model)           # the same, rebuilt for ZeRO-1: state carried
        module.load_state_dict(merged)
        opt = _adamw(module.named_parameters())
        opt.load_state_dict(copy.deepcopy(merged_opt))
        pm = nncompile.parallelize(module, _batches(1)[0], ComputeConfig(2, WORLD, use_zero=1),
                                   pas_policy="tp", gen_savedir=gen, instance_name="parts_z1")
        opt = nncompile.build_optimizer(pm, opt)
        _step(pm, opt, _batches()[STEPS])
        got["carried"] = pm.gather_params()
        pm = _parallelize(model, gen, 2, "tp", rank, use_zero=3)    # ZeRO-3 pieces of parts
        init = pm.gather_params()                                   # cut from the module
        opt = _adamw(pm.named_parameters())
        nncompile.load_merged_state_dict(pm, merged, opt, merged_opt)
        _step(pm, opt, _batches()[STEPS])
        got["zero3"] = pm.gather_params()
        return got, pm.local_state_dict(), opt.state_dict(), init
    want, want_opt, _ = ref[STEPS]
    out = run_ranks(WORLD, resume)
    for rank, (got, _, _, init) in enumerate(out):
        _close(init, model.state_dict(), f"ZeRO-3 initial weights, rank {rank}")
        for how, full in got.items():
            _close(full, want, f"{how}, rank {rank}")
    merged, merged_opt = nncompile.merge_state_dicts([o[1] for o in out], [o[2] for o in out])
    _check_merged(merged, merged_opt, want, want_opt, "merged ZeRO-3")


def _check_merged(model: dict, opt: dict, want: dict, want_opt: dict, what: str) -> None:
    """A merged checkpoint is the one-device module's and optimizer's state dicts."""
    _close(model, want, f"{what} model")
    assert [(g["params"], g["weight_decay"]) for g in opt["param_groups"]] == \
        [(g["params"], g["weight_decay"]) for g in want_opt["param_groups"]], what
    assert sorted(opt["state"]) == sorted(want_opt["state"]), what
    for i, st in want_opt["state"].items():
        _close(opt["state"][i], st, f"{what} optimizer state {i}")


def test_parts_with_data_parallel_units(tmp_path):
    """tp at plan 2 on 4 ranks (2 data-parallel units): parts are assembled over their plan
    unit only (multi-query k and v: replicated parts, counted once); merged and dcp
    checkpoints load under dp."""
    torch.manual_seed(0)
    model = _TinyGPT("mqa")
    ref = copy.deepcopy(model)
    opt = _adamw(ref.named_parameters())
    for b in _batches():
        _step(ref, opt, b)
    gen, ck = tmp_path / "gen", tmp_path / "ck"

    def rank_fn(rank):
        pm = _parallelize(model, gen, 2, "tp", rank, world=4)
        assert any(r.part is not None and not r.sharded for r in param_rows(pm))
        opt = _adamw(pm.named_parameters())
        for b in _batches(STEPS):
            _step(pm, opt, _mine(b, rank, 2, world=4))
        nncompile.save_checkpoint(ck, pm, opt, format="dcp")
        sd = pm.local_state_dict()
        pm = _parallelize(model, gen, 1, "dp", rank, world=4)
        opt = _adamw(pm.named_parameters())
        nncompile.load_checkpoint(ck, pm, opt)
        _step(pm, opt, _mine(_batches()[STEPS], rank, 1, world=4))
        return sd, pm.gather_params()
    out = run_ranks(4, rank_fn)
    merged, _ = nncompile.merge_state_dicts([sd for sd, _ in out])
    one = copy.deepcopy(model)
    opt = _adamw(one.named_parameters())
    for b in _batches(STEPS):
        _step(one, opt, b)
    _close(merged, one.state_dict(), "merged over 2 data-parallel units")
    for rank, (_, full) in enumerate(out):
        _close(full, ref.state_dict(), f"dcp tp x dp -> dp, rank {rank}")


@pytest.mark.parametrize("kind", list(ATTN))
def test_parts_leave_no_parameter_of_pm_local(kind, tmp_path):
    """nanoGPT's own model under tp (a fused q|k|v weight held as parts): every one of
    pm.parameters() is a DTensor, the parts each a DTensor of its own, so a per-parameter
    read (`p.grad.norm().item()`, a DDP habit) is one device's value or a ValueReadError,
    never this rank's piece; the module keeps the fused weight released, and its other
    parameters are the same objects as pm's."""
    torch.manual_seed(0)
    model = _TinyGPT(kind)
    batch = _batches(1)[0]
    ref = copy.deepcopy(model)
    ref(**batch).backward()
    grads = {n: p.grad for n, p in ref.named_parameters()}

    def want(row) -> float:      # a parameter read whole is replicated: its piece is all of
        return float(take(row, grads[row.source]).norm())    # it (a part: its rows)

    def rank_fn(rank):
        module = copy.deepcopy(model)
        pm = nncompile.parallelize(module, batch, ComputeConfig(2, WORLD), pas_policy="tp",
                                   gen_savedir=tmp_path, instance_name=f"local_{kind}")
        pm(**batch).backward()
        rows = {r.fqn: r for r in param_rows(pm)}
        reads = {}
        for n, p in pm.named_parameters():
            try:
                reads[n] = (p.grad.norm().item(), want(rows[n]))
            except nncompile.ValueReadError:
                reads[n] = "ValueReadError"
        kinds = {type(p).__name__ for p in pm.parameters()}
        shared = {n for n, p in module.named_parameters() if any(p is q for q in pm.parameters())}
        return reads, kinds, shared
    reads, kinds, shared = run_ranks(WORLD, rank_fn)[0]
    assert kinds == {"DTensor"}, kinds
    assert any("[" in n for n in reads), reads              # the parts, each its own
    for n, got in reads.items():
        if got != "ValueReadError":
            assert abs(got[0] - got[1]) <= 1e-5 * got[1] + 1e-8, (n, got)   # (a k bias:
                                                            # zero up to rounding, ~1e-10)
    fused = {n for n, _ in model.named_parameters() if n.startswith(f"attn.{ATTN[kind][1]}.")}
    assert shared == {n for n, _ in model.named_parameters()} - fused, (shared, fused)
