"""Command line: `python -m nncompile <command>`.

    profile -o FILE [--name NAME]   measure this machine for autodist's cost model; use the file
                                    with pas_config={"device": "FILE"}. Under torchrun it also
                                    times all-reduces across the job's ranks.
    merge FILES_OR_DIRS -o FILE     merge a checkpoint (per-rank files or its directory; sharded,
                                    deduped or dcp) into one file the original module and any
                                    plan load (nncompile.load_checkpoint)
"""
from __future__ import annotations

import argparse
import os
import sys


def _profile(args) -> int:
    import torch
    import torch.distributed as dist

    from nncompile.passes.autodist import measure_profile, save_profile
    if "RANK" in os.environ and not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    prof = measure_profile(args.name)
    if not dist.is_initialized() or dist.get_rank() == 0:
        path = save_profile(prof, args.output)
        peak = ", ".join(f"{k} {v / 1e12:.2f} TFLOP/s" for k, v in prof.flops.items())
        print(f"{prof.name}: {peak}; memory {prof.mem_bandwidth / 1e9:.1f} GB/s, "
              f"{prof.mem_capacity_gb:.1f} GB -> {path}")
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


def _merge(args) -> int:
    from nncompile.errors import NNCompileError
    from nncompile.runtime.checkpoint import merge_checkpoint
    try:
        out = merge_checkpoint(args.inputs, args.output)
    except NNCompileError as e:
        print(f"nncompile merge: {e}", file=sys.stderr)
        return 2
    print(f"merged {len(args.inputs)} input(s) -> {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="nncompile", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("profile", help="measure this machine for the autodist cost model")
    p.add_argument("-o", "--output", required=True, help="profile .json to write")
    p.add_argument("--name", default="measured")
    p.set_defaults(func=_profile)
    p = sub.add_parser("merge", help="merge a checkpoint's per-rank files into one")
    p.add_argument("inputs", nargs="+", help="rank*.pt files or checkpoint directories")
    p.add_argument("-o", "--output", required=True, help="merged .pt file to write")
    p.set_defaults(func=_merge)
    args = ap.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
