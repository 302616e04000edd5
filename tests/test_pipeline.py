"""Pipeline parallelism: stages cut at layer boundaries, stage methods in the generated files,
train_step on torch.distributed.pipelining with parity against one device's micro-batch
accumulation, train_step's accumulation for plans without stages, and the errors."""
import copy
import json
import os
import re
import sys

import pytest
import torch

import nncompile
from nncompile import ComputeConfig, ConfigError, InputMismatchError, PipelineError
from nncompile.ir.schedule import parse_actions
from nncompile.passes.pipeline_schedule import schedule_actions
from nncompile.runtime.program.loader import load_rank_module

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from gpt import GPT  # noqa: E402

BATCH = {"idx": torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(0)),
         "targets": torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(1))}


def _compile(tmp_path, pas, plan=2, policy="tp", model=None, name="gpt"):
    model = model or GPT(n_layer=4)
    out = nncompile.parallelize(model, BATCH, ComputeConfig(plan, plan, parallel=pas),
                                pas_policy=policy, gen_savedir=tmp_path, load_module=False,
                                instance_name=name)
    return model, out


def test_pipeline_parity_every_schedule(run_ranks, tmp_path):
    """20 AdamW steps on 4 gloo ranks: pp 2 x tp 2 and pp 4 (1F1B), pp 2 x dp 2 with ZeRO-3,
    interleaved 1F1B with 2 stages per rank, the V-shaped zero-bubble schedule (V = 2); 5
    steps of GPipe under autodist and of Hugging Face GPT-2, without and with dropout 0.3
    (pp 2 x tp 2 1F1B, pp 4 interleaved with V = 2): every unit's loss (rtol 1e-5), step 0's
    gradients (rtol 1e-5) and the final weight shards equal one device accumulating the same
    micro-batches, drawing its dropout masks in micro-batch order. After step 2, `pm(...)`
    under no_grad (training mode: masks go on from one device's) and after pm.eval() (with
    gradients on, and under inference_mode) equal one device's validation loss; where the
    eval-mode forward differs beyond mode flags, eval mode is refused. The tied wte / lm_head
    sits on the first and the last stage in all (GPT's and GPT-2's). DualPipeV (5 steps): pp 2
    x dp 2, with ZeRO-3 too, and GPT-2 pp 2 x tp 2 with dropout 0.3; schedule='auto' under
    autodist (V = 2)."""
    out = run_ranks("tests/workers/pipeline.py", 4, "--savedir", str(tmp_path))
    for name in ("pp2xtp2-1f1b", "pp4-1f1b", "pp2xdp2-zero3", "pp2xdp2-interleaved-v2",
                 "pp2xdp2-zbv-v2"):
        assert f"{name}: loss[19]=" in out, out[-3000:]
    for name in ("pp2xtp2-gpipe-autodist", "hf_gpt2-pp2xtp2-1f1b",
                 "hf_gpt2-pp2xtp2-1f1b-dropout", "hf_gpt2-pp4-interleaved-v2-dropout",
                 "pp2xdp2-dualpipev", "hf_gpt2-pp2xtp2-dualpipev-dropout",
                 "pp2xdp2-dualpipev-zero3", "pp2xdp2-auto-schedule-v2"):
        assert f"{name}: loss[4]=" in out, out[-3000:]
    # with dropout, eval mode compared too (not refused as a forward that differs in eval)
    assert re.search(r"hf_gpt2-pp4-interleaved-v2-dropout: loss\[4\]=\S+ validation values 3",
                     out), out[-3000:]
    assert "PIPELINE PARITY OK" in out


def test_generated_file_holds_its_stages(tmp_path):
    _, out = _compile(tmp_path, {"pp": 2, "microbatches": 4})
    first, last = (out / "gencode0.py").read_text(), (out / "gencode1.py").read_text()
    assert "pipeline rank 0 of 2" in first and "pipeline rank 1 of 2" in last
    assert "def stage_0(self, idx, targets):" in first and "def stage_1(" not in first
    assert "def stage_1(" in last and "def forward_impl" not in last
    assert "layers h.0 ... h.1 + the ops before the first layer" in first
    assert "sends targets, h1_add_1 to stage 1 (rank 1)" in first
    assert "receives targets, h1_add_1 from stage 0 (rank 0)" in last
    assert "targets = targets.clone()  # relayed" in first
    assert "'tied': {'wte.weight': [0, 1]}" in first     # embedding and lm_head share it
    assert "h2_attn_q_proj_weight" in last and "h2_attn_q_proj_weight" not in first
    assert "MICROBATCHES = 4" in first
    # the traced shapes are one micro-batch's
    assert "('idx', (2, 16), 'torch.int64')" in first
    # the schedule (passes/pipeline_schedule.py): every pipeline rank's actions in each file,
    # the compute order in plan.json, the lines in the graphs/ dumps from that pass on
    expected = schedule_actions("1f1b", 2, 1, 4)
    for text in (first, last):
        table = eval(re.search(r"    ACTIONS = (\{.*\})", text).group(1))
        assert parse_actions(table) == expected.actions
    assert "1RECV_F0 1F0 1RECV_F1 1B0 1SEND_B0 1F1" in last
    plan = json.loads((out / "plan.json").read_text())
    assert plan["pipeline"]["actions"] == {str(p): expected.text(p, comms=False) for p in (0, 1)}
    dump = next((out / "graphs").glob("*_pipeline_schedule.py")).read_text()
    assert f"rank 1: {expected.text(1)}" in dump


