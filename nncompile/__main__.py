"""Command line: `python -m nncompile <command>`.

    profile -o FILE [--name NAME]   measure this machine for autodist's cost model; use the file
                                    with pas_config={"device": "FILE"}. Under torchrun it also
                                    times all-reduces across the job's ranks.
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="nncompile", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("profile", help="measure this machine for the autodist cost model")
    p.add_argument("-o", "--output", required=True, help="profile .json to write")
    p.add_argument("--name", default="measured")
    p.set_defaults(func=_profile)
    args = ap.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
