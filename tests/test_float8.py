"""ComputeConfig(float8=...): torchao's float8 training on the plan's linears.

The runtime's float8 linear is torchao's Float8Linear bit for bit on one rank; under tp,
ZeRO-3, data parallelism and a pipeline an unmodified Hugging Face Llama trains like one
device running torchao's float8 (tests/workers/float8.py, 5 AdamW steps, losses rtol 1e-5);
the plan never casts a partial sum; plan.json lists every nn.Linear with what was decided;
bad requests get clear errors, and nncompile imports without torchao.
"""
from __future__ import annotations

import copy
import json
import pathlib
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

import nncompile
from nncompile.api import compile_module
from nncompile.errors import ConfigError
from nncompile.ir import Partial, parse_graph, print_graph

import models
from conftest import launch_ranks

pytest.importorskip("torchao.float8")


class _Module:            # what runtime/program/float8.py's Float8 reads of a ParallelModule
    device = torch.device("cpu")
    mesh = None
    PLAN_NGPUS = RUNTIME_NGPUS = PIPE_RANKS = 1
    mesh_axes = ()


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_one_rank_is_torchaos_float8_linear_bit_for_bit(recipe):
    from torchao.float8 import convert_to_float8_training
    from nncompile.runtime.program.float8 import Float8, recipe_config
    torch.manual_seed(0)
    lin = nn.Linear(64, 32)
    ref = nn.Sequential(copy.deepcopy(lin))
    convert_to_float8_training(ref, config=recipe_config(recipe, emulate=True))
    x = torch.randn(4, 8, 64, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    y = ref(x)
    g = torch.randn_like(y)
    y.backward(g)
    y2 = Float8(recipe, _Module()).linear(x2, lin.weight, lin.bias, {}, {}, {})
    y2.backward(g)
    plain = nn.functional.linear(x, lin.weight, lin.bias)
    assert not torch.equal(y, plain), "float8 must change the product"
    assert torch.equal(y, y2)
    assert torch.equal(x.grad, x2.grad)
    assert torch.equal(ref[0].weight.grad, lin.weight.grad)
    assert torch.equal(ref[0].bias.grad, lin.bias.grad)


def test_amax_reductions_follow_the_splits_and_the_recipe():
    from nncompile.runtime.program.float8 import Float8
    tw, rw = Float8("tensorwise", _Module()), Float8("rowwise", _Module())
    # column split (w's rows, the output's features): a tensorwise amax spans every split
    assert tw.amax_axes("w", "output", {"plan": "N"}) == ("plan",)
    assert tw.amax_axes("go", "grad_weight", {"plan": "N"}) == ("plan",)
    assert tw.amax_axes("x", "output", {}) == ()
    # a rowwise amax spans one dimension: only a split of that dimension reduces
    assert rw.amax_axes("w", "output", {"plan": "N"}) == ()           # over K
    assert rw.amax_axes("w", "grad_input", {"plan": "N"}) == ("plan",)  # over N
    assert rw.amax_axes("x", "output", {"plan": "K"}) == ("plan",)
    assert rw.amax_axes("x", "grad_weight", {"plan": "K"}) == ()      # over tokens
    assert rw.amax_axes("x", "grad_weight", {"cp": "T"}) == ("cp",)
    # data-parallel units: token amaxes reduce over them only with scales="global"
    glob = Float8("tensorwise", _Module(), scales="global")
    assert glob.amax_axes("x", "output", {}) == ("dp",)
    assert glob.amax_axes("w", "output", {}) == ()


def _llama():
    torch.manual_seed(0)
    return models.hf_llama(vocab=64, hidden=32, inter=64)


def _ids():
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids}


