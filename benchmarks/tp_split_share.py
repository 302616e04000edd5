"""What `tp` does to each model's layer blocks at plan 2, for model code people use: built from
tiny configs (no download), each model is compiled and checked once by
`nncompile.verify` (2 simulated ranks in one process), and the table gives

  split              the share of block weight elements (parameters of 2 or more dims inside
                     numbered blocks, `h.3.attn.c_attn.weight`) that plan.json places as a
                     Shard; a parameter split into parts (plan.json's "param_parts": a fused
                     q/k/v projection held as its q, k and v rows) counts each part's elements
                     toward its source parameter;
  all-reduces/block  forward all-reduces of the plan (plan.json's "collectives", or the
                     `comm.all_reduce(` calls in rank 0's generated forward when the plan has no
                     such table) per block; Megatron's plan of a transformer block has 2;
  parity             loss and gradients of the 2 ranks against one device (rtol 1e-5,
                     atol 1e-6 in float32): "ok", or the largest error.

    python benchmarks/tp_split_share.py                      # every model, a markdown table
    python benchmarks/tp_split_share.py nanogpt,hf_gpt2      # some of them
    python benchmarks/tp_split_share.py --list

It reads only plan.json and the generated files, so it measures older versions of nncompile
too. A Megatron plan of a transformer splits every block weight (1.000); what stays replicated
is named by the `tp` warning (--warnings shows it).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "examples" / "nanogpt"))


def _wrap_lm(model, call_kw):
    """A causal / masked LM called as training scripts call it: labels = the input ids."""
    import torch

    class HFLoss(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, input_ids, labels):
            return self.m(input_ids=input_ids, labels=labels, **call_kw).loss
    return HFLoss(model)


def _wrap_img(model):
    import torch

    class ImgLoss(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, pixel_values, labels):
            return self.m(pixel_values=pixel_values, labels=labels).loss
    return ImgLoss(model)


def _ids(vocab=64, batch=2, seq=16):
    import torch
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    return {"input_ids": ids, "labels": ids}


def hf_lm(config_cls, model_cls, blocks=2, call_kw=None, **kw):
    """(model, batch, number of blocks) for a Hugging Face LM with vocabulary 64."""
    import torch
    torch.manual_seed(0)
    model = model_cls(config_cls(vocab_size=64, **kw))
    return _wrap_lm(model, {"use_cache": False} if call_kw is None else call_kw), _ids(), blocks


def nanogpt():
    """examples/nanogpt/model.py: nanoGPT's layout (fused c_attn split in three)."""
    import torch
    from model import GPT, GPTConfig
    torch.manual_seed(0)
    m = GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=4, n_embd=32,
                      dropout=0.0))
    b = _ids()
    return m, {"idx": b["input_ids"], "targets": b["labels"]}, 2


def torchtitan_llama():
    import torch
    from torchtitan_llama import ModelArgs, TrainLM
    torch.manual_seed(0)
    b = _ids()
    return TrainLM(ModelArgs()), {"tokens": b["input_ids"], "labels": b["labels"]}, 2


def swin():
    import torch
    import transformers as tf
    torch.manual_seed(0)
    m = tf.SwinForImageClassification(tf.SwinConfig(
        image_size=32, patch_size=4, embed_dim=16, depths=[2, 2], num_heads=[2, 4],
        window_size=4, num_labels=5, drop_path_rate=0.0))
    g = torch.Generator().manual_seed(1)
    return _wrap_img(m), {"pixel_values": torch.randn(2, 3, 32, 32, generator=g),
                          "labels": torch.tensor([1, 0])}, 4


def resnet():
    import torch
    import transformers as tf
    torch.manual_seed(0)
    m = tf.ResNetForImageClassification(tf.ResNetConfig(
        embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], layer_type="basic",
        num_labels=5))
    g = torch.Generator().manual_seed(1)
    return _wrap_img(m), {"pixel_values": torch.randn(2, 3, 32, 32, generator=g),
                          "labels": torch.tensor([1, 0])}, 2


def _tf():
    import transformers
    return transformers


def deepseek_v3_full_dims():
    """One dense DeepSeek-V3 layer at the model's real sizes (hidden 7168, 128 heads, q/kv
    LoRA ranks 1536/512), built on the meta device: the low-rank down-projections Megatron
    keeps replicated weigh what they weigh in the real model (the tiny config inflates them).
    Compiled only (no weights, so no parity run)."""
    import torch
    tf = _tf()
    cfg = tf.DeepseekV3Config(
        vocab_size=1024, hidden_size=7168, intermediate_size=18432, num_hidden_layers=1,
        first_k_dense_replace=1, num_attention_heads=128, num_key_value_heads=128,
        q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
        v_head_dim=128, max_position_embeddings=64, rope_scaling=None)
    with torch.device("meta"):
        model = _wrap_lm(tf.DeepseekV3ForCausalLM(cfg), {"use_cache": False})
    return model, _ids(vocab=1024), 1


