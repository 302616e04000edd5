"""BatchNorm in training mode: forward updates buffers (running_mean, running_var,
num_batches_tracked); torch.export returns their new values and the runtime writes them back.

Inside a plan unit (data, tp, autodist) the statistics are over the unit's whole batch, so
losses, weights and running statistics equal one device's. Data-parallel units each keep the
statistics of their own batch (DDP without SyncBatchNorm): the reference is one device that
runs each unit's batch as a micro-batch with that unit's buffers."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import nncompile
from nncompile import ComputeConfig
from nncompile.tools.simulate import run_ranks

STEPS = 3


class BasicBlock(nn.Module):
    """torchvision's ResNet BasicBlock: conv-bn-relu-conv-bn plus a projected shortcut."""

    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                        nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.downsample(x))


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8),
                                  nn.ReLU())
        self.layer = BasicBlock(8, 16, stride=2)
        self.fc = nn.Linear(16, 10)

    def forward(self, x, y):
        h = self.layer(self.stem(x))
        return F.cross_entropy(self.fc(h.mean((2, 3))), y)


class BNMLP(nn.Module):
    def __init__(self):
        super().__init__()
        # no bias before BatchNorm (it cancels; its gradient is rounding noise AdamW amplifies)
        self.fc1 = nn.Linear(16, 32, bias=False)
        self.bn = nn.BatchNorm1d(32, momentum=0.3)
        self.fc2 = nn.Linear(32, 8)

    def forward(self, x, y):
        return F.cross_entropy(self.fc2(F.relu(self.bn(self.fc1(x)))), y)


def _hf_resnet() -> nn.Module:
    """Hugging Face's ResNet (basic layers: conv-BatchNorm-ReLU, projected shortcuts)."""
    import transformers as tf
    return tf.ResNetForImageClassification(tf.ResNetConfig(
        embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic",
        num_labels=10))


SHAPES = {"cnn": (8, 3, 8, 8), "mlp": (8, 16), "hf_resnet": (8, 3, 32, 32)}


def _batches(kind: str):
    g = torch.Generator().manual_seed(1)
    classes = 8 if kind == "mlp" else 10
    # shifted inputs: running statistics move far from their initial (0, 1)
    return [(torch.randn(*SHAPES[kind], generator=g) * 2 + 0.5,
             torch.randint(0, classes, (8,), generator=g)) for _ in range(STEPS)]


def _build(kind: str) -> nn.Module:
    torch.manual_seed(0)
    return ConvNet() if kind == "cnn" else BNMLP() if kind == "mlp" else _hf_resnet()


def _args(kind: str, x, y):
    """forward's arguments (Hugging Face models by keyword)."""
    return {"pixel_values": x, "labels": y} if kind.startswith("hf") else (x, y)


def _loss(module, args) -> torch.Tensor:
    out = module(**args) if isinstance(args, dict) else module(*args)
    return out if isinstance(out, torch.Tensor) else out.loss      # HF: an output dataclass


def _opt(name: str, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-2)


def _buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.named_buffers()}


def _reference(model, kind, opt_name, units):
    """One device: each step runs every unit's rows as a micro-batch with that unit's buffers
    (its own running statistics) and averages the gradients, as data-parallel units do."""
    model = copy.deepcopy(model)
    opt = _opt(opt_name, model.parameters())
    state = [_buffers(model) for _ in range(units)]
    losses = []
    for x, y in _batches(kind):
        rows = x.shape[0] // units
        step = []
        for u in range(units):
            model.load_state_dict(state[u], strict=False)
            loss = _loss(model, _args(kind, x[u * rows:(u + 1) * rows],
                                      y[u * rows:(u + 1) * rows]))
            (loss / units).backward()
            state[u] = _buffers(model)
            step.append(loss.item())
        opt.step()
        opt.zero_grad()
        losses.append(step)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    model.eval()                # eval mode: each unit's running statistics normalize
    x, y = _batches(kind)[0]
    rows = x.shape[0] // units
    evals = []
    with torch.no_grad():
        for u in range(units):
            model.load_state_dict(state[u], strict=False)
            evals.append(_loss(model, _args(kind, x[u * rows:(u + 1) * rows],
                                            y[u * rows:(u + 1) * rows])).item())
    return losses, params, state, evals


