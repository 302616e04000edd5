"""Multi-process (gloo) parity: loss and every gathered gradient equal a single-device run,
for the MLP, the nanoGPT-style GPT and the Hugging Face GPT-2 and Llama wrappers, with
policies dp, data and tp at (plan, runtime) in (1,1), (1,2), (2,2), (2,4), (4,4); a model of
custom ops (nncompile.register_op, tests/custom_model.py) under the same policies; Hugging Face
T5 and BART (encoder-decoders whose decoder inputs are built in place) under tp, data and
autodist at plan 2 and plan 2 x 4 ranks; and autodist
(plain, and under a memory limit that forces weights to be split, with recomputed blocks) for
the GPT and Llama at plan 2 and 4.
Tolerances are in tests/workers/parity.py (float32, rtol 1e-5, atol 1e-6)."""
import json

import pytest

EXPECTED = {
    1: [("dp", 1, 1), ("data", 1, 1), ("tp", 1, 1)],
    2: [("dp", 1, 2), ("data", 1, 2), ("tp", 1, 2), ("data", 2, 2), ("tp", 2, 2)],
    4: [("data", 2, 4), ("tp", 2, 4), ("data", 4, 4), ("tp", 4, 4)],
}
AUTODIST = {2: [("autodist", 2, 2), ("autodist_mem", 2, 2)],
            4: [("autodist", 2, 4), ("autodist_mem", 2, 4), ("autodist", 4, 4),
                ("autodist_mem", 4, 4)]}
MODELS = ["mlp", "gpt", "hf_gpt2", "hf_llama", "custom"]
SEQ2SEQ = ["hf_t5", "hf_bart"]      # encoder-decoders: every policy at plan 2


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
    assert seen == want
    for r in results:
        if r["policy"] == "autodist_mem":      # the memory limit made it split and recompute
            assert r["sharded_params"] > 0 and r["recompute"] > 0, r
    for r in results:
        if r["model"] == "custom" and r["policy"] == "tp" and r["plan"] > 1:
            # the custom autograd linear runs Megatron-style: column- then row-split
            assert r["custom_ops"] == [["custom.my_linear", "split n"],
                                       ["custom.my_linear", "split k"],
                                       ["custom.row_softmax", "split *1"]], r["custom_ops"]
        if r["model"] == "custom" and r["policy"] == "data" and r["plan"] > 1:
            assert all(s == "split *0" for _, s in r["custom_ops"]), r["custom_ops"]
    if world >= 2:
        # tp on the GPT exercises every transition of the table
        gpt_tp = next(r for r in results if r["model"] == "gpt" and r["policy"] == "tp"
                      and r["plan"] == 2)
        for kind in ("all_reduce", "chunk", "all_gather", "reduce_scatter", "all_to_all",
                     "to_partial"):
            assert gpt_tp["collectives"].get(f"comm.{kind}", 0) > 0, kind
        # data splits the batch; the position embedding (replicated) feeds a split add
        gpt_data = next(r for r in results if r["model"] == "gpt" and r["policy"] == "data"
                        and r["plan"] == 2)
        assert gpt_data["collectives"].get("comm.sync_grad", 0) > 0
