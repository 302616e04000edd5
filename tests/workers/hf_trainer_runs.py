"""Train the tiny Llama with transformers' Trainer or NnCompileTrainer, one configuration after
another in this process (a torchrun launch, or one process), and write for each configuration
OUT/<name>.json (log_history, best checkpoint) and OUT/<name>/final (save_model's files).

    torchrun --nproc_per_node=2 tests/workers/hf_trainer_runs.py OUT ddp dp zero3 tp ...
    python tests/workers/hf_trainer_runs.py OUT single

Configurations (names in RUNS): a plain Trainer ("ddp" under torchrun, "single" in one
process) or NnCompileTrainer with a ComputeConfig and policy. Every run uses the same tiny
model, data and TrainingArguments (cosine schedule with warmup, weight decay 0.1, clipping at
0.5, 2 accumulation steps with num_items_in_batch, evaluation and checkpoints every 3 of 6
steps, the best checkpoint (highest eval loss, so the step-3 one) loaded at the end).

Two other kinds of run, under torchrun:
    gpt2_ddp, gpt2_dp   a tiny GPT-2 on rows of different lengths that
                        DataCollatorForLanguageModeling(mlm=False) pads to each batch's longest:
                        plain Trainer + DDP, and NnCompileTrainer with dynamic_dims on the
                        batch and sequence dims (OUT/<name>.json: log history, eval loss)
    t5_tp, t5_dp        a tiny T5 trained 2 steps, then model.generate(...): refused under tp
                        (its parameters are DTensor views), run as is under dp; the tokens of
                        the single-device copy the refusal names and of save_model's files
"""
from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.utils.data import Dataset
from transformers import (LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback,
                          TrainingArguments)

import nncompile
from nncompile.integration.hf import NnCompileTrainer

SEQ, VOCAB = 32, 128


class Tokens(Dataset):
    """Generated token ids, each row from a random first token by next = (5 * prev + 3) % VOCAB
    (a pattern the model learns within a few steps); each label row ends in a run of -100 of
    its own length, so the token count (num_items_in_batch) differs between batches."""

    def __init__(self, n: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        ids = [torch.randint(0, VOCAB, (n,), generator=g)]
        for _ in range(SEQ - 1):
            ids.append((5 * ids[-1] + 3) % VOCAB)
        self.ids = torch.stack(ids, dim=1)
        self.pad = torch.randint(0, SEQ // 2, (n,), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        labels = self.ids[i].clone()
        labels[SEQ - int(self.pad[i]):] = -100
        return {"input_ids": self.ids[i], "labels": labels}


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128,
                                        num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=4, vocab_size=VOCAB,
                                        max_position_embeddings=SEQ))


def arguments(out: str, **over) -> TrainingArguments:
    kw = dict(output_dir=out, per_device_train_batch_size=2, per_device_eval_batch_size=2,
              gradient_accumulation_steps=2, max_steps=6, learning_rate=3e-3,
              weight_decay=0.1, lr_scheduler_type="cosine", warmup_steps=2, max_grad_norm=0.5,
              eval_strategy="steps", eval_steps=3, save_strategy="steps", save_steps=3,
              load_best_model_at_end=True, metric_for_best_model="eval_loss",
              greater_is_better=True, logging_steps=1, use_cpu=True,
              report_to=[], seed=0, data_seed=0, disable_tqdm=True)
    if "WORLD_SIZE" in os.environ:          # under torchrun: gloo between the CPU processes
        kw["ddp_backend"] = "gloo"
    kw.update(over)
    return TrainingArguments(**kw)


