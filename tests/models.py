"""Models the tests compile: an MLP, a nanoGPT-style GPT, Hugging Face GPT-2 / Llama / T5 / BART
wrappers from small configs (no weight download) and an MLP of custom ops (custom_model.py)."""
from __future__ import annotations

import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from gpt import GPT  # noqa: E402


class MLP(nn.Module):
    def __init__(self, d_in=16, d_hidden=64, n_classes=8):
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_hidden)
        self.head = nn.Linear(d_hidden, n_classes)

    def forward(self, x, y):
        h = F.relu(self.fc1(x))
        h = torch.tanh(self.fc2(h))
        return F.cross_entropy(self.head(h), y)


class HFCausalLM(nn.Module):
    """A Hugging Face causal LM returning its loss."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, labels):
        return self.model(input_ids=input_ids, labels=labels, use_cache=False).loss


def hf_gpt2(vocab=64, n_embd=32, n_layer=2, n_head=4, n_positions=32, pdrop=0.0):
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(vocab_size=vocab, n_positions=n_positions, n_embd=n_embd, n_layer=n_layer,
                     n_head=n_head, resid_pdrop=pdrop, embd_pdrop=pdrop, attn_pdrop=pdrop,
                     bos_token_id=0, eos_token_id=0)
    return HFCausalLM(GPT2LMHeadModel(cfg))


def hf_llama(vocab=64, hidden=32, inter=64, n_layer=2, n_head=4, n_kv=2, max_pos=32):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                      num_hidden_layers=n_layer, num_attention_heads=n_head,
                      num_key_value_heads=n_kv, max_position_embeddings=max_pos,
                      bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return HFCausalLM(LlamaForCausalLM(cfg))


class HFSeq2Seq(nn.Module):
    """A Hugging Face encoder-decoder returning its loss; the decoder's inputs are the labels
    shifted right inside the model (an in-place write into a new tensor)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x, y):
        return self.model(input_ids=x, labels=y, use_cache=False).loss


def hf_t5(vocab=64, d_model=32, n_layer=2, n_head=4):
    from transformers import T5Config, T5ForConditionalGeneration
    cfg = T5Config(vocab_size=vocab, d_model=d_model, d_kv=d_model // n_head, d_ff=2 * d_model,
                   num_layers=n_layer, num_decoder_layers=n_layer, num_heads=n_head,
                   dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    return HFSeq2Seq(T5ForConditionalGeneration(cfg))


def hf_bart(vocab=64, d_model=32, n_layer=2, n_head=4, layerdrop=0.0):
    from transformers import BartConfig, BartForConditionalGeneration
    cfg = BartConfig(vocab_size=vocab, d_model=d_model, encoder_layers=n_layer,
                     decoder_layers=n_layer, encoder_attention_heads=n_head,
                     decoder_attention_heads=n_head, encoder_ffn_dim=2 * d_model,
                     decoder_ffn_dim=2 * d_model, max_position_embeddings=32, dropout=0.0,
                     attention_dropout=0.0, activation_dropout=0.0, pad_token_id=1,
                     bos_token_id=0, eos_token_id=2, decoder_start_token_id=2,
                     encoder_layerdrop=layerdrop, decoder_layerdrop=layerdrop)
    return HFSeq2Seq(BartForConditionalGeneration(cfg))


def build(name: str, seed: int = 0) -> nn.Module:
    import custom_model
    torch.manual_seed(seed)
    model = {"mlp": MLP, "gpt": GPT, "hf_gpt2": hf_gpt2, "hf_llama": hf_llama,
             "hf_t5": hf_t5, "hf_bart": hf_bart, "custom": custom_model.CustomMLP}[name]()
    return model.train()


def batch(name: str, seed: int, batch_size: int = 4, seq: int = 16) -> dict[str, torch.Tensor]:
    """A batch for one plan unit; `seed` picks which."""
    g = torch.Generator().manual_seed(1000 + seed)
    if name == "mlp":
        return {"x": torch.randn(batch_size, 16, generator=g),
                "y": torch.randint(0, 8, (batch_size,), generator=g)}
    if name == "custom":
        import custom_model
        return custom_model.batch(g, batch_size)
    if name in ("hf_t5", "hf_bart"):
        return {"x": torch.randint(3, 64, (batch_size, seq), generator=g),
                "y": torch.randint(3, 64, (batch_size, seq), generator=g)}
    ids = torch.randint(0, 64, (batch_size, seq), generator=g)
    tgt = torch.randint(0, 64, (batch_size, seq), generator=g)
    tgt[0, :3] = -1 if name == "gpt" else -100          # some ignored targets
    if name == "gpt":
        return {"idx": ids, "targets": tgt}
    return {"input_ids": ids, "labels": tgt}
