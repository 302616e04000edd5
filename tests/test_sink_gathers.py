"""sink_gathers (passes/sink_gathers.py): the gather before a sequence-parallel region moves
after the norm's element-wise tail, so its backward is one reduce-scatter; autodist's plan for
a Llama-3-8B shape then moves exactly Megatron-SP's bytes per layer (a known answer).
Multi-rank parity of a plan the pass rewrites: test_parity.py ('late_gather')."""
import collections
import os
import sys

import torch

import nncompile
from nncompile.comm_stats import collective_rows
from nncompile.frontend import trace
from nncompile.passes import build_pipeline, insert_comm, run_pipeline, get_policy, sink_gathers
from nncompile.passes.plan import Plan

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "workers"))
import models  # noqa: E402
from parity import late_gather  # noqa: E402


def test_before_after_on_hf_llama():
    model = models.build("hf_llama")
    g = trace(model, models.batch("hf_llama", 0))
    g.config = nncompile.ComputeConfig(2, 2)
    planned = Plan(late_gather)(g)
    before = insert_comm(planned)
    after = insert_comm(sink_gathers(planned))
    kinds = lambda gr: collections.Counter(op.target_name for op in gr.ops  # noqa: E731
                                           if op.target_name.startswith("comm."))
    # before: the gather sits before the weight multiply, then a sync_grad (an all-reduce of
    # the full activation in backward) for the column linears
    assert kinds(before)["comm.sync_grad"] == 4
    assert kinds(after)["comm.sync_grad"] == 0
    fused = [op for op in after.ops if op.target_name == "comm.all_gather"
             and op.kwargs.get("reduce_grad")]
    assert len(fused) == 4
    assert all(op.tensor_inputs()[0].producer.target_name == "aten.mul.Tensor" for op in fused)
    assert sink_gathers(sink_gathers(planned)).ops[0].strategy == sink_gathers(planned).ops[0].strategy


def _per_layer_bytes(g):
    per = collections.defaultdict(lambda: [0, 0, []])
    for r in collective_rows(g):
        parts = r["module"].split(".")
        if "layers" not in parts:
            continue
        key = ".".join(parts[:parts.index("layers") + 2])
        per[key][0] += r["forward_bytes"]
        per[key][1] += r["backward_bytes"]
        per[key][2].append((r["kind"], r["backward"]))
    return per


def test_autodist_sequence_parallel_traffic_equals_megatron_sp():
    """Llama-3-8B shape (2 of its 32 layers, seq 4096, float32) at plan 8 on the h100 profile:
    autodist picks sequence-parallel norms; per layer it must move Megatron-SP's bytes, an
    all_gather (backward reduce-scatter) before attention and the MLP and a reduce-scatter
    (backward all_gather) after each: 4 x B*T*C*4 bytes forward and as many backward."""
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                      num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=8,
                      max_position_embeddings=8192, bos_token_id=0, eos_token_id=0,
                      pad_token_id=0)
    with torch.device("meta"):
        model = models.HFCausalLM(LlamaForCausalLM(cfg))
    ids = torch.zeros(1, 4096, dtype=torch.long, device="meta")
    g = trace(model, {"input_ids": ids, "labels": ids})
    config = nncompile.ComputeConfig(8, 8, parallel={"device": "h100-80g"})
    res = run_pipeline(g, build_pipeline(config, get_policy("autodist")))
    after = dict((name, gr) for name, gr, _ in res.history)["insert_comm"]
    activation = 1 * 4096 * 4096 * 4
    per = _per_layer_bytes(after)
    assert len(per) == 2
    for layer, (fwd, bwd, kinds) in per.items():
        assert sorted(kinds) == sorted([("all_gather", "reduce_scatter"),
                                        ("reduce_scatter", "all_gather")] * 2), (layer, kinds)
        assert fwd == bwd == 4 * activation, (layer, fwd, bwd)
