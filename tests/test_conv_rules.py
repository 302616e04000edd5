"""Convolution and batch-norm rules (nncompile/rules/conv.py): every strategy checked against
the unsplit op (forward and backward, n = 2 and 4), wrong annotations caught, and a ResNet-style
CNN with BatchNorm that autodist, under a memory limit the replicated plan exceeds, plans with
its conv weights split and trains like one device."""
import copy
import json

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import nncompile
from nncompile import ComputeConfig
from nncompile.frontend import trace
from nncompile.ir import P, Replicate, Shard
from nncompile.passes.autodist import plan_problem, replicated_memory
from nncompile.tools.rule_check import check_rules, collect_cases
from nncompile.rules import LOCAL_ARGS, RULES
from nncompile.rules.conv import batch_norm, convolution
from nncompile.rules.registry import make
from nncompile.rows import buffer_rows
from nncompile.tools.simulate import run_ranks

CONV_RULES = ["convolution", "conv1d", "conv2d", "conv3d", "conv_transpose1d",
              "conv_transpose2d", "conv_transpose3d", "batch_norm",
              "_native_batch_norm_legit_functional", "_native_batch_norm_legit_no_training",
              "pad", "constant_pad_nd", "relu6", "hardswish", "hardsigmoid"]
_CASES = {}


def _cases(rules=tuple(CONV_RULES)):
    if rules not in _CASES:
        _CASES[rules] = collect_cases(list(rules), opinfo_limit=0)
    return _CASES[rules]


def test_every_conv_and_batch_norm_strategy_is_sound():
    report = check_rules(CONV_RULES, cases=_cases())
    assert report.ok, str(report)
    for rule in CONV_RULES:
        assert {n for n, _ in report.checked[rule]} == {2, 4}, (rule, report.checked[rule])
    notes = {note for seen in report.checked.values() for _, note in seen}
    assert {"split batch", "split out channels", "split in channels", "split groups",
            "split channels", "split dim 0"} <= notes, notes


def test_a_bias_not_partial_under_an_input_channel_split_is_caught(monkeypatch):
    """Splitting input channels leaves partial sums; a bias every rank adds (R instead of P)
    is counted n times."""
    def replicated_bias(op, n):
        out = convolution(op, n)
        b = op.args[2]
        return [make(op, {op.args[0]: s.inputs[0], op.args[1]: s.inputs[1], b: Replicate()},
                     s.outputs, s.note) if s.note == "split in channels" else s for s in out]
    cases = [c for c in _cases(("convolution",)) if c.op.args[2] is not None]
    monkeypatch.setitem(RULES, "convolution", replicated_bias)
    report = check_rules(["convolution"], cases=cases)
    assert any("[split in channels]" in f and "output 0 (P)" in f for f in report.failures), \
        report


def test_grouped_convolutions_need_whole_groups_and_local_groups(monkeypatch):
    """A grouped convolution split on input channels as an ordinary one is (weight dim 1,
    partial sums) mixes groups; its split by groups without localize's groups // n runs the
    wrong groups: both caught."""
    def as_ordinary(op, n):
        x, w = op.args[:2]
        return [make(op, {x: Shard(1), w: Shard(1)}, [P], "split in channels of groups")]
    cases = [c for c in _cases(("convolution",))
             if c.op.args[8] > 1 and c.op.args[1].meta.shape[1] % 2 == 0]
    assert cases and check_rules(["convolution"], cases=cases).ok
    monkeypatch.delitem(LOCAL_ARGS, "convolution")
    report = check_rules(["convolution"], cases=cases)
    assert any("[split groups]" in f for f in report.failures), report
    monkeypatch.setitem(RULES, "convolution", as_ordinary)
    report = check_rules(["convolution"], cases=cases, ns=(2,))
    assert any("[split in channels of groups]" in f for f in report.failures), report


def test_a_batch_split_of_training_batch_norm_is_caught(monkeypatch):
    """Training batch norm split on the batch normalizes each rank with its own rows'
    statistics: caught; the channel split the rule offers is exact."""
    name = "_native_batch_norm_legit_functional"

    def with_batch_split(op, n):
        x = op.args[0]
        return batch_norm(op, n) + [make(op, {x: Shard(0)}, [Shard(0)] + [P] * 4,
                                         "split batch")]
    monkeypatch.setitem(RULES, name, with_batch_split)
    report = check_rules([name], cases=_cases((name,)))
    assert any(f.startswith(f"{name} [split batch]") for f in report.failures), report
    assert not any("[split channels]" in f for f in report.failures), report