def _local_buffers(pm) -> dict[str, torch.Tensor]:
    """This unit's buffers by FQN, whole: a plan that splits a batch norm's channels splits
    its running statistics too (gathered along the plan unit here)."""
    from conformance import full_buffers
    local = pm.local_tensors()
    return {fqn: local[name].detach().clone() for name, fqn, *_ in pm.BUFFERS} | \
        full_buffers(pm)


def _train(model, kind, policy, plan, world, opt_name, savedir, use_zero=0, save=None):
    units = world // plan
    batches = _batches(kind)

    def rank_fn(rank):
        unit = rank // plan
        rows = batches[0][0].shape[0] // units
        mine = [_args(kind, x[unit * rows:(unit + 1) * rows], y[unit * rows:(unit + 1) * rows])
                for x, y in batches]
        pm = nncompile.parallelize(copy.deepcopy(model), mine[0],
                                   ComputeConfig(plan, world, use_zero=use_zero),
                                   pas_policy=policy, gen_savedir=savedir)
        opt = nncompile.build_optimizer(pm, torch.optim.SGD, lr=0.1, momentum=0.9) \
            if opt_name == "sgd" else nncompile.build_optimizer(pm, torch.optim.AdamW, lr=1e-2)
        losses = []
        for args in mine:
            loss = _loss(pm, args)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        buffers = _local_buffers(pm)
        pm.eval()
        with torch.no_grad():
            eval_loss = _loss(pm, mine[0]).item()
        assert all(torch.equal(t, buffers[k]) for k, t in _local_buffers(pm).items()), \
            "an eval-mode forward updated the running statistics"
        pm.train()
        result = {"losses": losses, "params": pm.gather_params(), "buffers": buffers,
                  "eval_loss": eval_loss,
                  "state_dict": {k: v.clone() if torch.is_tensor(v) else v
                                 for k, v in pm.local_state_dict().items()}}
        if save is not None:        # each format saved, then loaded back into pm
            result["loaded"] = {}
            for fmt in ("sharded", "deduped", "dcp"):
                nncompile.save_checkpoint(save / fmt, pm, opt, format=fmt)
            for fmt in ("deduped", "sharded", "dcp"):    # each load changes unit 1's
                nncompile.load_checkpoint(save / fmt, pm, opt)
                result["loaded"][fmt] = _local_buffers(pm)
        return result
    return run_ranks(world, rank_fn)


def _close(got, want, what):
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("kind,policy,plan,world,opt_name,use_zero", [
    ("cnn", "dp", 1, 2, "sgd", 0),          # two data-parallel units
    ("cnn", "data", 2, 2, "adamw", 0),
    ("cnn", "tp", 2, 2, "sgd", 0),
    ("cnn", "autodist", 2, 2, "adamw", 0),
    ("cnn", "dp", 1, 2, "adamw", 3),         # ZeRO-3 over two units
    ("mlp", "dp", 1, 2, "adamw", 0),
    ("mlp", "data", 2, 2, "sgd", 0),
    ("mlp", "tp", 2, 2, "adamw", 0),
    ("mlp", "autodist", 2, 2, "sgd", 0),
    ("mlp", "data", 2, 4, "adamw", 0),       # two units of two ranks
    ("hf_resnet", "tp", 2, 2, "adamw", 0),
    ("hf_resnet", "dp", 1, 2, "sgd", 0),
])
def test_batchnorm_trains_like_one_device(tmp_path, kind, policy, plan, world, opt_name,
                                          use_zero):
    model = _build(kind)
    units = world // plan
    ref_losses, ref_params, ref_state, ref_evals = _reference(model, kind, opt_name, units)
    out = _train(model, kind, policy, plan, world, opt_name, tmp_path / "gen", use_zero)
    initial = _buffers(model)
    for rank, r in enumerate(out):
        unit = rank // plan
        _close(torch.tensor(r["losses"]), torch.tensor([s[unit] for s in ref_losses]),
               f"rank {rank} losses")
        for fqn, want in ref_params.items():
            _close(r["params"][fqn], want, f"rank {rank} {fqn}")
        assert r["buffers"].keys() == ref_state[unit].keys()
        for fqn, want in ref_state[unit].items():
            assert not torch.equal(want, initial[fqn]), f"{fqn} was not updated"
            _close(r["buffers"][fqn], want, f"rank {rank} (unit {unit}) buffer {fqn}")
        _close(torch.tensor(r["eval_loss"]), torch.tensor(ref_evals[unit]),
               f"rank {rank} eval-mode loss")
        counts = [int(v) for k, v in r["buffers"].items() if k.endswith("num_batches_tracked")]
        assert counts and set(counts) == {STEPS}
    if units > 1:       # each unit keeps its own statistics (no SyncBatchNorm)
        key = next(k for k in ref_state[0] if k.endswith("running_mean"))
        assert not torch.allclose(out[0]["buffers"][key], out[-1]["buffers"][key])


