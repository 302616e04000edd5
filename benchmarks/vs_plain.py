"""The generated program against the plain model it came from: time and peak memory of one
training step, side by side, for Hugging Face Llama, Qwen2, Mistral, GPT-2 and Gemma-2.

    python benchmarks/vs_plain.py [--models llama,qwen2,...] [--hidden 512 --layers 4 --batch 8 --seq 1024]
    python benchmarks/vs_plain.py --device cuda --dtype bfloat16 --hidden 1024 --layers 8
    python benchmarks/vs_plain.py --zero          # adds ZeRO-3 beside FSDP2 at world 1 and 2
    python benchmarks/vs_plain.py --without fuse_attention,free_at_last_use   # what each buys

Each run is its own process (so one model's memory never hides in another's): it builds the
model from a config (seed 0, no download), and for the generated program compiles it with
`nncompile.parallelize(..., ComputeConfig(1, 1), pas_policy="dp")`. Then --warmup + --steps
training steps on the same batch: `loss = model(input_ids=ids, labels=ids)`, backward,
AdamW step, `zero_grad(set_to_none=True)`. Time is the median step.

Peak memory, three ways:
  outside  the largest resident set the process ever had, read by this parent from the
           kernel (`os.wait4` of the finished child: its rusage, with its own children's): nothing the program
           does can hide from it. It includes building and compiling the model.
  step     the kernel's high-water mark of the resident set (VmHWM) over the timed steps,
           reset just before them (`/proc/self/clear_refs`): the training step itself.
  cuda     `torch.cuda.max_memory_allocated` over the timed steps (--device cuda).

--zero adds, at world 1 and 2 (torchrun, gloo on CPU / NCCL on CUDA), nncompile ZeRO-3
(`use_zero=3`) and FSDP2 (`fully_shard` on every decoder layer, then the root) on the same
model and batch; memory is the largest rank's.

--without compiles the generated program once more per named part with that part of the
compiler turned off (the `fuse_attention` pass; the `del` lines of free-at-last-use), so the
table says what each one is worth.

Every run prints its losses; the parent checks the plain and generated losses agree (float32:
1e-4 relative; bfloat16: 5e-2) so the comparison is between the same computations. The table
is printed and appended to benchmarks/results/vs_plain_<cpu|cuda>.txt; --json writes every
number.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

MODELS = ["llama", "qwen2", "mistral", "gpt2", "gemma2"]
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from nncompile.tools.resident import reset_peak, status  # noqa: E402


def hf_model(name: str, d: int, layers: int, vocab: int, seq: int):
    """A causal LM from its Hugging Face config, d_model `d`, `layers` layers, head dim 64."""
    import transformers as tf
    heads = max(1, d // 64)
    kv = max(1, heads // 4)                        # grouped-query attention where the family has it
    common = dict(vocab_size=vocab, hidden_size=d, num_hidden_layers=layers,
                  num_attention_heads=heads, max_position_embeddings=max(seq, 2048),
                  bos_token_id=0, eos_token_id=0, pad_token_id=0)
    if name == "gpt2":
        cfg = tf.GPT2Config(vocab_size=vocab, n_embd=d, n_layer=layers, n_head=heads,
                            n_positions=max(seq, 1024), resid_pdrop=0.0, embd_pdrop=0.0,
                            attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        return tf.GPT2LMHeadModel(cfg)
    inter = int(8 * d / 3 + 127) // 128 * 128
    if name == "llama":
        cfg = tf.LlamaConfig(intermediate_size=inter, num_key_value_heads=kv, **common)
        return tf.LlamaForCausalLM(cfg)
    if name == "qwen2":
        cfg = tf.Qwen2Config(intermediate_size=inter, num_key_value_heads=kv, **common)
        return tf.Qwen2ForCausalLM(cfg)
    if name == "mistral":
        cfg = tf.MistralConfig(intermediate_size=inter, num_key_value_heads=kv,
                               sliding_window=4096, **common)
        return tf.MistralForCausalLM(cfg)
    if name == "gemma2":
        cfg = tf.Gemma2Config(intermediate_size=inter, num_key_value_heads=kv, head_dim=64,
                              attention_dropout=0.0, **common)
        return tf.Gemma2ForCausalLM(cfg)
    raise SystemExit(f"unknown model {name!r}; pick from {', '.join(MODELS)}")


class CausalLMLoss(__import__("torch").nn.Module):
    """model(input_ids, labels=input_ids).loss, as a training script calls it."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, labels):
        return self.model(input_ids=input_ids, labels=labels, use_cache=False).loss