# ---- a ResNet-style CNN under autodist with a memory limit ---------------------------------

C, STEPS = 32, 3


class Block(nn.Module):
    """conv-bn-relu-conv-bn plus the identity shortcut, then relu (ResNet's BasicBlock)."""

    def __init__(self, c: int):
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x):
        return F.relu(x + self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))))


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, C, 3, padding=1, bias=False), nn.BatchNorm2d(C),
                                  nn.ReLU())
        self.blocks = nn.ModuleList(Block(C) for _ in range(2))
        self.depthwise = nn.Sequential(nn.Conv2d(C, C, 3, padding=1, groups=C),
                                       nn.BatchNorm2d(C), nn.ReLU())
        self.fc = nn.Linear(C, 10)

    def forward(self, x, y):
        h = self.stem(x)
        for block in self.blocks:
            h = block(h)
        return F.cross_entropy(self.fc(self.depthwise(h).mean((2, 3))), y)


def _batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 3, 8, 8, generator=g) * 2 + 0.5,
             torch.randint(0, 10, (4,), generator=g)) for _ in range(STEPS)]


def _full_buffers(pm) -> dict[str, torch.Tensor]:
    """Buffers by FQN, split ones all-gathered over the plan unit."""
    out = {}
    for row in buffer_rows(pm):
        t = getattr(pm, row.name).detach().clone()
        if isinstance(row.placement, Shard):
            parts = [torch.empty_like(t) for _ in range(pm.PLAN_NGPUS)]
            dist.all_gather(parts, t.contiguous(), group=pm.plan_group)
            t = torch.cat(parts, row.placement.dim)
        out[row.fqn] = t
    return out


def _train(model, opt, batches) -> list[float]:
    """SGD steps over `batches`; the losses."""
    losses = []
    for x, y in batches:
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_cnn_under_a_memory_limit_splits_conv_weights_and_trains_like_one_device(tmp_path):
    torch.manual_seed(0)
    model = CNN()
    batches = _batches()
    # the limit: 60 % of what the replicated plan needs per rank
    _, prob = plan_problem(trace(copy.deepcopy(model), batches[0]),
                           ComputeConfig(2, 2, parallel={"device": "cpu"}))
    limit = 0.6 * replicated_memory(prob) / 1e9
    config = ComputeConfig(2, 2, parallel={"device": "cpu", "mem_limit_gb": limit})

    ref = copy.deepcopy(model)
    ref_losses = _train(ref, torch.optim.SGD(ref.parameters(), lr=0.1), batches)

    def rank_fn(rank):
        pm = nncompile.parallelize(copy.deepcopy(model), batches[0], config,
                                   pas_policy="autodist", gen_savedir=tmp_path)
        losses = _train(pm, nncompile.build_optimizer(pm, torch.optim.SGD, lr=0.1), batches)
        return losses, pm.gather_params(), _full_buffers(pm)

    out = run_ranks(2, rank_fn)
    plan = json.loads((tmp_path / "CNN" / "plan.json").read_text())
    assert plan["autodist"]["memory_gb"] <= limit
    convs = {k: v for k, v in plan["params"].items() if v != "R" and
             k.endswith(".weight") and model.get_parameter(k).dim() == 4}
    assert len(convs) >= 3, plan["params"]
    notes = {o["strategy"] for o in plan["ops"] if o["op"] == "aten.conv2d.default"}
    assert "split groups" in notes, notes                 # the depthwise conv, by groups
    code = (tmp_path / "CNN" / "gencode0.py").read_text()
    assert f"{C // 2})" in next(line for line in code.splitlines()
                                if "depthwise0_conv2d = " in line), code
    for losses, params, buffers in out:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses),
                                   rtol=1e-5, atol=1e-6)
        for fqn, want in ref.named_parameters():
            torch.testing.assert_close(params[fqn], want.detach(), rtol=1e-5, atol=1e-6,
                                       msg=lambda m, fqn=fqn: f"{fqn}: {m}")
        for fqn, want in ref.named_buffers():
            torch.testing.assert_close(buffers[fqn], want, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, fqn=fqn: f"{fqn}: {m}")