def test_checkpoints_of_units_keep_the_first_units_statistics(tmp_path):
    """Two data-parallel units with their own statistics: pm.local_state_dict() and a `sharded`
    checkpoint hold each rank's own (a resume restores every unit's); `deduped`, `dcp` and
    merged state dicts hold the first unit's (as a DDP checkpoint saved by rank 0 does), and
    loading them gives every unit those."""
    model = _build("cnn")
    _, _, ref_state, _ = _reference(model, "cnn", "sgd", 2)
    out = _train(model, "cnn", "dp", 1, 2, "sgd", tmp_path / "gen", save=tmp_path / "ckpt")
    merged, _ = nncompile.merge_state_dicts([r["state_dict"] for r in out])
    for fqn, want in ref_state[0].items():
        _close(merged[fqn], want, f"merged {fqn}")
    fresh = copy.deepcopy(model)
    fresh.load_state_dict(merged)           # the single-device module loads it
    _close(fresh.layer.bn2.running_var, ref_state[0]["layer.bn2.running_var"], "loaded")
    for rank, r in enumerate(out):
        for fmt, unit in (("sharded", rank), ("deduped", 0), ("dcp", 0)):
            for fqn, want in ref_state[unit].items():
                _close(r["loaded"][fmt][fqn], want, f"rank {rank} {fmt} {fqn}")


