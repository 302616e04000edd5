"""Checkpoint worker (gloo, 2 ranks): a sharded checkpoint saved by a job started in one working
directory loads in a job started in another. Each job imports the GPT from `./MODEL_DIR/gpt.py`
(a copy the test makes per directory) and writes its generated code under `./gen`.

    save   tp plan 2: train 3 steps, save DIR/ckpt (format sharded), train 2 more and write
           their losses to DIR/losses.json
    load   the same plan from here loads DIR/ckpt and trains the same 2 losses; so does a
           callable policy wrapping tp (another fingerprint, the same shards); under `data`
           (other shards) load_checkpoint fails naming the first differing parameter

    cd A && torchrun --nproc_per_node=2 tests/workers/cwd_checkpoint.py --phase save \
        --dir DIR --model-dir src_a
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import nncompile
from nncompile.passes.policies import POLICIES

STEPS = 3


def tp_again(graph, config):
    """The built-in tp policy under another name: another fingerprint, the same shards."""
    return POLICIES["tp"](graph, config)


def batch(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"idx": torch.randint(0, 64, (4, 16), generator=g),
            "targets": torch.randint(0, 64, (4, 16), generator=g)}


def build(policy, name: str):
    from gpt import GPT
    torch.manual_seed(0)
    pm = nncompile.parallelize(GPT(), batch(0), nncompile.ComputeConfig(2, 2),
                               pas_policy=policy, gen_savedir="gen", instance_name=name)
    return pm, torch.optim.AdamW(pm.parameters(), lr=1e-2)


def train(pm, opt, steps) -> list[float]:
    losses = []
    for i in steps:
        loss = pm(**batch(i))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return losses


def phase_save(d: Path) -> None:
    pm, opt = build("tp", "gpt_tp")
    train(pm, opt, range(STEPS))
    nncompile.save_checkpoint(d / "ckpt", pm, opt, format="sharded", extra={"step": STEPS})
    losses = train(pm, opt, range(STEPS, STEPS + 2))
    if dist.get_rank() == 0:
        (d / "losses.json").write_text(json.dumps(losses))


def phase_load(d: Path) -> None:
    want = json.loads((d / "losses.json").read_text())
    saved = json.loads((d / "ckpt" / "checkpoint.json").read_text())["plan"]["fingerprint"]
    for policy, name, same_fp in (("tp", "gpt_tp", True), (tp_again, "gpt_tp_again", False)):
        pm, opt = build(policy, name)
        assert (pm.FINGERPRINT == saved) == same_fp, (name, pm.FINGERPRINT, saved)
        assert nncompile.load_checkpoint(d / "ckpt", pm, opt) == {"step": STEPS}
        got = train(pm, opt, range(STEPS, STEPS + 2))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        if dist.get_rank() == 0:
            print(f"ok loaded from another directory: {name}", flush=True)
    pm, opt = build("data", "gpt_data")
    try:
        nncompile.load_checkpoint(d / "ckpt", pm, opt)
    except nncompile.CheckpointError as e:
        if dist.get_rank() == 0:
            print(f"refused: {e}", flush=True)
    else:
        raise AssertionError("a sharded checkpoint loaded into a plan with other shards")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--phase", required=True, choices=["save", "load"])
    ap.add_argument("--dir", required=True)
    ap.add_argument("--model-dir", required=True)
    args = ap.parse_args()
    sys.path.insert(0, args.model_dir)          # relative: the source comments name it
    nncompile.init_distributed("gloo")
    globals()[f"phase_{args.phase}"](Path(args.dir))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