def test_generated_code_casts_whole_values_and_plan_json_lists_every_linear(tmp_path):
    spec = nncompile.Float8Spec("tensorwise", filter="all")
    g = compile_module(_llama(), _ids(), nncompile.ComputeConfig(2, 2, float8=spec),
                       pas_policy="tp", outdir=tmp_path).final
    marked = [op for op in g.ops if op.float8]
    assert len(marked) == 14, [op.name for op in marked]      # 7 linears x 2 layers
    for op in marked:
        assert op.target == "FLOAT8.linear"
        assert not any(isinstance(p, Partial) for p in op.strategy.inputs[:2]), op.name
    code = (tmp_path / "gencode0.py").read_text()
    assert "FLOAT8 = {'recipe': 'tensorwise', 'scales': 'local'}" in code
    assert "FLOAT8 = self.float8" in code
    # q_proj splits its output features, o_proj its contracted dim (Megatron's pair)
    assert "x_split={}, w_split={'plan': 'N'}, out_split={'plan': 'N'}" in code
    assert "x_split={'plan': 'K'}, w_split={'plan': 'K'}, out_split={}" in code
    plan = json.loads((tmp_path / "plan.json").read_text())
    layers = plan["float8"]["layers"]
    assert layers["model.model.layers.0.self_attn.q_proj"] == "float8"
    assert "named in float8 skip" in layers["model.lm_head"]
    assert sum(v == "float8" for v in layers.values()) == 14 and len(layers) == 15


class _Mlp(nn.Module):
    """Linears without biases, one weight also read by another op (`tied`)."""

    def __init__(self, tied: bool = False):
        super().__init__()
        self.up = nn.Linear(32, 64, bias=False)
        self.down = nn.Linear(64, 32, bias=False)
        self.tied = tied

    def forward(self, x):
        y = self.down(torch.nn.functional.gelu(self.up(x)))
        if self.tied:
            y = y + self.up.weight.mean() * 0
        return (y ** 2).mean()


def _train_zero3(model, all_gather: bool, recipe: str = "tensorwise", steps: int = 3):
    """ZeRO-3 over 2 threaded ranks: (rank 0's losses, bytes its gathers received, pm)."""
    from nncompile.tools.simulate import run_ranks
    spec = nncompile.Float8Spec(recipe, filter="all", all_gather=all_gather)

    x = [torch.randn(4, 32, generator=torch.Generator().manual_seed(s)) for s in range(steps)]

    def rank(r):            # threads of this process: nothing here draws from torch's RNG
        pm = nncompile.parallelize(copy.deepcopy(model), (x[0],), nncompile.ComputeConfig(
            1, 2, float8=spec, use_zero=3), pas_policy="dp", reuse="override",
            gen_savedir=".nncompile/test_float8", instance_name=f"mlp{all_gather}{recipe}")
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
        losses = []
        for b in x:
            loss = pm(b)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses, pm.zero.gathered_bytes, pm
    return run_ranks(2, rank)[0]


def test_zero3_gathers_float8_weights_as_float8_bytes_with_the_same_numerics():
    torch.manual_seed(0)
    model = _Mlp()
    got, got_bytes, pm = _train_zero3(model, all_gather=True)
    want, want_bytes, _ = _train_zero3(model, all_gather=False)
    assert got == want                           # the same casts: bit for bit
    assert sorted(pm.FLOAT8["gathered"]) == ["down_weight", "up_weight"]
    assert got_bytes * 4 == want_bytes           # f32 weights: one byte per element, not four
    plan = json.loads((pathlib.Path(pm.gencode_path).parent / "plan.json").read_text())
    assert plan["float8"]["zero3_gather"] == {"up.weight": "float8", "down.weight": "float8"}


def test_zero3_gathers_in_high_precision_where_float8_cannot_serve_every_reader():
    torch.manual_seed(0)
    _, _, tied = _train_zero3(_Mlp(tied=True), all_gather=True, steps=1)
    assert tied.FLOAT8["gathered"] == {"down_weight": []}     # up.weight: in high precision
    plan = json.loads((pathlib.Path(tied.gencode_path).parent / "plan.json").read_text())
    assert "reads it too, in high precision" in plan["float8"]["zero3_gather"]["up.weight"]
    _, _, rowwise = _train_zero3(_Mlp(), all_gather=True, recipe="rowwise", steps=1)
    plan = json.loads((pathlib.Path(rowwise.gencode_path).parent / "plan.json").read_text())
    assert "only tensorwise" in plan["float8"]["zero3_gather"]["up.weight"]
    assert "gathered" not in rowwise.FLOAT8
    with pytest.raises(ConfigError, match="all_gather"):
        nncompile.Float8Spec(all_gather="yes")


def test_auto_filter_skips_small_layers_with_the_reason():
    from nncompile.float8_spec import float8_layers
    layers = float8_layers(_llama(), nncompile.Float8Spec("rowwise"))
    assert all("too small to gain" in why or "skip" in why for why in layers.values())
    odd = nn.Sequential(nn.Linear(24, 32))
    assert "multiples of 16" in float8_layers(odd, nncompile.Float8Spec(filter="all"))["0"]


