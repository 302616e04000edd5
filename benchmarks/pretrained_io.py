"""Hugging Face checkpoints in and out of a tp 2 x ZeRO-3 dp 2 plan (4 ranks), side by side with
what scripts do without nncompile's functions: per rank, the wall time and the peak resident
memory each way adds.

    torchrun --nproc_per_node=4 benchmarks/pretrained_io.py [--hidden 1024 --layers 8
                                                             --vocab 32000] [--dir DIR]

  load  nncompile   the model built on meta, compiled, then nncompile.load_pretrained: each
                    rank reads its slices (its ZeRO-3 piece's rows)
        eager       AutoModelForCausalLM.from_pretrained on every rank, then parallelize (the
                    shards cut from the full model)
  save  nncompile   nncompile.save_pretrained: one tensor at a time gathered, streamed to disk
        gather      pm.gather_params() on every rank, rank 0 model.save_pretrained (the
                    model rebuilt around the gathered tensors)
Peak memory: the kernel's high-water mark of the resident set (VmHWM), reset just before each
way (/proc/self/clear_refs), minus the resident set then; "model" is the full model's bytes.
Both ways' files are checked equal. The table is printed by rank 0 and appended to
benchmarks/results/pretrained_io_cpu.txt.
"""
from __future__ import annotations

import argparse
import datetime
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import nncompile  # noqa: E402
from nncompile.tools.resident import reset_peak, status  # noqa: E402


def measured(fn):
    """(result, seconds, peak resident bytes added) of fn(), after a barrier."""
    dist.barrier()
    base = status("VmRSS")
    reset_peak()
    t0 = time.perf_counter()
    out = fn()
    dist.barrier()
    return out, time.perf_counter() - t0, status("VmHWM") - base


class CausalLM(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, labels):
        return self.model(input_ids=input_ids, labels=labels, use_cache=False).loss


def main() -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--dir", default=None, help="where the checkpoints go (default: a temp dir)")
    args = ap.parse_args()
    rank, world = nncompile.init_distributed()
    os.environ["NNCOMPILE_QUIET"] = "1"
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                      intermediate_size=int(args.hidden * 2.75), num_hidden_layers=args.layers,
                      num_attention_heads=args.hidden // 64,
                      num_key_value_heads=args.hidden // 128, max_position_embeddings=64)
    work = Path(args.dir or tempfile.mkdtemp(prefix="pretrained_io-"))
    box = [str(work)]
    dist.broadcast_object_list(box)
    work = Path(box[0])
    if rank == 0:
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(cfg).save_pretrained(work / "base")
    ids = torch.randint(0, args.vocab, (2, 16))
    batch = {"input_ids": ids, "labels": ids}
    config = nncompile.ComputeConfig(2, world, use_zero=3)
    gen = str(work / "gen")

    def build(model, name):
        return nncompile.parallelize(CausalLM(model), batch, config, pas_policy="tp",
                                     gen_savedir=gen, instance_name=name)

    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(cfg)
    model_bytes = sum(p.numel() * p.element_size() for p in meta.parameters())
    pm = build(meta, "llama")
    rows = {}
    rows[("load", "nncompile")] = measured(
        lambda: nncompile.load_pretrained(pm, work / "base"))[1:]
    pm2, *cost = measured(
        lambda: build(AutoModelForCausalLM.from_pretrained(work / "base"), "llama_eager"))
    rows[("load", "eager")] = tuple(cost)
    del pm2
    rows[("save", "nncompile")] = measured(
        lambda: nncompile.save_pretrained(pm, work / "ours"))[1:]

    def gather_and_save():
        full = {k.removeprefix("model."): v for k, v in pm.gather_params().items()}
        if rank == 0:
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(cfg)
            model.load_state_dict(full, strict=False, assign=True)
            model.tie_weights()
            model.save_pretrained(work / "gathered")

    rows[("save", "gather")] = measured(gather_and_save)[1:]
    if rank == 0:
        from safetensors.torch import load_file
        a, b = load_file(work / "ours/model.safetensors"), load_file(
            work / "gathered/model.safetensors")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    every: list = [None] * world
    dist.all_gather_object(every, rows)
    if rank == 0:
        lines = [f"pretrained_io {datetime.date.today()} torch {torch.__version__}: Llama "
                 f"hidden {args.hidden} layers {args.layers} vocab {args.vocab}, model "
                 f"{model_bytes / 2**20:.0f} MiB float32, tp 2 x ZeRO-3 dp 2 on {world} CPU "
                 "ranks (gloo)",
                 f"{'':6} {'way':10} {'s (slowest rank)':>17} {'peak MiB added (max rank)':>26}"
                 f" {'x model':>8}"]
        for (what, way) in rows:
            secs = max(r[(what, way)][0] for r in every)
            peak = max(r[(what, way)][1] for r in every)
            lines.append(f"{what:6} {way:10} {secs:17.2f} {peak / 2**20:26.0f} "
                         f"{peak / model_bytes:8.2f}")
        text = "\n".join(lines)
        print(text, flush=True)
        out = ROOT / "benchmarks" / "results" / "pretrained_io_cpu.txt"
        with open(out, "a") as f:
            f.write(text + "\n\n")
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