MODELS = {
    "nanogpt": nanogpt,
    "hf_gpt2": lambda: hf_lm(_tf().GPT2Config, _tf().GPT2LMHeadModel, n_embd=32, n_layer=2,
                             n_head=4, n_positions=32),
    "gpt_bigcode": lambda: hf_lm(_tf().GPTBigCodeConfig, _tf().GPTBigCodeForCausalLM,
                                 n_embd=32, n_layer=2, n_head=4, n_positions=32),
    "falcon_multi_query": lambda: hf_lm(
        _tf().FalconConfig, _tf().FalconForCausalLM, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=4, ffn_hidden_size=64, bos_token_id=0, eos_token_id=0),
    "falcon_per_head": lambda: hf_lm(
        _tf().FalconConfig, _tf().FalconForCausalLM, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=4, ffn_hidden_size=64, bos_token_id=0, eos_token_id=0,
        multi_query=False, new_decoder_architecture=False),
    "falcon_grouped": lambda: hf_lm(
        _tf().FalconConfig, _tf().FalconForCausalLM, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=4, ffn_hidden_size=64, bos_token_id=0, eos_token_id=0,
        new_decoder_architecture=True, num_kv_heads=2),
    "gpt_neox": lambda: hf_lm(
        _tf().GPTNeoXConfig, _tf().GPTNeoXForCausalLM, hidden_size=32, intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=32),
    "phi3": lambda: hf_lm(
        _tf().Phi3Config, _tf().Phi3ForCausalLM, hidden_size=32, intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=32, pad_token_id=0, bos_token_id=0, eos_token_id=0),
    "deepseek_v3": lambda: hf_lm(
        _tf().DeepseekV3Config, _tf().DeepseekV3ForCausalLM, hidden_size=32,
        intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16,
        qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8, n_routed_experts=4,
        num_experts_per_tok=2, first_k_dense_replace=2, max_position_embeddings=32,
        rope_scaling=None),
    "deepseek_v3_full_dims": lambda: deepseek_v3_full_dims(),
    "swin": swin,
    "deberta_v2": lambda: hf_lm(
        _tf().DebertaV2Config, _tf().DebertaV2ForMaskedLM, call_kw={}, hidden_size=32,
        num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=32),
    "torchtitan_llama": torchtitan_llama,
    "resnet": resnet,
}
ALIASES = {"gpt2": "hf_gpt2", "bigcode": "gpt_bigcode", "falcon": "falcon_multi_query",
           "deepseek": "deepseek_v3", "deberta": "deberta_v2", "torchtitan": "torchtitan_llama"}


def split_share(plan: dict, shapes: dict) -> float | None:
    """Share of block weight elements placed as a Shard; parts count toward their source."""
    import math
    parts = plan.get("param_parts", {})
    tot = sp = 0
    for key, placement in plan["params"].items():
        part = parts.get(key)
        source = part["source"] if part else key
        shape = shapes.get(source)
        if shape is None or len(shape) < 2 or not re.search(r"\.\d+\.", source):
            continue
        n = math.prod(b - a for a, b in part["box"]) if part else math.prod(shape)
        tot += n
        sp += n if str(placement).startswith("S") else 0
    return sp / tot if tot else None


def forward_all_reduces(plan: dict, outdir: Path) -> int:
    """Forward all-reduces of the plan: plan.json's collectives table, else rank 0's forward."""
    table = plan.get("collectives")
    if table is not None:
        return int(table.get("comm.all_reduce", 0))
    text = (outdir / "gencode0.py").read_text()
    fwd = text.split("def backward", 1)[0] if "def backward" in text else text
    return len(re.findall(r"comm\.all_reduce\(", fwd))


class _CompileOnly(Exception):
    pass


def measure(name: str, show_warnings: bool = False) -> dict:
    import nncompile
    model, batch, blocks = MODELS[name]()
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    t0 = time.perf_counter()
    row = {"model": name, "split": None, "allreduce": None, "parity": None}
    with tempfile.TemporaryDirectory() as d, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            if any(p.is_meta for p in model.parameters()):      # real sizes: compile only
                nncompile.parallelize(model, batch, nncompile.ComputeConfig(2), pas_policy="tp",
                                      gen_savedir=d, load_module=False)
                raise _CompileOnly
            report = nncompile.verify(model, batch, nncompile.ComputeConfig(2, 2),
                                      pas_policy="tp", gen_savedir=d)
            row["parity"] = "ok" if report.ok else f"max err {report.max_error:.1e}" + (
                " (an op's value diverges)" if report.divergence is not None else "")
        except _CompileOnly:
            row["parity"] = "not run (meta device)"
        except Exception as e:                          # noqa: BLE001  (the table says it)
            row["parity"] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:80]}"
        outs = list(Path(d).glob("*/plan.json"))
        if outs:
            plan = json.loads(outs[0].read_text())
            row["split"] = split_share(plan, shapes)
            row["allreduce"] = forward_all_reduces(plan, outs[0].parent) / blocks
    row["seconds"] = time.perf_counter() - t0
    row["warnings"] = [str(w.message) for w in caught if "replicated" in str(w.message)]
    if show_warnings:
        for w in row["warnings"]:
            print(f"[{name}] {w}", file=sys.stderr)
    return row


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="?", default=",".join(MODELS),
                    help="comma-separated names (default: all); --list names them")
    ap.add_argument("--list", action="store_true", help="print the model names and exit")
    ap.add_argument("--warnings", action="store_true",
                    help="print the `tp` warning of each model (where the splits stop)")
    args = ap.parse_args(argv)
    if args.list:
        print("\n".join(MODELS))
        return
    os.environ.setdefault("NNCOMPILE_QUIET", "1")
    names = [ALIASES.get(n.strip(), n.strip()) for n in args.models.split(",") if n.strip()]
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        ap.error(f"unknown model(s) {unknown}; choose from {', '.join(MODELS)}")
    rows = []
    print("| model | split | all-reduces/block | parity |")
    print("|---|---|---|---|")
    for name in names:
        r = measure(name, args.warnings)
        rows.append(r)
        split = "-" if r["split"] is None else f"{r['split']:.2f}"
        ar = "-" if r["allreduce"] is None else f"{r['allreduce']:g}"
        print(f"| {name} | {split} | {ar} | {r['parity']} |", flush=True)
    total = sum(r["seconds"] for r in rows)
    print(f"\n{len(rows)} models, {total:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