# ---- one run (a child process) ---------------------------------------------------------------
def run_child(args) -> None:
    import torch
    import torch.distributed as dist
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    device = torch.device(args.device if args.device == "cpu" else
                          f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dtype = getattr(torch, args.dtype)
    if args.variant in ("zero3", "fsdp2") and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    torch.manual_seed(0)
    model = CausalLMLoss(hf_model(args.model, args.hidden, args.layers, args.vocab, args.seq))
    model = model.to(device=device, dtype=dtype).train()
    g = torch.Generator().manual_seed(1 + rank)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(device)
    batch = {"input_ids": ids, "labels": ids}
    if args.variant in ("generated", "zero3"):
        os.environ.setdefault("NNCOMPILE_QUIET", "1")
        import nncompile
        turn_off(args.without)
        with tempfile.TemporaryDirectory() as savedir:
            cfg = nncompile.ComputeConfig(plan_ngpus=1, runtime_ngpus=world,
                                          use_zero=3 if args.variant == "zero3" else 0)
            net = nncompile.parallelize(model, batch, cfg, pas_policy="dp", gen_savedir=savedir)
        opt = nncompile.build_optimizer(net, torch.optim.AdamW, lr=1e-4)
    elif args.variant == "fsdp2":
        from torch.distributed.fsdp import fully_shard
        for layer in layers_of(model):
            fully_shard(layer)
        net = fully_shard(model)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
    else:
        net = model
        opt = torch.optim.AdamW(net.parameters(), lr=1e-4)

    def step() -> float:
        if world > 1:
            dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        loss = net(**batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        value = loss.item()
        if device.type == "cuda":
            torch.cuda.synchronize()
        losses.append(value)
        return time.perf_counter() - start

    losses: list[float] = []
    for _ in range(args.warmup):
        step()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    base = status("VmRSS")
    reset_peak()
    times = [step() for _ in range(args.steps)]
    out = {"model": args.model, "variant": args.variant, "world": world, "rank": rank,
           "median_ms": statistics.median(times) * 1e3, "losses": losses,
           "step_hwm": status("VmHWM"), "base_rss": base, "torch": torch.__version__,
           "cuda_peak": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None}
    if world > 1:
        every = [None] * world
        dist.all_gather_object(every, out)
        dist.destroy_process_group()
        if rank != 0:
            return
        out = max(every, key=lambda o: o["cuda_peak"] or o["step_hwm"] or 0)
        out["median_ms"] = max(o["median_ms"] for o in every)
    print("RESULT " + json.dumps(out), flush=True)


PARTS = ("fuse_attention", "free_at_last_use")


def turn_off(parts: str) -> None:
    """Compile without the named parts of the compiler (an ablation: what each one buys)."""
    import nncompile.api
    import nncompile.codegen
    import nncompile.codegen.body
    import nncompile.codegen.lifetimes
    for part in filter(None, parts.split(",")):
        if part == "fuse_attention":
            build = nncompile.api.build_pipeline
            nncompile.api.build_pipeline = lambda config, policy: [
                p for p in build(config, policy) if getattr(p, "name", None) != part]
        elif part == "free_at_last_use":
            def keep_all(statements, keep, skip):
                return [[] for _ in statements]
            nncompile.codegen.lifetimes.last_uses = nncompile.codegen.last_uses = \
                nncompile.codegen.body.last_uses = keep_all
        else:
            raise SystemExit(f"--without {part!r}: pick from {', '.join(PARTS)}")


def layers_of(model):
    inner = model.model
    body = getattr(inner, "model", None) or getattr(inner, "transformer", None)
    return list(getattr(body, "layers", None) or getattr(body, "h"))


# ---- the parent -------------------------------------------------------------------------------
def spawn(args, model: str, variant: str, world: int, without: str = "") -> dict:
    child = [__file__, "--child", "--model", model, "--variant", variant,
             *([f"--without={without}"] if without else []),
             *[f"--{k.replace('_', '-')}={v}" for k, v in
               [("device", args.device), ("dtype", args.dtype), ("hidden", args.hidden),
                ("layers", args.layers), ("batch", args.batch), ("seq", args.seq),
                ("vocab", args.vocab), ("steps", args.steps), ("warmup", args.warmup)]]]
    cmd = ([sys.executable, *child] if variant in ("plain", "generated") else
           [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}",
            "--master_port", str(29600 + os.getpid() % 300), *child])
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    with tempfile.TemporaryFile("w+") as out_f, tempfile.TemporaryFile("w+") as err_f:
        proc = subprocess.Popen(cmd, env=env, stdout=out_f, stderr=err_f, text=True)
        # this child's own rusage (with its descendants'): the largest resident set it had
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        out_f.seek(0), err_f.seek(0)
        stdout, stderr = out_f.read(), err_f.read()
    line = next((ln for ln in stdout.splitlines() if ln.startswith("RESULT ")), None)
    if proc.returncode or line is None:
        raise SystemExit(f"{model} {variant} (world {world}) failed:\n{stdout[-3000:]}\n"
                         f"{stderr[-3000:]}")
    out = json.loads(line[len("RESULT "):])
    out["outside"] = usage.ru_maxrss * 1024
    return out


def gib(b) -> str:
    return "-" if b is None else f"{b / 2 ** 30:.3f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--zero", action="store_true", help="add ZeRO-3 and FSDP2 at world 1 and 2")
    ap.add_argument("--without", default="", help="also compile without each of these parts "
                    f"(comma list of {', '.join(PARTS)}): what each one buys")
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--variant", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return run_child(args)

    rows, records, ablations = [], [], []
    tol = 1e-4 if args.dtype == "float32" else 5e-2
    # runs in increasing memory order would leave `outside` blank; plain first, then ours,
    # so a larger generated program always shows
    for model in args.models.split(","):
        plain = spawn(args, model, "plain", 1)
        gen = spawn(args, model, "generated", 1)
        diff = max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(plain["losses"], gen["losses"]))
        records += [plain, gen]
        rows.append((model, plain, gen, diff))
        for part in filter(None, args.without.split(",")):
            off = spawn(args, model, "generated", 1, without=part)
            off["without"] = part
            records.append(off)
            ablations.append((model, part, plain, off))
        print(f"{model}: plain {plain['median_ms']:.1f} ms, generated {gen['median_ms']:.1f} ms; "
              f"step peak {gib(plain['step_hwm'])} vs {gib(gen['step_hwm'])} GiB "
              f"(before the steps {gib(plain['base_rss'])} vs {gib(gen['base_rss'])}); "
              f"loss diff {diff:.1e}", flush=True)
    zero_rows = []
    if args.zero:
        for model in args.models.split(","):
            for world in (1, 2):
                z, f = spawn(args, model, "zero3", world), spawn(args, model, "fsdp2", world)
                records += [z, f]
                zero_rows.append((model, world, z, f))

    mem = "cuda" if args.device != "cpu" else "step"
    lines = [f"# python benchmarks/vs_plain.py --device {args.device} --dtype {args.dtype} "
             f"--hidden {args.hidden} --layers {args.layers} --batch {args.batch} --seq {args.seq}",
             f"generated vs plain -- {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')} "
             f"on {platform.node()}, torch {records[0]['torch']}, {args.threads} thread(s), "
             f"vocab {args.vocab}, AdamW, {args.steps} timed steps after {args.warmup}",
             f"{'model':<8} {'plain ms':>9} {'gen ms':>9} {'time':>6}  {'plain GiB':>9} "
             f"{'gen GiB':>9} {'memory':>6}  {'outside plain/gen GiB':>22}  loss diff"]
    for model, p, g, diff in rows:
        pm, gm = p["cuda_peak"] or p["step_hwm"], g["cuda_peak"] or g["step_hwm"]
        lines.append(f"{model:<8} {p['median_ms']:9.1f} {g['median_ms']:9.1f} "
                     f"{g['median_ms'] / p['median_ms']:6.3f}  {gib(pm):>9} {gib(gm):>9} "
                     f"{gm / pm:6.3f}  {gib(p['outside']):>10} / {gib(g['outside']):<9}  "
                     f"{diff:.1e}{'  (DIFFERENT)' if diff > tol else ''}")
    for model, part, p, g in ablations:
        pm, gm = p["cuda_peak"] or p["step_hwm"], g["cuda_peak"] or g["step_hwm"]
        lines.append(f"{model:<8} without {part}: {g['median_ms']:.1f} ms ({g['median_ms'] / p['median_ms']:.3f} "
                     f"of plain), {gib(gm)} GiB ({gm / pm:.3f} of plain)")
    for model, world, z, f in zero_rows:
        zm, fm = z["cuda_peak"] or z["step_hwm"], f["cuda_peak"] or f["step_hwm"]
        lines.append(f"{model:<8} world {world}: ZeRO-3 {z['median_ms']:.1f} ms {gib(zm)} GiB, "
                     f"FSDP2 {f['median_ms']:.1f} ms {gib(fm)} GiB ({mem}); ZeRO-3/FSDP2 "
                     f"time {z['median_ms'] / f['median_ms']:.3f}, memory {zm / fm:.3f}")
    text = "\n".join(lines)
    print(text)
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    with open(os.path.join(HERE, "results", f"vs_plain_{args.device.split(':')[0]}.txt"), "a") as f:
        f.write(text + "\n\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    if any(diff > tol for *_, diff in rows):
        raise SystemExit("the generated program's losses differ from the plain model's")


if __name__ == "__main__":
    main()