class InvertedResidual(nn.Module):
    """MobileNetV2's block: 1x1 expand-bn-relu6, pad, depthwise 3x3-bn-relu6, 1x1 reduce-bn,
    plus the shortcut."""

    def __init__(self, c: int, expand: int = 4):
        super().__init__()
        h = c * expand
        self.expand, self.bn1 = nn.Conv2d(c, h, 1, bias=False), nn.BatchNorm2d(h)
        self.dw, self.bn2 = nn.Conv2d(h, h, 3, groups=h, bias=False), nn.BatchNorm2d(h)
        self.reduce, self.bn3 = nn.Conv2d(h, c, 1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x):
        h = F.pad(F.relu6(self.bn1(self.expand(x))), (1, 1, 1, 1))
        return x + self.bn3(self.reduce(F.relu6(self.bn2(self.dw(h)))))


class MobileNetish(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(InvertedResidual(8) for _ in range(2))
        self.fc = nn.Linear(8, 10)

    def forward(self, x, y):
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.fc(x.mean((2, 3))), y)


def test_tp_splits_inverted_residual_blocks_with_one_all_reduce_each(tmp_path):
    """tp: expand conv split on output channels, its batch norm and the depthwise conv on
    channels / groups, the reduce conv on input channels (partial sums): one forward
    all-reduce per block; gradients and running statistics equal one device's (float64: the
    batch norms' gradients are ill-conditioned enough that float32 rounding shows)."""
    torch.manual_seed(0)
    model = MobileNetish().double()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 8, 6, 6, generator=g, dtype=torch.float64)
    y = torch.randint(0, 10, (4,), generator=g)
    ref = copy.deepcopy(model)
    want = ref(x, y)
    want.backward()

    def rank_fn(rank):
        pm = nncompile.parallelize(copy.deepcopy(model), (x, y), ComputeConfig(2, 2),
                                   pas_policy="tp", gen_savedir=tmp_path)
        loss = pm(x, y)
        loss.backward()
        return loss.item(), pm.gather_grads(), _full_buffers(pm)

    out = run_ranks(2, rank_fn)
    plan = json.loads((tmp_path / "MobileNetish" / "plan.json").read_text())
    for i in range(2):
        p = {k.split(f"blocks.{i}.")[1]: v for k, v in plan["params"].items()
             if k.startswith(f"blocks.{i}.")}
        assert (p["expand.weight"], p["dw.weight"], p["reduce.weight"]) == \
            ("S(0)", "S(0)", "S(1)"), p
        assert p["bn1.weight"] == p["bn2.weight"] == "S(0)", p
    assert plan["collectives"]["comm.all_reduce"] == 2, plan["collectives"]
    for loss, grads, buffers in out:
        assert loss == pytest.approx(want.item(), rel=1e-12)
        for fqn, p in ref.named_parameters():
            torch.testing.assert_close(grads[fqn], p.grad, rtol=1e-9, atol=1e-9,
                                       msg=lambda m, fqn=fqn: f"{fqn}: {m}")
        for fqn, b in ref.named_buffers():
            torch.testing.assert_close(buffers[fqn], b, msg=lambda m, fqn=fqn: f"{fqn}: {m}")


class _CumsumBlock(nn.Module):
    """Two convolutions with an op between them that no split passes (cumsum over channels)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(4, 8, 3, padding=1)
        self.b = nn.Conv2d(8, 4, 3, padding=1)

    def forward(self, x):
        return x + self.b(self.a(x).cumsum(1))


class _CumsumNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([_CumsumBlock(), _CumsumBlock()])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


def test_tp_warning_names_convolutions_and_where_their_split_stops(tmp_path):
    torch.manual_seed(0)
    with pytest.warns(UserWarning, match=r"tp at plan 2: 4 convolution\(s\) in the layer blocks "
                      r"run replicated(.|\n)*a \(layers.0, layers.1\): its split stopped at "
                      r"aten.cumsum.default"):
        nncompile.parallelize(_CumsumNet(), {"x": torch.randn(2, 4, 8, 8)},
                              nncompile.ComputeConfig(2), pas_policy="tp",
                              gen_savedir=str(tmp_path), load_module=False)
