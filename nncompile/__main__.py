"""Command line: `python -m nncompile <command>`.

    profile -o FILE [--name NAME] [--threads N]
                                    measure this machine for autodist's cost model; use the file
                                    with parallel={"device": "FILE"}. Under torchrun it also
                                    times all-reduces across the job's ranks. Prints matmul
                                    speed per dtype (a dtype slower than float32 is marked not
                                    accelerated on this device) and memory bandwidth.
    merge FILES_OR_DIRS -o FILE     merge a checkpoint (per-rank files or its directory; sharded,
                                    deduped or dcp) into one file the original module and any
                                    plan load (nncompile.load_checkpoint)
    export FILES_OR_DIRS -o DIR [--config CONFIG] [--prefix P] [--max-shard-size S]
                                    any checkpoint (directory, rank files, merged or state_dict
                                    file, Lightning's) -> what model.save_pretrained writes:
                                    safetensors by the original names, index, config.json
    show DIR                        per rank: parameters, collectives and gradient reduction per
                                    step; the plan summary (policy, placements, autodist estimate);
                                    a pipelined plan: per stage its layers, ranks, parameters,
                                    predicted time and memory, collectives, and why the cut
    ir DIR [--after PASS]           the IR after a pass (name or number); without --after, the
                                    passes with their line counts
    diff DIR_A DIR_B [--code [--rank R]]
                                    what differs between two plans: config, placements,
                                    collectives, bytes per rank; --code adds gencode{R}.py's diff
    plot DIR -o FILE                draw the op graph (png, svg, pdf): a box per module, coloured
                                    by placement, its weights' placements beside it; repeated
                                    blocks drawn once, the identical rest summarized
    memory PROFILE [-o FILE [--x events|time]] [--predicted PLAN]
                                    a memory profile (nncompile.memory.profile(...).save): the
                                    predicted-vs-measured table; -o draws the timeline per rank

DIR is a gen_savedir (holding one instance) or an instance directory (holding manifest.json).
"""
from __future__ import annotations

import argparse
import io
import os
import sys


def _profile(args) -> int:
    import torch
    import torch.distributed as dist

    from nncompile.passes.autodist import measure_profile, save_profile
    if "RANK" in os.environ and not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    if args.threads:
        torch.set_num_threads(args.threads)
    prof = measure_profile(args.name)
    if not dist.is_initialized() or dist.get_rank() == 0:
        path = save_profile(prof, args.output)
        where = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
        print(f"{profile_summary(prof, where)} -> {path}")
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


def fmt_rate(per_s: float, unit: str = "FLOP/s") -> str:
    """A rate with the prefix that keeps 1 to 3 digits before the point: 0.45 TFLOP/s is
    `450 GFLOP/s`, 3.2e9 is `3.20 GFLOP/s`."""
    prefix, scale = next(((p, sc) for p, sc in (("P", 1e15), ("T", 1e12), ("G", 1e9),
                                                 ("M", 1e6), ("k", 1e3)) if abs(per_s) >= sc),
                         ("", 1.0))
    v = per_s / scale
    digits = 0 if abs(v) >= 100 else 1 if abs(v) >= 10 else 2
    return f"{v:.{digits}f} {prefix}{unit}"


def profile_summary(prof, device: str = "CPU") -> str:
    """One line: matmul speed per dtype (a dtype slower than float32 is marked as not
    accelerated on `device`), memory bandwidth and capacity."""
    base = prof.flops.get("float32")
    peak = []
    for dtype, v in prof.flops.items():
        text = f"{dtype} {fmt_rate(v)}"
        if dtype != "float32" and base and v < base:
            text += f" (not accelerated on this {device}: {base / v:.1f}x slower than float32)"
        peak.append(text)
    return (f"{prof.name}: matmul {', '.join(peak) or 'not measured'}; memory "
            f"{fmt_rate(prof.mem_bandwidth, 'B/s')}, {prof.mem_capacity_gb:.1f} GB")


def _merge(args) -> int:
    from nncompile.errors import NNCompileError
    from nncompile.runtime.checkpoints.checkpoint import merge_checkpoint
    try:
        out = merge_checkpoint(args.inputs, args.output)
    except NNCompileError as e:
        print(f"nncompile merge: {e}", file=sys.stderr)
        return 2
    print(f"merged {len(args.inputs)} input(s) -> {out}")
    return 0


def _export(args) -> int:
    from nncompile.errors import NNCompileError
    from nncompile.runtime.checkpoints.pretrained import export_pretrained
    shard = int(args.max_shard_size) if args.max_shard_size.isdigit() else args.max_shard_size
    try:
        out = export_pretrained(args.inputs, args.output, args.config, prefix=args.prefix,
                                max_shard_size=shard)
    except NNCompileError as e:
        print(f"nncompile export: {e}", file=sys.stderr)
        return 2
    print(f"exported {' '.join(args.inputs)} -> {out} ({', '.join(sorted(os.listdir(out)))})")
    return 0


