"""Generate the code of the reference configurations, to see what a change to the compiler
changes in what users get.

    python scripts/reference_configs.py OUT            # OUT/<config>/gencode*.py, plan.json, ...
    python scripts/reference_configs.py OUT --diff OLD # and compare with an earlier OUT

Seventeen configurations of the tests' GPT (a 4-layer Llama for two stages per pipeline
rank, Qwen3-MoE for expert parallelism): tensor
parallelism (Megatron, with sequence parallelism), ZeRO 1-3 (and under tp), pipelines
(GPipe, 1F1B, interleaved, zero-bubble), recompute, context parallelism (all-gather and
Ulysses attention), expert parallelism (alone and beside tp), autodist and dp. Compiling needs
no process group; run both sides from one directory (source comments name files relative to
it). `--diff` compares the rank files line by line, leaving out the fingerprint lines (they
hash the nncompile version), and prints the differing files with a unified diff;
it exits 1 when any differs.
"""
from __future__ import annotations

import argparse
import difflib
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
os.environ.setdefault("NNCOMPILE_QUIET", "1")

import models  # noqa: E402

import nncompile  # noqa: E402
from nncompile.api import compile_module  # noqa: E402

PP = {"pp": 2, "microbatches": 4}
CONFIGS = {   # name: (model, policy, plan_ngpus, runtime_ngpus, ComputeConfig keywords)
    "dp": ("gpt", "dp", 1, 2, {}),
    "tp": ("gpt", "tp", 2, 2, {}),
    "tp_dp": ("gpt", "tp", 2, 4, {}),
    "tp_sp": ("gpt", "tp_sp", 2, 2, {}),
    "zero1": ("gpt", "dp", 1, 2, {"use_zero": 1}),
    "zero2": ("gpt", "dp", 1, 2, {"use_zero": 2}),
    "zero3": ("gpt", "dp", 1, 2, {"use_zero": 3}),
    "tp_zero3": ("gpt", "tp", 2, 4, {"use_zero": 3}),
    "pp_gpipe": ("gpt", "dp", 2, 2, {"parallel": {**PP, "schedule": "gpipe"}}),
    "pp_1f1b": ("gpt", "dp", 2, 2, {"parallel": {**PP, "schedule": "1f1b"}}),
    "pp_interleaved": ("llama4", "dp", 2, 2, {"parallel": {
        **PP, "schedule": "interleaved_1f1b", "stages_per_rank": 2}}),
    "pp_zero_bubble": ("llama4", "dp", 2, 2, {"parallel": {
        **PP, "schedule": "zero_bubble", "stages_per_rank": 2}}),
    "recompute": ("gpt", "tp", 2, 2, {"parallel": {"recompute_modules": ["h.*"]}}),
    "cp": ("gpt", "tp", 2, 2, {"parallel": {"cp": 2}}),
    "cp_ulysses": ("gpt", "tp", 2, 2, {"parallel": {
        "cp": 2, "cp_attention": "ulysses"}}),
    "ep": ("moe", "data", 2, 2, {"parallel": {"ep": 2}}),
    "ep_tp": ("moe", "tp", 4, 4, {"parallel": {"ep": 2}}),
}


def build(name: str):
    if name == "moe":
        from test_moe import batch, moe
        return moe("qwen3_moe"), batch()
    if name == "llama4":               # four layers: two stages per pipeline rank
        import torch
        torch.manual_seed(0)
        return models.hf_llama(n_layer=4).train(), models.batch("hf_llama", 0)
    return models.build(name), models.batch(name, 0)


def generate(out: Path) -> None:
    for name, (model, policy, plan, runtime, kw) in CONFIGS.items():
        module, dummy = build(model)
        cfg = nncompile.ComputeConfig(plan, runtime, **kw)
        compile_module(module, dummy, cfg, pas_policy=policy, outdir=out / name,
                       reuse="override")
        print(f"{name}: {len(list((out / name).glob('gencode*.py')))} rank files", flush=True)


def _lines(path: Path) -> list[str]:
    return [ln for ln in path.read_text().splitlines(keepends=True)
            if not ln.lstrip().startswith("FINGERPRINT = ") and "   fingerprint: " not in ln]


def diff(new: Path, old: Path) -> int:
    changed = 0
    for name in CONFIGS:
        files = sorted({p.name for d in (new / name, old / name) for p in d.glob("gencode*.py")})
        for f in files:
            a = _lines(old / name / f) if (old / name / f).exists() else []
            b = _lines(new / name / f) if (new / name / f).exists() else []
            if a != b:
                changed += 1
                sys.stdout.writelines(difflib.unified_diff(a, b, f"{old.name}/{name}/{f}",
                                                           f"{new.name}/{name}/{f}", n=1))
    print(f"{changed} rank file(s) differ over {len(CONFIGS)} configurations")
    return 1 if changed else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--diff", type=Path, help="an earlier OUT to compare with")
    args = ap.parse_args()
    generate(args.out.absolute())
    return diff(args.out.absolute(), args.diff.absolute()) if args.diff else 0


if __name__ == "__main__":
    sys.exit(main())
