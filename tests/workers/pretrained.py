"""Hugging Face checkpoints out of and into parallel plans, on gloo ranks (torchrun).

save: Llama (tied embeddings) and Mixtral, each trained 3 AdamW steps under tp 2, ZeRO-3 dp 2
      (Mixtral: with offload_params) and pp 2 (1F1B) (expert parallelism: the conformance
      suite's ep_tp cell); then
      nncompile.save_pretrained. Rank 0 checks that AutoModelForCausalLM.from_pretrained(dir)
      holds exactly the gathered weights and that the files and the index are those
      model.save_pretrained writes for the same weights (some cases with small shards, so
      both ranks write files); load_pretrained of those files into the same plan over other
      initial weights gives the same weights back.
load: a checkpoint written by model.save_pretrained loads with load_pretrained into the model
      built on meta and compiled for tp 2 x ZeRO-3 dp 2: the loss equals the eager model's;
      each rank prints its shard, the peak resident memory the load added (VmHWM, reset
      just before) and the full model's bytes; then the same for save_pretrained.
"""
import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import nncompile  # noqa: E402
from models import HFCausalLM  # noqa: E402
from nncompile.rows import param_rows  # noqa: E402
from nncompile.tools.resident import reset_peak, status  # noqa: E402


def config(arch: str, size: str = "small"):
    from transformers import LlamaConfig, MixtralConfig
    common = dict(bos_token_id=0, eos_token_id=0, pad_token_id=0, max_position_embeddings=64)
    if arch == "mixtral":
        return MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             num_local_experts=4, num_experts_per_tok=2,
                             router_aux_loss_coef=0.0, **common)
    if size == "big":       # ~125 MB of float32 weights: resident memory shows the shard
        return LlamaConfig(vocab_size=8000, hidden_size=512, intermediate_size=1376,
                           num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                           tie_word_embeddings=False, **common)
    return LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                       **common)


def build(arch: str, size: str = "small", seed: int = 0):
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config(arch, size))


def batch(step: int, vocab: int = 64, rows: int = 4) -> dict:
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(1, vocab, (rows, 16), generator=g)
    return {"input_ids": ids, "labels": ids}


# name: (arch, plan_ngpus, ComputeConfig kwargs, policy, max_shard_size)
CASES = {
    "llama-tp2": ("llama", 2, {}, "tp", "50GB"),
    "llama-zero3": ("llama", 1, {"use_zero": 3}, "data", 20000),
    "llama-pp2": ("llama", 2, {"parallel": {"pp": 2, "microbatches": 2}},
                  "tp", "50GB"),
    "mixtral-tp2": ("mixtral", 2, {}, "tp", 20000),
    "mixtral-zero3-offload": ("mixtral", 1, {"use_zero": 3, "offload_params": True}, "data",
                              "50GB"),
    "mixtral-pp2": ("mixtral", 2, {"parallel": {"pp": 2, "microbatches": 2}},
                    "data", 20000),
}


