"""Models the tests compile: an MLP, a nanoGPT-style GPT and Hugging Face GPT-2 / Llama
wrappers built from small configs (no weight download)."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


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


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head, bias=True):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.n_head = n_head

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class Block(nn.Module):
    def __init__(self, n_embd, n_head, bias=True):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, bias)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp_fc = nn.Linear(n_embd, 4 * n_embd, bias=bias)
        self.mlp_proj = nn.Linear(4 * n_embd, n_embd, bias=bias)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp_proj(F.gelu(self.mlp_fc(self.ln_2(x))))
        return x


class GPT(nn.Module):
    """nanoGPT's shape: token + position embeddings, pre-norm blocks, tied lm_head."""

    def __init__(self, vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32, bias=True):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList([Block(n_embd, n_head, bias) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight

    def forward(self, idx, targets):
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1),
                               ignore_index=-1)


class HFCausalLM(nn.Module):
    """A Hugging Face causal LM returning its loss."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, labels):
        return self.model(input_ids=input_ids, labels=labels, use_cache=False).loss


def hf_gpt2(vocab=64, n_embd=32, n_layer=2, n_head=4, n_positions=32):
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(vocab_size=vocab, n_positions=n_positions, n_embd=n_embd, n_layer=n_layer,
                     n_head=n_head, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     bos_token_id=0, eos_token_id=0)
    return HFCausalLM(GPT2LMHeadModel(cfg))


def hf_llama(vocab=64, hidden=32, inter=64, n_layer=2, n_head=4, n_kv=2, max_pos=32):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                      num_hidden_layers=n_layer, num_attention_heads=n_head,
                      num_key_value_heads=n_kv, max_position_embeddings=max_pos,
                      bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return HFCausalLM(LlamaForCausalLM(cfg))


def build(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = {"mlp": MLP, "gpt": GPT, "hf_gpt2": hf_gpt2, "hf_llama": hf_llama}[name]()
    return model.train()


def batch(name: str, seed: int, batch_size: int = 4, seq: int = 16) -> dict[str, torch.Tensor]:
    """A batch for one plan unit; `seed` picks which."""
    g = torch.Generator().manual_seed(1000 + seed)
    if name == "mlp":
        return {"x": torch.randn(batch_size, 16, generator=g),
                "y": torch.randint(0, 8, (batch_size,), generator=g)}
    ids = torch.randint(0, 64, (batch_size, seq), generator=g)
    tgt = torch.randint(0, 64, (batch_size, seq), generator=g)
    tgt[0, :3] = -1 if name == "gpt" else -100          # some ignored targets
    if name == "gpt":
        return {"idx": ids, "targets": tgt}
    return {"input_ids": ids, "labels": tgt}
