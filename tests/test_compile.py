"""Frontend, codegen and reuse, in one process (load_module=False needs no process group)."""
import ast
import json

import pytest
import torch

import models
import nncompile
from nncompile import ComputeConfig
from nncompile.frontend import trace


def compile_only(model, example, tmp_path, plan=2, runtime=2, policy="tp", **kw):
    cfg = ComputeConfig(plan_ngpus=plan, runtime_ngpus=runtime)
    return nncompile.parallelize(model, example, cfg, pas_policy=policy, gen_savedir=tmp_path,
                                 load_module=False, **kw)


def test_meta_module_compiles_for_eight_ranks(tmp_path):
    with torch.device("meta"):
        model = models.GPT()
    out = compile_only(model, models.batch("gpt", 0), tmp_path, plan=4, runtime=8)
    assert sorted(p.name for p in out.glob("gencode*.py")) == \
        sorted(f"gencode{r}.py" for r in range(8))


@pytest.mark.parametrize("name", ["hf_gpt2", "hf_llama"])
def test_hugging_face_models_trace(name):
    g = trace(models.build(name), models.batch(name, 0))
    ops = {op.target_name for op in g.ops}
    assert "aten.scaled_dot_product_attention.default" in ops
    assert "aten.cross_entropy_loss.default" in ops
    assert all(p.fqn.startswith("model.") for p in g.params)


def test_generated_files(tmp_path):
    out = compile_only(models.build("gpt"), models.batch("gpt", 0), tmp_path, plan=2, runtime=4)
    names = {p.name for p in out.iterdir()}
    assert {"gencode0.py", "gencode3.py", "manifest.json", "plan.json", "graphs"} <= names
    assert [p.name for p in sorted((out / "graphs").iterdir())] == [
        "00_trace.py", "01_constant_fold.py", "02_dce.py", "03_fuse_attention.py", "04_plan.py",
        "05_sink_gathers.py", "06_insert_comm.py", "07_localize.py", "08_overlap_grad_sync.py"]
    code = (out / "gencode1.py").read_text()
    ast.parse(code)
    assert "# examples/gpt.py:" in code and "x = x + self.attn(self.ln_1(x))" in code
    assert "comm.all_reduce(" in code and "class GenModel(ParallelModule)" in code
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["config"]["plan_ngpus"] == 2 and manifest["config"]["runtime_ngpus"] == 4
    p1 = {p["fqn"]: p for p in manifest["ranks"]["1"]["params"]}
    fc = p1["h.0.mlp_fc.weight"]
    assert fc["full_shape"] == [128, 32] and fc["slices"] == [[64, 128], [0, 32]]
    assert manifest["ranks"]["3"]["params"] == manifest["ranks"]["1"]["params"]
    assert p1["h.0.ln_1.weight"]["partial_sum_count"] == 1     # replicated, full gradients
    plan = json.loads((out / "plan.json").read_text())
    assert plan["params"]["h.0.mlp_proj.weight"] == "S(1)"
    assert plan["collectives"]["comm.all_reduce"] == 4       # Megatron: 2 per block


def test_reuse_modes(tmp_path, capsys):
    model, example = models.build("mlp"), models.batch("mlp", 0)
    out = compile_only(model, example, tmp_path)
    first = (out / "gencode0.py").stat().st_mtime_ns
    compile_only(model, example, tmp_path)                          # match: reused
    assert (out / "gencode0.py").stat().st_mtime_ns == first
    compile_only(model, example, tmp_path, reuse="override")        # override: regenerated
    assert (out / "gencode0.py").stat().st_mtime_ns != first
    second = (out / "gencode0.py").stat().st_mtime_ns
    compile_only(models.MLP(d_hidden=32), example, tmp_path, reuse="moo")   # moo: changed
    assert (out / "gencode0.py").stat().st_mtime_ns != second
    assert "[32, 16]" in (out / "manifest.json").read_text()


def test_callable_policy(tmp_path):
    seen = []

    def replicate_all(graph, config):
        seen.append(config.plan_ngpus)
        return graph
    out = compile_only(models.build("mlp"), models.batch("mlp", 0), tmp_path,
                       policy=replicate_all)
    assert seen == [2]
    assert json.loads((out / "plan.json").read_text())["collectives"] == {}


def test_single_process_module_matches_eager(tmp_path):
    model = models.build("gpt")
    pm = nncompile.parallelize(model, models.batch("gpt", 0), ComputeConfig(plan_ngpus=1),
                               pas_policy="dp", gen_savedir=tmp_path)
    loss = pm(**models.batch("gpt", 0))
    loss.backward()
    ref = model(**models.batch("gpt", 0))
    ref.backward()
    torch.testing.assert_close(loss, ref)
    grads = pm.gather_grads()
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad)
    assert set(pm.gather_params()) == {n for n, _ in model.named_parameters()}


def test_inference_only_has_no_gradient_machinery(tmp_path):
    cfg = ComputeConfig(plan_ngpus=2, runtime_ngpus=2, inference_only=True)
    out = nncompile.parallelize(models.build("gpt"), models.batch("gpt", 0), cfg,
                                pas_policy="tp", gen_savedir=tmp_path, load_module=False)
    code = (out / "gencode0.py").read_text()
    assert "INFERENCE_ONLY = True" in code and "comm.sync_grad" not in code
    assert "comm.all_reduce" in code


def test_small_tensor_constant_in_forward(tmp_path):
    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            return (self.lin(x) * torch.tensor([1.0, 2.0, 3.0, 4.0])).sum()

    model, x = Scaled(), torch.randn(2, 4)
    pm = nncompile.parallelize(model, (x,), ComputeConfig(plan_ngpus=1), pas_policy="dp",
                               gen_savedir=tmp_path)
    assert "torch.tensor([1.0, 2.0, 3.0, 4.0]" in open(pm.gencode_path).read()
    torch.testing.assert_close(pm(x), model(x))
