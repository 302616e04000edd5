"""Counts the collectives `tp` and `tp_sp` plans really issue (torch's CommDebugMode sees every
c10d call), forward and backward separately, on the GPT and HF Llama with 3 blocks, plan 2;
and a steady-state tp forward of HF Qwen2 with the default checks on.

    torchrun --nproc_per_node=2 tests/workers/megatron_comms.py --out report.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor.debug import CommDebugMode

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import models  # noqa: E402

import nncompile  # noqa: E402

BLOCKS = 3


def build(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "gpt":
        return models.GPT(vocab_size=64, block_size=32, n_layer=BLOCKS, n_head=4, n_embd=32)
    return models.hf_llama(n_layer=BLOCKS)


def counts(mode: CommDebugMode) -> dict[str, int]:
    return {str(k).split(".")[-1]: v for k, v in mode.get_comm_counts().items()}


def qwen2_steady_forward(savedir: str) -> dict:
    """A Qwen2 of 2 blocks under tp with the default checks: the collectives of a training
    forward once the input check is over (check_inputs calls), the lockstep exchange on."""
    import transformers
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=32,
                                   bos_token_id=0, eos_token_id=0, pad_token_id=0)
    model = models.HFCausalLM(transformers.Qwen2ForCausalLM(cfg))
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    config = nncompile.ComputeConfig(2, 2)
    pm = nncompile.parallelize(model, batch, config, pas_policy="tp", gen_savedir=savedir,
                               reuse="override", instance_name="qwen2_tp")
    for _ in range(config.check_inputs):
        pm(**batch).backward()
    with CommDebugMode() as fwd:
        pm(**batch)
    return {"model": "hf_qwen2", "policy": "tp, default checks", "blocks": 2,
            "forward": counts(fwd), "backend": dist.get_backend()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--savedir", default="./.nncompile/megatron")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.environ.setdefault("NNCOMPILE_QUIET", "1")
    dist.init_process_group("gloo")
    report = []
    for name in ("gpt", "hf_llama"):
        for policy in ("tp", "tp_sp"):
            model = build(name)
            batch = models.batch(name, 0)
            # the plan's own collectives: the first calls' input check and the forwards'
            # lockstep exchange (one all_gather each, runtime/protocol/lockstep.py) off
            config = nncompile.ComputeConfig(2, 2, check_inputs=0, check_lockstep=False)
            pm = nncompile.parallelize(model, batch, config,
                                       pas_policy=policy, gen_savedir=args.savedir,
                                       reuse="override", instance_name=f"{name}_{policy}")
            with CommDebugMode() as fwd:
                loss = pm(**batch)
            with CommDebugMode() as bwd:
                loss.backward()
            ref = build(name)(**batch)
            torch.testing.assert_close(loss.detach(), ref.detach(), rtol=1e-5, atol=1e-6)
            report.append({"model": name, "policy": policy, "blocks": BLOCKS,
                           "forward": counts(fwd), "backward": counts(bwd),
                           "backend": dist.get_backend()})
    report.append(qwen2_steady_forward(args.savedir))
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