class StopAt(TrainerCallback):
    """Stop training after `step` optimizer steps (the checkpoint at that step is saved)."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.step:
            control.should_training_stop = True
        return control


NNC = {   # name: (ComputeConfig kwargs, pas_policy)
    "dp": (dict(plan_ngpus=1, runtime_ngpus=2), "dp"),
    "zero2": (dict(plan_ngpus=1, runtime_ngpus=2, use_zero=2), "dp"),
    "zero3": (dict(plan_ngpus=1, runtime_ngpus=2, use_zero=3), "dp"),
    "tp": (dict(plan_ngpus=2, runtime_ngpus=2), "tp"),
    "tp2x2": (dict(plan_ngpus=2, runtime_ngpus=4), "tp"),
}


def run(name: str, out_root: str) -> None:
    out = os.path.join(out_root, name)
    train, evals = Tokens(64, 1), Tokens(10, 2)
    base, _, part = name.partition("_")          # "dp_stop3", "dp_resume", "dp_gc", ...
    over = {}
    if part == "gc":
        over["gradient_checkpointing"] = True
    if part == "bf16":
        over["bf16"] = True
    if part == "compile":         # torch.compile through dynamo and AOTAutograd, no C++ build
        over.update(torch_compile=True, torch_compile_backend="aot_eager")
    args = arguments(out, **over)
    callbacks = [StopAt(3)] if part == "stop3" else None
    if base in ("ddp", "single"):
        trainer = Trainer(model=tiny_llama(), args=args, train_dataset=train,
                          eval_dataset=evals, callbacks=callbacks)
    else:
        config, policy = NNC[base]
        # an interrupted run and its resumption reuse the uninterrupted run's generated code
        gen = f"gen_{base}" if part in ("", "stop3", "resume") else f"gen_{name}"
        trainer = NnCompileTrainer(model=tiny_llama(), args=args, train_dataset=train,
                                   eval_dataset=evals, callbacks=callbacks,
                                   compute_config=nncompile.ComputeConfig(**config),
                                   pas_policy=policy, gen_savedir=os.path.join(out_root, gen))
    resume = None
    if part == "resume":
        resume = os.path.join(out_root, f"{base}_stop3", "checkpoint-3")
    trainer.train(resume_from_checkpoint=resume)
    trainer.save_model(os.path.join(out, "final"))
    metrics = trainer.evaluate()                 # the best (step-3) weights, loaded at the end
    predicted = trainer.predict(evals)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        pm = getattr(trainer, "parallel_module", None)
        torch.save(torch.as_tensor(predicted.predictions), os.path.join(out, "predictions.pt"))
        with open(os.path.join(out_root, f"{name}.json"), "w") as f:
            json.dump({"log_history": trainer.state.log_history,
                       "best": trainer.state.best_model_checkpoint,
                       "evaluate": metrics, "predict": predicted.metrics,
                       "compile_options": getattr(pm, "compile_options", None)}, f)


def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2,
                                      n_head=4, bos_token_id=0, eos_token_id=0, pad_token_id=0,
                                      use_cache=False))


class Rows(Dataset):
    """Token rows of 4 to 23 tokens (ids 1..63), as a tokenized text dataset gives them."""

    def __init__(self, n: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        lengths = torch.randint(4, 24, (n,), generator=g)
        self.rows = [torch.randint(1, 64, (int(k),), generator=g).tolist() for k in lengths]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i]}


def padded_run(name: str, out_root: str) -> None:
    """gpt2_ddp / gpt2_dp: batches padded to their longest row (the length differs from batch
    to batch, the last evaluation batch is smaller): dynamic_dims name both dims."""
    from tokenizers import Tokenizer, models as tokenizer_models
    from transformers import DataCollatorForLanguageModeling, PreTrainedTokenizerFast
    vocab = {f"t{i}": i for i in range(64)}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(tokenizer_models.WordLevel(vocab, unk_token="t1")),
        pad_token="t0", eos_token="t0")
    collator = DataCollatorForLanguageModeling(tokenizer, mlm=False)
    args = arguments(os.path.join(out_root, name), per_device_train_batch_size=4,
                     per_device_eval_batch_size=4, max_steps=4, eval_steps=2,
                     save_strategy="no", load_best_model_at_end=False)
    kw = dict(model=tiny_gpt2(), args=args, train_dataset=Rows(64, 1),
              eval_dataset=Rows(12, 2), data_collator=collator)
    if name == "gpt2_ddp":
        trainer = Trainer(**kw)
    else:
        dims = {k: {0: "batch", 1: "seq"} for k in ("input_ids", "attention_mask", "labels")}
        trainer = NnCompileTrainer(**kw, compute_config=nncompile.ComputeConfig(1, 2),
                                   pas_policy="dp", dynamic_dims=dims,
                                   gen_savedir=os.path.join(out_root, f"gen_{name}"))
    trainer.train()
    metrics = trainer.evaluate()
    if not dist.is_initialized() or dist.get_rank() == 0:
        with open(os.path.join(out_root, f"{name}.json"), "w") as f:
            json.dump({"log_history": trainer.state.log_history, "evaluate": metrics}, f)


def generate_run(name: str, out_root: str) -> None:
    """t5_tp / t5_dp: train 2 steps, then generate with the trainer's model, with the
    single-device copy of gathered weights, and with save_model's files."""
    from transformers import T5Config, T5ForConditionalGeneration
    torch.manual_seed(0)
    model = T5ForConditionalGeneration(T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
        num_heads=4, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
        eos_token_id=1, use_cache=False))
    g = torch.Generator().manual_seed(1)
    x = torch.randint(2, 64, (16, 8), generator=g)
    rows = [{"input_ids": a, "labels": (a * 3 + 1) % 62 + 2} for a in x]
    out = os.path.join(out_root, name)
    args = arguments(out, max_steps=2, eval_strategy="no", save_strategy="no",
                     load_best_model_at_end=False, learning_rate=1e-2)
    config = dict(plan_ngpus=2) if name == "t5_tp" else dict(plan_ngpus=1)
    trainer = NnCompileTrainer(model=model, args=args, train_dataset=rows,
                               compute_config=nncompile.ComputeConfig(**config),
                               pas_policy="tp" if name == "t5_tp" else "dp",
                               gen_savedir=os.path.join(out_root, f"gen_{name}"))
    trainer.train()
    ids, got = x[:2], {}
    try:
        got["model"] = trainer.model.generate(input_ids=ids, max_new_tokens=6).tolist()
    except nncompile.NNCompileError as e:
        got["error"] = f"{type(e).__name__}: {e}"
    full = trainer.parallel_module.gather_params()          # the refusal's recipe
    copy = T5ForConditionalGeneration(trainer.model.config)
    copy.load_state_dict(full, strict=False)
    got["copy"] = copy.generate(input_ids=ids, max_new_tokens=6).tolist()
    trainer.save_model(os.path.join(out, "final"))
    saved = T5ForConditionalGeneration.from_pretrained(os.path.join(out, "final"))
    got["saved"] = saved.generate(input_ids=ids, max_new_tokens=6).tolist()
    if dist.get_rank() == 0:
        with open(os.path.join(out_root, f"{name}.json"), "w") as f:
            json.dump(got, f)


def main() -> None:
    out_root, names = sys.argv[1], sys.argv[2:]
    for name in names:
        kind = name.split("_")[0]
        {"gpt2": padded_run, "t5": generate_run}.get(kind, run)(name, out_root)
        if dist.is_initialized():
            dist.barrier()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
