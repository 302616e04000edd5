"""Train a tiny Llama with Hugging Face's Trainer, parallelized by nncompile (NnCompileTrainer).

    torchrun --nproc_per_node=2 examples/hf_trainer/train.py --policy tp
    torchrun --nproc_per_node=2 examples/hf_trainer/train.py --policy dp --use_zero 3
    torchrun --nproc_per_node=2 examples/hf_trainer/train.py --policy dp --use_nncompile false
    python examples/hf_trainer/train.py --policy dp               # one process

The data is generated (no download): rows of token ids that follow next = (5 * prev + 3) % vocab
from a random first token, so the loss falls within a few steps. The model is a
`LlamaForCausalLM` built from a small `LlamaConfig`. After training, the model is saved with
`trainer.save_model` (save_pretrained files: `LlamaForCausalLM.from_pretrained` loads them) and
the last lines printed are the final evaluation loss and where the model went.

--policy dp trains data parallel (ComputeConfig(1, world)); --policy tp splits the model over
--plan_ngpus ranks (default: all of them), data parallel across the rest. --use_nncompile false
runs the plain transformers Trainer (DDP under torchrun) for comparison.
"""
from __future__ import annotations

import argparse
import json
import os

import torch
from torch.utils.data import Dataset
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

import nncompile
from nncompile.integration.hf import NnCompileTrainer


class PatternTokens(Dataset):
    """`n` generated rows of `seq` token ids with labels (the ids themselves: the model shifts)."""

    def __init__(self, n: int, seq: int, vocab: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        ids = [torch.randint(0, vocab, (n,), generator=g)]
        for _ in range(seq - 1):
            ids.append((5 * ids[-1] + 3) % vocab)
        self.ids = torch.stack(ids, dim=1)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i].clone()}


def tiny_llama(vocab: int, seq: int) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128,
                                        num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=4, vocab_size=vocab,
                                        max_position_embeddings=seq))


def _bool(text: str) -> bool:
    if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return text.lower() in ("true", "1", "yes")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--policy", choices=["dp", "tp", "autodist"], default="dp")
    p.add_argument("--plan_ngpus", type=int, default=None,
                   help="ranks per plan unit (default: 1 for dp, every rank otherwise)")
    p.add_argument("--use_zero", type=int, choices=[0, 1, 2, 3], default=0)
    p.add_argument("--use_nncompile", type=_bool, default=True,
                   help="false: the plain transformers Trainer, for comparison")
    p.add_argument("--output_dir", default="gen/hf_trainer_example")
    p.add_argument("--max_steps", type=int, default=20)
    p.add_argument("--per_device_train_batch_size", type=int, default=4)
    p.add_argument("--gradient_accumulation_steps", type=int, default=2)
    p.add_argument("--learning_rate", type=float, default=3e-3)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--bf16", type=_bool, default=False)
    p.add_argument("--gradient_checkpointing", type=_bool, default=False)
    p.add_argument("--resume_from_checkpoint", default=None)
    p.add_argument("--losses_json", default=None, help="write the log history here (rank 0)")
    return p.parse_args(argv)


def main(argv=None) -> None:
    a = parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    args = TrainingArguments(
        output_dir=a.output_dir, max_steps=a.max_steps,
        per_device_train_batch_size=a.per_device_train_batch_size,
        per_device_eval_batch_size=a.per_device_train_batch_size,
        gradient_accumulation_steps=a.gradient_accumulation_steps,
        learning_rate=a.learning_rate, weight_decay=0.1, lr_scheduler_type="cosine",
        warmup_steps=max(1, a.max_steps // 10), max_grad_norm=1.0,
        eval_strategy="steps", eval_steps=max(1, a.max_steps // 2),
        save_strategy="steps", save_steps=max(1, a.max_steps // 2),
        logging_steps=max(1, a.max_steps // 10), bf16=a.bf16,
        gradient_checkpointing=a.gradient_checkpointing, use_cpu=not torch.cuda.is_available(),
        ddp_backend=("gloo" if not torch.cuda.is_available() else "nccl") if world > 1 else None,
        report_to=[], seed=0, data_seed=0, disable_tqdm=True)
    model = tiny_llama(a.vocab, a.seq)
    data = dict(train_dataset=PatternTokens(512, a.seq, a.vocab, seed=1),
                eval_dataset=PatternTokens(32, a.seq, a.vocab, seed=2))
    if a.use_nncompile:
        plan = a.plan_ngpus or (1 if a.policy == "dp" else world)
        trainer = NnCompileTrainer(
            model=model, args=args, **data,
            compute_config=nncompile.ComputeConfig(plan_ngpus=plan, runtime_ngpus=world,
                                                   use_zero=a.use_zero),
            pas_policy=a.policy, gen_savedir=os.path.join(a.output_dir, ".nncompile"),
            reuse="moo")
    else:
        trainer = Trainer(model=model, args=args, **data)
    trainer.train(resume_from_checkpoint=a.resume_from_checkpoint)
    final = os.path.join(a.output_dir, "final")
    trainer.save_model(final)                     # every rank: the weights are gathered
    metrics = trainer.evaluate()
    if trainer.is_world_process_zero():
        if a.losses_json:
            with open(a.losses_json, "w") as f:
                json.dump(trainer.state.log_history, f)
        print(f"eval_loss {metrics['eval_loss']:.4f}")
        print(f"saved {final}")


if __name__ == "__main__":
    main()
