"""The conformance suite's models (tests/conformance.py): a nanoGPT-shaped GPT with nanoGPT's
dropouts (embeddings, attention probabilities through scaled_dot_product_attention's dropout_p
read from self.training, residuals) and a classifier with BatchNorm1d."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, BLOCK = 64, 16


class Attention(nn.Module):
    """q, k and v from three projections, or (fused) from nanoGPT's one `c_attn` whose output
    is split in three: tp then holds parts of the fused weight (passes/unfuse_projections.py)."""

    def __init__(self, d, heads, p, fused=False):
        super().__init__()
        if fused:
            self.c_attn = nn.Linear(d, 3 * d, bias=False)
        else:
            self.q_proj, self.k_proj, self.v_proj = (nn.Linear(d, d, bias=False)
                                                     for _ in range(3))
        self.c_proj = nn.Linear(d, d, bias=False)
        self.heads, self.p, self.fused = heads, p, fused
        self.resid_dropout = nn.Dropout(p)

    def forward(self, x):
        B, T, C = x.size()
        qkv = self.c_attn(x).split(C, dim=2) if self.fused else \
            (self.q_proj(x), self.k_proj(x), self.v_proj(x))
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in qkv)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.p if self.training else 0.0)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C)))


class Block(nn.Module):
    def __init__(self, d, heads, p, fused=False):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = Attention(d, heads, p, fused)
        self.mlp_fc, self.mlp_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.dropout = nn.Dropout(p)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.dropout(self.mlp_proj(F.gelu(self.mlp_fc(self.ln_2(x)))))


class TinyGPT(nn.Module):
    """nanoGPT's shape at d 32, 2 layers, with its dropouts; no bias on the attention
    projections (nanoGPT's bias=False: a key bias's exact gradient is zero, so AdamW turns
    rounding noise into lr-sized steps on one device and under a plan alike). fused: one
    `c_attn` for q, k and v, as nanoGPT's own file has it."""

    def __init__(self, dropout=0.0, d=32, layers=2, heads=4, fused=False):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, d), nn.Embedding(BLOCK, d)
        self.drop = nn.Dropout(dropout)
        self.h = nn.ModuleList([Block(d, heads, dropout, fused) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, VOCAB, bias=False)
        self.wte.weight = self.lm_head.weight
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx, targets):
        t = idx.size(1)
        x = self.drop(self.wte(idx) + self.wpe(torch.arange(t, device=idx.device)))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


class BNNet(nn.Module):
    """A classifier with BatchNorm1d in training mode (running statistics updated). The linears
    before a BatchNorm have no bias, as CNNs' convolutions before one do: batch statistics
    cancel it, so its exact gradient is zero and AdamW would step on rounding noise."""

    def __init__(self, d_in=16, hidden=64, classes=8):
        super().__init__()
        self.fc1, self.bn1 = nn.Linear(d_in, hidden, bias=False), nn.BatchNorm1d(hidden)
        self.fc2, self.bn2 = nn.Linear(hidden, hidden, bias=False), nn.BatchNorm1d(hidden)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x, y):
        h = F.relu(self.bn1(self.fc1(x)))
        h = F.relu(self.bn2(self.fc2(h)))
        return F.cross_entropy(self.head(h), y)


class TinyMoE(nn.Module):
    """Hugging Face's Mixtral at d 32, 2 layers of 4 experts (top-2), called like TinyGPT:
    next-token cross-entropy plus the router's load-balancing loss (coefficient 0.02);
    `dropout`: its attention dropout."""

    def __init__(self, dropout=0.0, layers=2):
        super().__init__()
        import transformers
        self.lm = transformers.MixtralForCausalLM(transformers.MixtralConfig(
            attention_dropout=dropout,
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
            num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
            num_experts_per_tok=2, max_position_embeddings=BLOCK, bos_token_id=0,
            eos_token_id=0, pad_token_id=0))

    def forward(self, idx, targets):
        out = self.lm(input_ids=idx, output_router_logits=True)
        logits = out.logits
        ce = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return ce + 0.02 * out.aux_loss