def test_checkpoint_resume_keeps_running_statistics(tmp_path):
    """A checkpoint holds the written-back statistics, and a resumed module continues from
    them exactly as one device does."""
    model = _build("cnn")
    batches = _batches("cnn")
    ref = copy.deepcopy(model)
    ref_opt = _opt("sgd", ref.parameters())
    ref_losses = []
    for x, y in batches:
        loss = ref(x, y)
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(loss.item())

    def make(name):
        pm = nncompile.parallelize(copy.deepcopy(model), batches[0], ComputeConfig(1, 1),
                                   pas_policy="dp", gen_savedir=tmp_path / "gen")
        return pm, nncompile.build_optimizer(pm, torch.optim.SGD, lr=0.1, momentum=0.9)

    pm, opt = make("a")
    losses = []
    for x, y in batches[:2]:
        loss = pm(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    nncompile.save_checkpoint(tmp_path / "ckpt", pm, opt)
    sd = pm.local_state_dict()
    assert int(sd["stem1_num_batches_tracked"]) == 2
    pm2, opt2 = make("b")
    assert int(pm2.local_state_dict()["stem1_num_batches_tracked"]) == 0
    nncompile.load_checkpoint(tmp_path / "ckpt", pm2, opt2)
    for k, v in pm2.local_state_dict().items():
        if torch.is_tensor(v):
            assert torch.equal(v, sd[k]), k
    loss = pm2(*batches[2])
    loss.backward()
    opt2.step()
    losses.append(loss.item())
    _close(torch.tensor(losses), torch.tensor(ref_losses), "losses")
    for fqn, want in _buffers(ref).items():
        got = pm2.local_tensors()[next(n for n, f, *_ in pm2.BUFFERS if f == fqn)]
        _close(got, want, fqn)


def test_two_forwards_before_one_backward(tmp_path):
    """Gradient accumulation: the second forward writes back statistics the first one's
    backward saved (the write-back keeps their version counter, as BatchNorm does)."""
    model = _build("cnn")
    ref = copy.deepcopy(model)
    (x, y), (x2, y2) = _batches("cnn")[:2]
    pm = nncompile.parallelize(copy.deepcopy(model), (x, y), ComputeConfig(1, 1),
                               pas_policy="dp", gen_savedir=tmp_path)
    (pm(x, y) + pm(x2, y2)).backward()
    (ref(x, y) + ref(x2, y2)).backward()
    grads = {n: p.grad for n, p in ref.named_parameters()}
    for row in pm.PARAMS:
        _close(getattr(pm, row[0]).grad, grads[row[1]], row[1])
    for fqn, want in _buffers(ref).items():
        _close(_local_buffers(pm)[fqn], want, fqn)


class EMANet(nn.Module):
    """A buffer a forward updates in place that is not BatchNorm's: an EMA and a counter."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 8)
        self.register_buffer("ema", torch.zeros(32))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x, y):
        h = F.relu(self.fc1(x))
        self.ema.mul_(0.9).add_(0.1 * h.detach().mean(0))
        self.steps += 1
        return F.cross_entropy(self.fc2(h), y)


@pytest.mark.parametrize("policy", ["tp", "data"])
def test_other_buffer_updates_equal_one_device(tmp_path, policy):
    torch.manual_seed(0)
    model = EMANet()
    x, y = _batches("mlp")[0]
    ref = copy.deepcopy(model)
    for _ in range(2):
        ref(x, y).backward()

    def rank_fn(rank):
        pm = nncompile.parallelize(copy.deepcopy(model), (x, y), ComputeConfig(2, 2),
                                   pas_policy=policy, gen_savedir=tmp_path)
        for _ in range(2):
            pm(x, y).backward()
        return _local_buffers(pm)
    for buffers in run_ranks(2, rank_fn):
        _close(buffers["ema"], ref.ema, "ema")
        assert int(buffers["steps"]) == 2


def test_refused_updates_name_the_fix(tmp_path):
    class Deep(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16))
                                        for _ in range(2))

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x.sum()

    cfg = ComputeConfig(2, 2, parallel={"pp": 2, "microbatches": 2})
    with pytest.raises(nncompile.NNCompileError, match=r"updates buffers in place "
                       r"\(layers\.0\.1\.running_mean.* and 3 more.*without a pipeline"):
        nncompile.parallelize(Deep(), (torch.randn(8, 16),), cfg, pas_policy="tp",
                              gen_savedir=tmp_path, load_module=False)

    class WritesInput(nn.Module):
        def forward(self, x):
            x.mul_(2)
            return x.sum()

    with pytest.raises(nncompile.TraceError, match="writes in place into an input"):
        nncompile.parallelize(WritesInput(), (torch.randn(4, 4),), ComputeConfig(1, 1),
                              pas_policy="dp", gen_savedir=tmp_path, load_module=False)

    class CumulativeBN(nn.Module):
        def __init__(self):
            super().__init__()
            self.bn = nn.BatchNorm1d(4, momentum=None)

        def forward(self, x):
            return self.bn(x).sum()

    with pytest.raises(nncompile.TraceError, match="momentum=None.*momentum=0.1"):
        nncompile.parallelize(CumulativeBN(), (torch.randn(8, 4),), ComputeConfig(1, 1),
                              pas_policy="dp", gen_savedir=tmp_path, load_module=False)