def test_float8_marks_print_and_parse_back():
    from nncompile.float8_spec import float8_layers
    from nncompile.frontend import trace
    from nncompile.passes import build_pipeline, get_policy, run_pipeline
    cfg = nncompile.ComputeConfig(2, 2, float8=nncompile.Float8Spec(filter="all"))
    model = _llama()
    result = run_pipeline(trace(model, _ids()), build_pipeline(
        cfg, get_policy("tp"), None, float8_layers(model, cfg.float8)))
    planned = next(g for name, g, _ in result.history if name == "plan")
    text = print_graph(planned)
    assert "  float8=tensorwise" in text
    back = parse_graph(text)
    assert [op.float8 for op in back.ops] == [op.float8 for op in planned.ops]
    assert sum(op.float8 == "tensorwise" for op in back.ops) == 14


def test_bad_requests_get_clear_errors(monkeypatch):
    with pytest.raises(ConfigError, match="choose one of"):
        nncompile.ComputeConfig(2, float8="e4m3")
    with pytest.raises(ConfigError, match="filter"):
        nncompile.Float8Spec(filter="big")
    with pytest.raises(ConfigError, match="micro-batch by micro-batch"):
        nncompile.ComputeConfig(2, float8=nncompile.Float8Spec(scales="global"),
                                parallel={"pp": 2})
    with pytest.raises(ConfigError, match="check=True"):
        nncompile.ComputeConfig(2, float8="tensorwise", check=True)
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    with pytest.raises(ConfigError, match="pip install torchao"):
        nncompile.ComputeConfig(2, float8="tensorwise")


def test_nncompile_imports_without_torchao():
    code = ("import sys; sys.modules['torchao'] = None; import nncompile; "
            "nncompile.ComputeConfig(2); print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.stdout.strip() == "ok", out.stderr[-2000:]


def test_plans_without_float8_keep_their_fingerprint_fields():
    assert "float8" not in nncompile.ComputeConfig(2).plan_json()
    assert nncompile.ComputeConfig(2, float8="rowwise").plan_json()["float8"]["recipe"] == \
        "rowwise"


@pytest.mark.parametrize("nproc", [2, 4])
def test_plans_train_like_one_device_running_torchaos_float8(nproc, tmp_path):
    code, out = launch_ranks("tests/workers/float8.py", nproc, "--savedir", str(tmp_path))
    assert code == 0, out[-6000:]
    expected = {2: ["tp2", "zero3-dp2"],
                4: ["tp2xdp2", "tp2xdp2-zero3-global", "tp4-rowwise", "pp2xdp2",
                    "pp2xdp2-zero3"]}[nproc]
    for name in expected:
        assert f"ok float8 {name}:" in out, out[-6000:]


def test_the_cost_model_prices_float8_products_at_the_float8_rate():
    from nncompile.passes.autodist.profiles import BUILTIN
    h100, cpu = BUILTIN["h100-80g"], BUILTIN["cpu"]
    assert h100.float8_flops(torch.bfloat16) == 2 * h100.peak_flops(torch.bfloat16)
    assert cpu.float8_flops(torch.float32) == cpu.peak_flops(torch.float32)   # emulated


def test_the_memory_model_prices_a_float8_gather_at_a_byte_per_element(tmp_path):
    from nncompile.ir import MemoryChoice
    from nncompile.passes.autodist import cost_model
    from nncompile.passes.autodist.memory_model import MemoryModel
    config = nncompile.ComputeConfig(1, 8, float8=nncompile.Float8Spec(filter="all"),
                                     use_zero=3)
    g = compile_module(_Mlp(), (torch.randn(4, 32),), config, pas_policy="dp",
                       outdir=tmp_path).final
    w = next(v for v in g.params if v.fqn == "up.weight")
    model = cost_model(config, 1)
    zero3 = MemoryChoice(zero=3, offload_optimizer=False)
    gathered = MemoryModel.of(model, config, g)
    plain = MemoryModel.of(model, config)
    assert gathered.float8_gathered == {"up.weight", "down.weight"}
    assert gathered.gathered_bytes(w, 8192.0) == 2048.0
    assert gathered.param_time(w, w.placement, zero3) < plain.param_time(w, w.placement, zero3)