def _inspect(args) -> int:
    from nncompile.tools import inspection
    from nncompile.errors import NNCompileError
    try:
        if args.command == "show":
            print(inspection.show(args.dir))
        elif args.command == "ir":
            print(inspection.ir_after(args.dir, args.after), end="" if args.after else "\n")
        elif args.command == "diff":
            print(inspection.diff(args.a, args.b, code=args.code, rank=args.rank))
        else:
            print(f"wrote {inspection.plot(args.dir, args.output)}")
    except NNCompileError as e:
        print(f"nncompile {args.command}: {e}", file=sys.stderr)
        return 2
    return 0


def _memory(args) -> int:
    from nncompile.tools import memory
    from nncompile.errors import NNCompileError
    try:
        prof = memory.load(args.profile)
        if args.predicted:
            found = memory.load_predicted(args.predicted)
            if found is None:
                print(f"nncompile memory: {args.predicted} has no autodist memory estimate; "
                      "showing the profile's own prediction", file=sys.stderr)
            else:
                prof.predicted = found
        print(prof.table())
        if args.output:
            print(f"wrote {prof.plot(args.output, x=args.x)}")
    except NNCompileError as e:
        print(f"nncompile memory: {e}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="nncompile", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("profile", help="measure this machine for the autodist cost model")
    p.add_argument("-o", "--output", required=True, help="profile .json to write")
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads while timing (default: as set; torchrun sets 1): "
                        "time with the threads each rank will train with")
    p.add_argument("--name", default="measured")
    p.set_defaults(func=_profile)
    p = sub.add_parser("merge", help="merge a checkpoint's per-rank files into one")
    p.add_argument("inputs", nargs="+", help="rank*.pt files or checkpoint directories")
    p.add_argument("-o", "--output", required=True, help="merged .pt file to write")
    p.set_defaults(func=_merge)
    p = sub.add_parser("export", help="a checkpoint of any format -> Hugging Face safetensors "
                                      "files (what model.save_pretrained writes)")
    p.add_argument("inputs", nargs="+", help="checkpoint directory, rank*.pt files, a merged "
                                             "file or a state_dict file")
    p.add_argument("-o", "--output", required=True, help="directory to write")
    p.add_argument("--config", help="the Hugging Face model's config.json, or its directory "
                                    "(default: config.json beside the checkpoint; without one "
                                    "the names are the module's own)")
    p.add_argument("--prefix", help="the model's prefix in the checkpoint's keys (default: "
                                    "found from the config's model)")
    p.add_argument("--max-shard-size", default="50GB",
                   help="as model.save_pretrained's (default 50GB): bytes or '5GB', '200MB'")
    p.set_defaults(func=_export)
    p = sub.add_parser("show", help="per-rank parameters, collectives and the plan summary "
                                    "(and the pipeline stages)")
    p.add_argument("dir", help="gen_savedir or instance directory")
    p.set_defaults(func=_inspect)
    p = sub.add_parser("ir", help="the IR after a pass, or the list of passes")
    p.add_argument("dir", help="gen_savedir or instance directory")
    p.add_argument("--after", metavar="PASS", help="pass name (e.g. constant_fold) or number")
    p.set_defaults(func=_inspect)
    p = sub.add_parser("diff", help="what differs between two plans")
    p.add_argument("a", help="first gen_savedir or instance directory")
    p.add_argument("b", help="second gen_savedir or instance directory")
    p.add_argument("--code", action="store_true", help="add a unified diff of gencode{R}.py")
    p.add_argument("--rank", type=int, default=None, metavar="R",
                   help="the rank file --code compares (default 0)")
    p.set_defaults(func=_inspect)
    p = sub.add_parser("plot", help="draw the op graph by module, coloured by placement, "
                                    "repeated blocks drawn once")
    p.add_argument("dir", help="gen_savedir or instance directory")
    p.add_argument("-o", "--output", required=True, help="image to write (.png, .svg, .pdf)")
    p.set_defaults(func=_inspect)
    p = sub.add_parser("memory", help="a memory profile: predicted vs measured, timeline image")
    p.add_argument("profile", help="profile .json written by nncompile.memory.profile().save()")
    p.add_argument("-o", "--output", help="image of the timeline to write (.png, .svg, .pdf)")
    p.add_argument("--x", choices=("events", "time"), default="events",
                   help="the image's x axis: memory changes in order (default) or ms")
    p.add_argument("--predicted", metavar="PLAN",
                   help="compare with the autodist estimate in this plan.json, instance "
                        "directory or gen_savedir")
    p.set_defaults(func=_memory)
    args = ap.parse_args(argv)
    if args.command == "diff":
        if args.rank is not None and not args.code:
            ap.error("--rank selects the file --code compares; add --code")
        args.rank = args.rank or 0
    try:
        status = args.func(args)
        sys.stdout.flush()
    except BrokenPipeError:
        # the reader stopped early (`nncompile show DIR | head`): stop quietly, as `cat` does;
        # stdout goes to devnull so that the flush at exit does not raise again
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError, io.UnsupportedOperation):
            pass
        return 1
    return status


if __name__ == "__main__":
    sys.exit(main())