def test_cuts_are_whole_layers_and_balanced(tmp_path):
    model = GPT(n_layer=6)
    _, out = _compile(tmp_path, {"pp": 3, "microbatches": 2}, plan=3, model=model)
    texts = [(out / f"gencode{r}.py").read_text() for r in range(3)]
    for r, text in enumerate(texts):
        assert f"layers h.{2 * r} ... h.{2 * r + 1}" in text, text[:3000]


def test_train_step_without_stages_accumulates_micro_batches(tmp_path):
    """A plan without stages: train_step = one device's accumulation over M micro-batches."""
    torch.manual_seed(0)
    model = GPT(n_layer=2)
    ref = copy.deepcopy(model)
    _, out = _compile(tmp_path, {"microbatches": 4}, plan=1, model=model)
    pm = load_rank_module(out, 0, model)
    loss = pm.train_step(**BATCH)
    want = 0.0
    for m in range(4):
        part = ref(**{k: v.chunk(4)[m] for k, v in BATCH.items()}) / 4
        part.backward()
        want += part.item()
    assert abs(float(loss) - want) < 1e-6
    got = pm.gather_grads()
    for fqn, p in ref.named_parameters():
        torch.testing.assert_close(got[fqn], p.grad, rtol=1e-5, atol=1e-7)
    with pytest.raises(InputMismatchError, match="4 micro-batches of 2 = 8 rows"):
        pm.train_step(idx=BATCH["idx"][:4], targets=BATCH["targets"][:4])


def test_forward_on_a_pipelined_plan_names_train_step(tmp_path):
    model, out = _compile(tmp_path, {"pp": 2, "microbatches": 2})
    pm = load_rank_module(out, 0, model)
    with pytest.raises(PipelineError, match=r"pm.train_step\(\*args, \*\*kwargs\)"):
        pm(**BATCH)


def test_clear_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"= 8 stages, but gpt.GPT has only 4 layers \(h.0 "
                                          r"... h.3\) .* use parallel.pp <= 2 with "
                                          "stages_per_rank=2"):
        _compile(tmp_path, {"pp": 4, "stages_per_rank": 2,
                            "schedule": "interleaved_1f1b"}, plan=4, name="a")
    with pytest.raises(ConfigError, match="microbatches.*=3 does not divide the batch"):
        _compile(tmp_path, {"pp": 2, "microbatches": 3}, name="b")
    with pytest.raises(ConfigError, match="'dualpipe' is not a schedule torch.distributed."
                                          "pipelining offers here; choose one of"):
        ComputeConfig(2, parallel={"pp": 2, "schedule": "dualpipe"})
    with pytest.raises(ConfigError, match="runs one stage per rank, but parallel.stages_per_rank=2"):
        ComputeConfig(2, parallel={"pp": 2, "schedule": "1f1b",
                                     "stages_per_rank": 2})
    with pytest.raises(ConfigError, match="does not divide plan_ngpus=4"):
        ComputeConfig(4, parallel={"pp": 3})
    with pytest.raises(ConfigError, match="'auto' is chosen by autodist"):
        _compile(tmp_path, {"pp": "auto"}, name="c")
    with pytest.raises(ConfigError, match="no scalar floating-point tensor"):
        class Logits(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.gpt = GPT(n_layer=2)

            def forward(self, idx, targets):
                return self.gpt.lm_head(self.gpt.ln_f(self.gpt.h[1](self.gpt.h[0](
                    self.gpt.wte(idx)))))
        _compile(tmp_path, {"pp": 2}, model=Logits(), name="d")
    import models
    with pytest.raises(ConfigError, match="cut at layer boundaries .* has none"):
        nncompile.parallelize(models.build("mlp"), models.batch("mlp", 0),
                              ComputeConfig(2, 2, parallel={"pp": 2}),
                              pas_policy="tp", gen_savedir=tmp_path, load_module=False)