def save_case(name: str, workdir: str) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    arch, plan, kw, policy, shard = CASES[name]
    rank, world = dist.get_rank(), dist.get_world_size()
    model = HFCausalLM(build(arch))
    cfg = nncompile.ComputeConfig(plan, world, **kw)
    pipelined = "pp" in kw.get("parallel", {})
    rows = 4 * plan // world                 # each data-parallel unit its share

    def unit_batch(step: int, unit: int) -> dict:
        return {k: v[unit * rows:(unit + 1) * rows] for k, v in batch(step).items()}

    pm = nncompile.parallelize(model, unit_batch(0, 0), cfg, pas_policy=policy,
                               gen_savedir=os.path.join(workdir, "gen"), instance_name=name)
    opt = nncompile.build_optimizer(pm, torch.optim.AdamW, lr=1e-2)
    for step in range(3):
        b = unit_batch(step, rank // plan)
        if pipelined:
            pm.train_step(**b)
        else:
            pm(**b).backward()
        opt.step()
        opt.zero_grad()
    full = {k.removeprefix("model."): v for k, v in pm.gather_params().items()}
    out = os.path.join(workdir, name)
    nncompile.save_pretrained(pm, out, max_shard_size=shard)
    # and back in: the same plan (its generated code reused) over other initial weights
    fresh = nncompile.parallelize(HFCausalLM(build(arch, seed=7)), unit_batch(0, 0), cfg,
                                  pas_policy=policy, gen_savedir=os.path.join(workdir, "gen"),
                                  instance_name=name)
    nncompile.load_pretrained(fresh, out)
    for k, v in fresh.gather_params().items():
        assert torch.equal(v, full[k.removeprefix("model.")]), f"{name}: {k} after loading"
    if rank == 0:
        loaded = AutoModelForCausalLM.from_pretrained(out).state_dict()
        for k, v in full.items():
            assert torch.equal(loaded[k], v), f"{name}: {k} differs after from_pretrained"
        assert set(loaded) - set(full) <= {"lm_head.weight"}, set(loaded) ^ set(full)
        plain = build(arch)
        plain.load_state_dict(full, strict=False)
        plain.tie_weights()
        ref = os.path.join(workdir, name + "-hf")
        plain.save_pretrained(ref, max_shard_size=shard)
        files, want = sorted(os.listdir(out)), sorted(os.listdir(ref))
        assert files == want, f"{name}: files {files} vs model.save_pretrained's {want}"
        for f in files:
            if f.endswith(".json"):
                got, exp = (json.load(open(os.path.join(d, f))) for d in (out, ref))
                if f == "config.json":
                    got.pop("transformers_version", None), exp.pop("transformers_version", None)
                assert got == exp, f"{name}: {f} differs from model.save_pretrained's"
            else:
                got, exp = (load_file(os.path.join(d, f)) for d in (out, ref))
                assert got.keys() == exp.keys(), f"{name}: {f} holds {sorted(got)[:4]}"
                for k in got:
                    assert torch.equal(got[k], exp[k]) and got[k].dtype == exp[k].dtype, \
                        f"{name}: {f}:{k} differs from model.save_pretrained's"
        print(f"{name}: {len(files)} files like model.save_pretrained, "
              f"{len(full)} weights exact", flush=True)
    dist.barrier()


def load_case(ckpt: str, workdir: str) -> None:
    from transformers import AutoModelForCausalLM
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = config("llama", "big")
    with torch.device("meta"):
        model = HFCausalLM(AutoModelForCausalLM.from_config(cfg))
    b = batch(0, cfg.vocab_size, rows=2)
    pm = nncompile.parallelize(model, b, nncompile.ComputeConfig(2, world, use_zero=3),
                               pas_policy="tp", gen_savedir=os.path.join(workdir, "gen"),
                               instance_name="load")
    shard = sum(p.numel() * p.element_size() for p in pm.stored_parameters())
    full = 4 * sum({r.source: int(torch.Size(r.source_shape).numel())
                    for r in param_rows(pm)}.values())
    before = status("VmRSS")
    reset_peak()                                        # VmHWM := VmRSS
    nncompile.load_pretrained(pm, ckpt)
    added = status("VmHWM") - before
    with torch.no_grad():
        loss = float(pm(**b))
    want = float(torch.load(os.path.join(ckpt, "loss.pt")))
    assert abs(loss - want) <= 1e-5 * abs(want), f"loss {loss} vs the eager model's {want}"
    before = status("VmRSS")
    reset_peak()
    nncompile.save_pretrained(pm, os.path.join(workdir, "saved"))
    saved = status("VmHWM") - before
    sys.stdout.write(f"rank {rank}: loss {loss:.6f} == eager {want:.6f}; shard "
                     f"{shard / 2**20:.1f} MiB, load added {added / 2**20:.1f} MiB at its peak, "
                     f"save {saved / 2**20:.1f} MiB, model {full / 2**20:.1f} MiB, ratio "
                     f"{(shard + added) / full:.3f}, save ratio {(shard + saved) / full:.3f}\n")
    sys.stdout.flush()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=("save", "load"))
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--ckpt")
    ap.add_argument("--cases", nargs="*", default=list(CASES))
    args = ap.parse_args()
    dist.init_process_group("gloo")
    if args.mode == "save":
        for name in args.cases:
            save_case(name, args.workdir)
    else:
        load_case(args.ckpt, args.workdir)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
