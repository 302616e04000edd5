"""examples/nanogpt/train.py on the command line: a short 2-rank CPU run (gloo) prints the
training loss on rank 0 at the first step, every --log_interval steps and at the last step."""
import pickle
import re

import numpy as np

from conftest import torchrun

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
