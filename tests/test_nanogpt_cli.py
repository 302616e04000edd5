"""examples/nanogpt/train.py on the command line: a short 2-rank CPU run (gloo) prints the
training loss on rank 0 at the first step, every --log_interval steps and at the last step.
And what `--policy tp` compiles the example's model (nanoGPT's layout: one fused `c_attn`
split in three) to at plan 2: attention split by heads in the generated rank file."""
import json
import os
import pickle
import re
import sys

import numpy as np
import torch

from conftest import ROOT, torchrun

VOCAB = 32


def test_train_prints_losses(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    rng = np.random.default_rng(0)                 # a tiny corpus: no prepare.py needed
    for split, n in (("train", 20_000), ("val", 2_000)):
        rng.integers(0, VOCAB, n, dtype=np.uint16).tofile(data / f"{split}.bin")
    with open(data / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": VOCAB}, f)
    out = torchrun("examples/nanogpt/train.py", 2, "--config", "cpu", "--plan_ngpus", "2",
                   "--policy", "tp", "--max_iters", "5", "--log_interval", "2",
                   "--eval_interval", "4", "--data_dir", str(data),
                   "--out_dir", str(tmp_path / "out"), timeout=300)
    train = re.findall(r"^step (\d+): train loss ([0-9.]+), \d+ ms/step$", out, re.M)
    assert [int(s) for s, _ in train] == [1, 2, 4, 5], out[-3000:]    # rank 0 only, once each
    assert all(0 < float(loss) < 10 for _, loss in train)
    val = re.findall(r"^step (\d+): val loss ([0-9.]+)$", out, re.M)
    assert [int(s) for s, _ in val] == [4], out[-3000:]


def _cpu_gpt():
    """The example's model with its `cpu` config (train.py's CONFIGS["cpu"]), no dropout."""
    here = os.path.join(ROOT, "examples", "nanogpt")
    if here not in sys.path:
        sys.path.insert(0, here)
    from model import GPT, GPTConfig
    torch.manual_seed(0)
    return GPT(GPTConfig(block_size=64, vocab_size=VOCAB, n_layer=2, n_head=4, n_embd=64,
                         dropout=0.0))


def test_tp_splits_the_fused_attention_by_heads(tmp_path):
    """--policy tp at plan 2 (compiled in this process, no ranks run): the fused c_attn is held
    as its q, k and v row blocks (parts of the original weight in plan.json), each split by
    heads; rank 0's program runs attention on 2 of the 4 heads and ends each block's
    attention and MLP with one all-reduce."""
    import nncompile
    model = _cpu_gpt()
    ids = torch.randint(0, VOCAB, (8, 64), generator=torch.Generator().manual_seed(0))
    out = nncompile.parallelize(model, {"idx": ids, "targets": ids},
                                nncompile.ComputeConfig(2, 2), pas_policy="tp",
                                gen_savedir=str(tmp_path), load_module=False)
    plan = json.loads((out / "plan.json").read_text())
    params, parts = plan["params"], plan.get("param_parts", {})
    C = 64
    for i in range(2):
        src = f"transformer.h.{i}.attn.c_attn.weight"
        keys = [f"{src}[{j}/3]" for j in range(3)]
        assert [params.get(k) for k in keys] == ["S(0)"] * 3, {
            k: v for k, v in params.items() if f".h.{i}.attn." in k}
        for j, key in enumerate(keys):       # part j: rows [j*C, (j+1)*C) of the fused weight
            part = parts[key]
            assert part["source"] == src, part
            flat = torch.arange(3 * C * C).reshape(part["view"])
            got = flat[tuple(slice(a, b) for a, b in part["box"])].flatten()
            assert torch.equal(got, torch.arange(j * C * C, (j + 1) * C * C)), (key, part)
        assert params[f"transformer.h.{i}.attn.c_proj.weight"] == "S(1)"
        assert params[f"transformer.h.{i}.mlp.c_fc.weight"] == "S(0)"
        assert params[f"transformer.h.{i}.mlp.c_proj.weight"] == "S(1)"
    assert plan["collectives"]["comm.all_reduce"] == 2 * 2, plan["collectives"]

    code = (out / "gencode0.py").read_text()
    sdpa = re.findall(r"= aten\.scaled_dot_product_attention\.\w+\(.*# f32\[([\d, ]+)\] "
                      r"of \[([\d, ]+)\] (\S+)", code)
    assert len(sdpa) == 2, code                             # one per block
    for local, full, placement in sdpa:
        assert (local, full, placement) == ("8, 2, 64, 16", "8, 4, 64, 16", "S(1)"), sdpa
    assert len(re.findall(r"= comm\.all_reduce\(", code)) == 2 * 2
    for j in range(3):                                      # the parts' rows, rank 0's halves
        row = re.search(rf"\('\w+', 'transformer\.h\.0\.attn\.c_attn\.weight\[{j}/3\]', "
                        rf"\((\d+), (\d+)\), 'S\(0\)'", code)
        assert row and row.groups() == (str(C), str(C)), code[:4000]
