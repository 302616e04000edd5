"""Multi-process (gloo) parity: loss and every gathered gradient equal a single-device run,
for the MLP, the nanoGPT-style GPT and the Hugging Face GPT-2 and Llama wrappers, with
policies dp, data and tp (Megatron) at (plan, runtime) in (1,1), (1,2), (2,2), (2,4), (4,4),
tp_sp (Megatron with sequence parallelism) at plan 2, and a plan splitting every op (every
collective of the table) for the GPT and the custom-op model at plan 2; a model of
custom ops (nncompile.register_op, tests/custom_model.py) under the same policies; Hugging Face
T5 and BART (encoder-decoders whose decoder inputs are built in place) under tp, data and
autodist at plan 2 and plan 2 x 4 ranks; and autodist
(plain, and under a memory limit that forces weights to be split, with recomputed blocks) for
the GPT and Llama at plan 2 and 4. The GPT and Llama also run compiled (ComputeConfig(
compile=True): the GPT under dp on 1 rank, both under tp at plan 2 on 2 ranks), each forward
one graph.
Tolerances are in tests/workers/parity.py (float32, rtol 1e-5, atol 1e-6)."""
import json

import pytest

EXPECTED = {
    1: [("dp", 1, 1), ("data", 1, 1), ("tp", 1, 1)],
    2: [("dp", 1, 2), ("data", 1, 2), ("tp", 1, 2), ("data", 2, 2), ("tp", 2, 2),
        ("tp_sp", 2, 2)],
    4: [("data", 2, 4), ("tp", 2, 4), ("data", 4, 4), ("tp", 4, 4)],
}
AUTODIST = {2: [("autodist", 2, 2), ("autodist_mem", 2, 2)],
            4: [("autodist", 2, 4), ("autodist_mem", 2, 4), ("autodist", 4, 4),
                ("autodist_mem", 4, 4)]}
MODELS = ["mlp", "gpt", "hf_gpt2", "hf_llama", "custom"]
SEQ2SEQ = ["hf_t5", "hf_bart"]      # encoder-decoders: every policy at plan 2
# ComputeConfig(compile=True) (torch.compile, inductor): (model, policy, plan) per world size
COMPILED = {1: [("gpt", "dp", 1)], 2: [("gpt", "tp", 2), ("hf_llama", "tp", 2)]}


@pytest.mark.parametrize("world", [1, 2, 4])
def test_parity(world, run_ranks, tmp_path):
    out = tmp_path / "report.json"
    run_ranks("tests/workers/parity.py", world, "--savedir", str(tmp_path / "gen"),
              "--out", str(out))
    results = json.loads(out.read_text())
    seen = {(r["model"], r["policy"], r["plan"], r["runtime"]) for r in results}
    want = {(m, p, n, w) for p, n, w in EXPECTED[world] for m in MODELS}
    want |= {(m, p, n, w) for p, n, w in AUTODIST.get(world, []) for m in ("gpt", "hf_llama")}
    want |= {(m, p, 2, w) for p, n, w in EXPECTED[world] + AUTODIST.get(world, [])
             if n == 2 and p != "dp" for m in SEQ2SEQ}
    if world >= 2:
        want |= {(m, "split_all", 2, world) for m in ("gpt", "custom")}
        want |= {("hf_llama", "late_gather", 2, world)}
    if world == 4:                 # tp_sp with 2 data-parallel units: the GPT and Llama
        want |= {(m, "tp_sp", 2, 4) for m in ("gpt", "hf_llama")}
    assert seen == want
    compiled = {(r["model"], r["policy"], r["plan"]): r for r in results if r["compile"]}
    assert set(compiled) == set(COMPILED.get(world, [])), sorted(compiled)
    for r in compiled.values():         # each rank's generated forward is one graph
        assert (r["graphs"], r["graph_breaks"]) == (1, 0), r
    for r in results:
        if r["policy"] == "autodist_mem":      # the memory limit made it split and recompute
            assert r["sharded_params"] > 0 and r["recompute"] > 0, r
    for r in results:
        if r["model"] == "custom" and r["policy"] == "tp" and r["plan"] > 1:
            # the custom autograd linear runs Megatron-style: column- then row-split
            assert r["custom_ops"] == [["custom.my_linear", "split n"],
                                       ["custom.my_linear", "split k"],
                                       ["custom.row_softmax", "replicate"]], r["custom_ops"]
        if r["policy"] in ("late_gather", "tp_sp") and r["model"] == "hf_llama":
            # the gathers before attention and the MLP sit after the norms' weight multiply:
            # one all_gather whose backward reduce-scatters, no separate sync_grad
            assert r["fused_gathers"] == 4 and "comm.sync_grad" not in r["collectives"], r
        if r["model"] == "custom" and r["policy"] == "split_all":
            assert r["custom_ops"][-1] == ["custom.row_softmax", "split *1"], r["custom_ops"]
        if r["model"] in ("gpt", "hf_llama") and r["policy"] == "tp" and r["plan"] > 1:
            # Megatron: per block one all-reduce after attention and one after the MLP; the
            # Llama's 2 key/value heads do not split 4 ways, so at plan 4 only its MLPs split
            c = r["collectives"]
            per_block = 1 if (r["model"], r["plan"]) == ("hf_llama", 4) else 2
            assert c["comm.all_reduce"] == c["comm.sync_grad"] == 2 * per_block, c
            assert set(c) <= {"comm.all_reduce", "comm.sync_grad", "comm.to_partial"}, c
        if r["model"] == "custom" and r["policy"] == "data" and r["plan"] > 1:
            assert all(s == "split *0" for _, s in r["custom_ops"]), r["custom_ops"]
    if world >= 2:
        # splitting every op of the GPT exercises every transition of the table
        gpt_tp = next(r for r in results if r["model"] == "gpt" and r["policy"] == "split_all")
        for kind in ("all_reduce", "chunk", "all_gather", "reduce_scatter", "all_to_all",
                     "to_partial"):
            assert gpt_tp["collectives"].get(f"comm.{kind}", 0) > 0, kind
        # data splits the batch; the position embedding (replicated) feeds a split add
        gpt_data = next(r for r in results if r["model"] == "gpt" and r["policy"] == "data"
                        and r["plan"] == 2)
        assert gpt_data["collectives"].get("comm.sync_grad", 0) > 0
