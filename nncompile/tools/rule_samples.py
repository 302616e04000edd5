"""Hand-written samples for the op-rule checker (nncompile/tools/rule_check.py): for every rule, at
least one call whose dims divide by 2 and 4, so each rule offers split strategies to check.
OpInfo's samples (PyTorch's op database) come on top of these where the op has an entry.

A sample is `(fn, args)`: the checker traces `fn(*args)` and checks every op of the rule's
name in the trace. Tensors are float64 unless the op needs another dtype.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

Sample = tuple[Callable, tuple]


def _r(*shape, g: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=g, dtype=torch.float64)


def _pos(*shape, g: torch.Generator) -> torch.Tensor:
    return torch.rand(*shape, generator=g, dtype=torch.float64) + 0.5


_UNARY_FN = {"relu": torch.relu, "gelu": F.gelu, "silu": F.silu, "softplus": F.softplus,
             "mish": F.mish, "leaky_relu": F.leaky_relu, "hardtanh": F.hardtanh, "elu": F.elu,
             "clone": torch.clone,
             "contiguous": lambda x: x.transpose(0, 1).contiguous(),
             "alias": torch.ops.aten.alias.default, "detach": torch.detach,
             "lift_fresh_copy": torch.ops.aten.lift_fresh_copy.default,
             "to": lambda x: x.to(torch.float32),
             "_to_copy": lambda x: torch.ops.aten._to_copy.default(x, dtype=torch.float32),
             "type_as": lambda x: x.type_as(torch.ones(1, dtype=torch.float32)),
             "dropout": lambda x: F.dropout(x, 0.0, True),
             "native_dropout": lambda x: torch.ops.aten.native_dropout.default(x, 0.0, False)[0],
             "pow": lambda x: torch.pow(x, 2), "clamp": lambda x: torch.clamp(x, -0.5, 0.5),
             "clamp_min": lambda x: torch.clamp_min(x, 0.1),
             "clamp_max": lambda x: torch.clamp_max(x, 0.1),
             "full_like": lambda x: torch.full_like(x, 3.0),
             "logical_not": lambda x: torch.logical_not(x > 0),
             "bitwise_not": lambda x: torch.bitwise_not(x > 0),
             "triu": lambda x: torch.triu(x), "tril": lambda x: torch.tril(x, -1),
             "relu6": F.relu6, "hardswish": F.hardswish, "hardsigmoid": F.hardsigmoid}
_POSITIVE = {"log", "sqrt", "rsqrt", "reciprocal", "log1p"}
_BINARY_FN = {"rsub": lambda a, b: torch.rsub(a, b),
              "where": lambda a, b: torch.where(a > 0, a, b),
              "masked_fill": lambda a, b: a.masked_fill(b > 0, 2.0),
              "lerp": lambda a, b: torch.lerp(a, b, 0.3),
              "addcmul": lambda a, b: torch.addcmul(a, a, b, value=0.5),
              "addcdiv": lambda a, b: torch.addcdiv(a, a, b.abs() + 1, value=0.5),
              "logical_and": lambda a, b: torch.logical_and(a > 0, b > 0),
              "logical_or": lambda a, b: torch.logical_or(a > 0, b > 0),
              "bitwise_and": lambda a, b: torch.bitwise_and(a > 0, b > 0),
              "bitwise_or": lambda a, b: torch.bitwise_or(a > 0, b > 0),
              "fmod": lambda a, b: torch.fmod(a, b.abs() + 1),
              "remainder": lambda a, b: torch.remainder(a, b.abs() + 1)}


def unary(name: str, g: torch.Generator) -> list[Sample]:
    fn = _UNARY_FN.get(name) or getattr(torch, name)
    x = _pos(4, 8, 4, g=g) if name in _POSITIVE else _r(4, 8, 4, g=g)
    return [(fn, (x,))]


def binary(name: str, g: torch.Generator) -> list[Sample]:
    fn = _BINARY_FN.get(name) or getattr(torch, name)
    out = [(fn, (_r(4, 8, 4, g=g), _r(4, 8, 4, g=g))),       # same shapes
           (fn, (_r(4, 8, 4, g=g), _r(8, 1, g=g)))]          # broadcast, size-1 dim
    if name in ("add", "sub", "mul", "div"):
        out.append((lambda a: fn(a, 2.0), (_r(4, 8, g=g),)))  # a scalar operand
    return out


def _sdpa(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _sdpa_causal(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _sdpa_gqa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


def _sdpa_gqa_causal(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def _ce(logits, target, reduction):
    return F.cross_entropy(logits, target, reduction=reduction, ignore_index=1)


_conv = torch.ops.aten.convolution.default
_bn_train = torch.ops.aten._native_batch_norm_legit_functional.default
_bn_eval = torch.ops.aten._native_batch_norm_legit_no_training.default


def conv_ops(name: str, g: torch.Generator) -> list[Sample]:
    """Convolutions (ordinary, grouped, depthwise, transposed, unbatched) and batch norm."""
    r = lambda *s: _r(*s, g=g)                                                  # noqa: E731
    pos = lambda *s: _pos(*s, g=g)                                              # noqa: E731
    table: dict[str, list[Sample]] = {
        "convolution": [
            (lambda x, w, b: _conv(x, w, b, [1, 1], [1, 1], [1, 1], False, [0, 0], 1),
             (r(4, 8, 6, 6), r(8, 8, 3, 3), r(8))),
            (lambda x, w, b: _conv(x, w, b, [2, 2], [1, 1], [1, 1], False, [0, 0], 4),
             (r(4, 8, 6, 6), r(8, 2, 3, 3), r(8))),                 # grouped
            (lambda x, w: _conv(x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 8),
             (r(4, 8, 6, 6), r(16, 1, 3, 3))),                      # depthwise, multiplier 2
            (lambda x, w, b: _conv(x, w, b, [2, 2], [1, 1], [1, 1], True, [1, 1], 1),
             (r(4, 8, 5, 5), r(8, 4, 3, 3), r(4))),                 # transposed
            (lambda x, w: _conv(x, w, None, [1, 1], [0, 0], [1, 1], True, [0, 0], 4),
             (r(4, 8, 5, 5), r(8, 2, 3, 3)))],                      # transposed, grouped
        "conv1d": [(lambda x, w, b: F.conv1d(x, w, b, padding=1), (r(4, 8, 10), r(8, 8, 3),
                                                                     r(8))),
                   (lambda x, w: F.conv1d(x, w, groups=8), (r(4, 8, 10), r(8, 1, 3)))],
        "conv2d": [(lambda x, w, b: F.conv2d(x, w, b, stride=2, padding=1),
                    (r(4, 8, 6, 6), r(8, 8, 3, 3), r(8))),
                   (lambda x, w, b: F.conv2d(x, w, b, padding="same", groups=4),
                    (r(4, 8, 6, 6), r(8, 2, 3, 3), r(8))),
                   (lambda x, w: F.conv2d(x, w, padding=1), (r(8, 6, 6), r(8, 8, 3, 3)))],
        "conv3d": [(lambda x, w, b: F.conv3d(x, w, b, padding=1),
                    (r(4, 8, 4, 4, 4), r(8, 8, 3, 3, 3), r(8)))],
        "conv_transpose1d": [(lambda x, w, b: F.conv_transpose1d(x, w, b, stride=2),
                              (r(4, 8, 6), r(8, 4, 3), r(4)))],
        "conv_transpose2d": [(lambda x, w, b: F.conv_transpose2d(x, w, b, padding=1),
                              (r(4, 8, 5, 5), r(8, 4, 3, 3), r(4))),
                             (lambda x, w: F.conv_transpose2d(x, w, groups=4),
                              (r(4, 8, 5, 5), r(8, 2, 3, 3)))],
        "conv_transpose3d": [(lambda x, w: F.conv_transpose3d(x, w),
                              (r(4, 8, 3, 3, 3), r(8, 4, 2, 2, 2)))],
        "pad": [(lambda x: F.pad(x, (1, 1, 0, 2)), (r(4, 8, 6, 6),)),
                (lambda x: F.pad(x, (1, 2), mode="reflect"), (r(4, 8, 6),))],
        "constant_pad_nd": [(lambda x: torch.constant_pad_nd(x, (1, 1, 2, 0), 0.5),
                             (r(4, 8, 6, 6),))],
        "_native_batch_norm_legit_functional": [
            (lambda x, w, b, m, v: _bn_train(x, w, b, m, v, True, 0.1, 1e-5),
             (r(4, 8, 5, 5), r(8), r(8), r(8), pos(8))),
            (lambda x, w, b, m, v: _bn_train(x, w, b, m, v, True, 0.3, 1e-5),
             (r(8, 8), r(8), r(8), r(8), pos(8)))],
        "_native_batch_norm_legit_no_training": [
            (lambda x, w, b, m, v: _bn_eval(x, w, b, m, v, 0.1, 1e-5),
             (r(4, 8, 5, 5), r(8), r(8), r(8), pos(8)))],
        "batch_norm": [
            (lambda x, w, b, m, v: F.batch_norm(x, m, v, w, b, training=False),
             (r(4, 8, 5, 5), r(8), r(8), r(8), pos(8))),
            (lambda x, w, b: F.batch_norm(x, None, None, w, b, training=True),
             (r(4, 8, 6), r(8), r(8)))],
    }
    return table.get(name, [])


def model_ops(name: str, g: torch.Generator) -> list[Sample]:
    """Samples of contraction, model-level, reduction and layout ops."""
    r = lambda *s: _r(*s, g=g)                                                  # noqa: E731
    idx = torch.randint(0, 8, (4, 8), generator=g)
    tgt = torch.randint(0, 8, (8,), generator=g)
    table: dict[str, list[Sample]] = {
        "linear": [(F.linear, (r(4, 8, 8), r(4, 8), r(4))), (F.linear, (r(8, 4), r(8, 4)))],
        "addmm": [(torch.addmm, (r(8), r(4, 8), r(8, 8)))],
        "mm": [(torch.mm, (r(4, 8), r(8, 4)))],
        "bmm": [(torch.bmm, (r(4, 8, 4), r(4, 4, 8)))],
        "matmul": [(torch.matmul, (r(4, 4, 8), r(4, 8, 4))),
                   (lambda x, w: x @ w.T, (r(4, 4, 8), r(8, 8)))],        # FalconLinear
        "einsum": [(lambda x, w: torch.einsum("...k,nk->...n", x, w), (r(4, 4, 8), r(4, 8))),
                   (lambda a, b: torch.einsum("bij,bjk->bik", a, b), (r(4, 4, 8), r(4, 8, 4)))],
        "embedding": [(lambda i, w: F.embedding(i, w), (idx, r(8, 8)))],
        "scaled_dot_product_attention": [(_sdpa, (r(4, 4, 8, 8), r(4, 4, 8, 8), r(4, 4, 8, 8),
                                                  r(4, 1, 8, 8))),
                                         (_sdpa_causal, (r(4, 4, 8, 8), r(4, 4, 8, 8),
                                                         r(4, 4, 8, 8))),
                                         # grouped k/v (passes/fuse_attention.py): 8 q heads,
                                         # 4 k/v heads, split by 2 and 4
                                         (_sdpa_gqa, (r(4, 8, 8, 8), r(4, 4, 8, 8),
                                                      r(4, 4, 8, 8))),
                                         (_sdpa_gqa_causal, (r(4, 8, 8, 8), r(4, 4, 8, 8),
                                                             r(4, 4, 8, 8))),
                                         # multi-query: one k/v head, broadcast or grouped
                                         (_sdpa_causal, (r(4, 8, 8, 8), r(4, 1, 8, 8),
                                                         r(4, 1, 8, 8))),
                                         (_sdpa_gqa, (r(4, 8, 8, 8), r(4, 1, 8, 8),
                                                      r(4, 1, 8, 8)))],
        "sum": [(lambda x: x.sum(1), (r(4, 8, 4),)), (lambda x: x.sum(), (r(4, 8),)),
                (lambda x: x.sum(-1, keepdim=True), (r(4, 8),))],
        "mean": [(lambda x: x.mean(0), (r(4, 8, 4),)), (lambda x: x.mean(), (r(4, 8),))],
        "amax": [(lambda x: x.amax(1), (r(4, 8, 4),))],
        "amin": [(lambda x: x.amin(-1, keepdim=True), (r(4, 8, 4),))],
        "var": [(lambda x: x.var(1), (r(4, 8, 4),))],
        "std": [(lambda x: x.std(-1), (r(4, 8, 4),))],
        "cross_entropy_loss": [(lambda x, t: _ce(x, t, "mean"), (r(8, 8), tgt)),
                               (lambda x, t: _ce(x, t, "sum"), (r(8, 8), tgt)),
                               (lambda x, t: _ce(x, t, "none"), (r(8, 8), tgt))],
        "softmax": [(lambda x: torch.softmax(x, -1), (r(4, 8, 4),))],
        "topk": [(lambda x: torch.topk(x, 2, -1)[1], (r(4, 8, 4),)),    # a router's picks
                 (lambda x: torch.topk(x, 3, 1)[0], (r(4, 8, 4),))],
        "log_softmax": [(lambda x: torch.log_softmax(x, 1), (r(4, 8, 4),))],
        "_softmax": [(lambda x: torch.ops.aten._softmax.default(x, -1, False), (r(4, 8, 4),))],
        "_log_softmax": [(lambda x: torch.ops.aten._log_softmax.default(x, 0, False),
                          (r(4, 8, 4),))],
        "layer_norm": [(lambda x, w, b: F.layer_norm(x, (8,), w, b), (r(4, 4, 8), r(8), r(8)))],
        "rms_norm": [(lambda x, w: F.rms_norm(x, (8,), w), (r(4, 4, 8), r(8)))],
        "view": [(lambda x: x.view(4, 8, 2, 4), (r(4, 8, 8),)),
                 (lambda x: x.view(32, 8), (r(4, 8, 8),))],
        "reshape": [(lambda x: x.reshape(4, 4, 2, 8), (r(4, 8, 8),))],
        "_unsafe_view": [(lambda x: torch.ops.aten._unsafe_view.default(x, [4, 8, 2, 4]),
                          (r(4, 8, 8),))],
        "flatten": [(lambda x: torch.ops.aten.flatten.using_ints(x, 1, 2), (r(4, 8, 4, 2),))],
        "transpose": [(lambda x: x.transpose(0, 2), (r(4, 8, 4),))],
        "swapaxes": [(lambda x: torch.ops.aten.swapaxes.default(x, 1, 2), (r(4, 8, 4),))],
        "t": [(lambda x: x.t(), (r(4, 8),))],
        "numpy_T": [(lambda x: x.T, (r(4, 8),))],
        "permute": [(lambda x: x.permute(2, 0, 1), (r(4, 8, 4),))],
        "unsqueeze": [(lambda x: x.unsqueeze(1), (r(4, 8),))],
        "squeeze": [(lambda x: x.squeeze(1), (r(4, 1, 8),))],
        "expand": [(lambda x: x.expand(4, 8, 8), (r(8, 1),))],
        "repeat_interleave.self_int": [(lambda x: x.repeat_interleave(2, dim=1),
                                        (r(4, 4, 8),))],
        "split": [(lambda x: x.split(4, dim=1), (r(4, 8, 4),))],
        "split_with_sizes": [(lambda x: x.split([2, 6], dim=1), (r(4, 8, 4),))],
        "unsafe_split": [(lambda x: torch.ops.aten.unsafe_split.Tensor(x, 4, 1),
                          (r(4, 8, 4),))],
        "chunk": [(lambda x: x.chunk(2, dim=-1), (r(4, 8, 4),))],
        "slice": [(lambda x: x[:, 2:6], (r(4, 8, 4),))],
        "narrow": [(lambda x: x.narrow(2, 1, 2), (r(4, 8, 4),))],
        "select": [(lambda x: x[:, 3], (r(4, 8, 4),))],
        "cat": [(lambda a, b: torch.cat([a, b], 1), (r(4, 8, 4), r(4, 4, 4)))],
        "new_empty": [(lambda x: x.new_empty(4, 8, 2), (r(4, 8, 4),))],
        "slice_scatter": [(lambda x, y: torch.slice_scatter(x, y, dim=2, start=1, end=3),
                           (r(4, 8, 4), r(4, 8, 2)))],
    }
    return table.get(name, [])


def _c(*shape, g: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=g, dtype=torch.complex128)


def _bool_mask(*shape, g: torch.Generator) -> torch.Tensor:
    mask = torch.rand(*shape, generator=g) > 0.4
    mask[..., 0] = True                             # every query sees at least one key
    return mask


def _rotary(x, freqs):
    """Meta's / torchtitan's Llama rotary: pairs as complex numbers times freqs_cis."""
    xc = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * freqs).flatten(3)


def head_ops(name: str, g: torch.Generator) -> list[Sample]:
    """Samples of the ops a split by heads goes through: complex rotary, `view` with -1, a
    relative position bias table indexed by positions, attention masks with a heads dim."""
    r = lambda *s: _r(*s, g=g)                                                  # noqa: E731
    c = lambda *s: _c(*s, g=g)                                                  # noqa: E731
    pos = torch.randint(0, 16, (8, 8), generator=g)
    table: dict[str, list[Sample]] = {
        "view_as_complex": [(torch.view_as_complex, (r(4, 8, 4, 2),)),
                            (_rotary, (r(4, 8, 4, 8), c(1, 8, 1, 4)))],
        "view_as_real": [(torch.view_as_real, (c(4, 8, 4),)),
                         (_rotary, (r(4, 8, 4, 8), c(1, 8, 1, 4)))],
        "mul": [(torch.mul, (c(4, 8, 4, 4), c(1, 8, 1, 4))),          # complex, broadcast
                (torch.mul, (c(4, 8, 4), c(4, 8, 4)))],
        "view": [(lambda x: x.view(4, 8, 4, -1), (r(4, 8, 8),)),      # heads, -1 head dim
                 (lambda x: x.view(-1, 8, 2), (r(4, 4, 8, 2),))],     # batch x heads merged
        "index": [(lambda t, i: t[i], (r(16, 4), pos)),                # bias table[positions]
                  (lambda x, i: x[:, i], (r(4, 16, 4), pos[0]))],
        "scaled_dot_product_attention": [
            (_sdpa, (r(4, 4, 8, 8), r(4, 4, 8, 8), r(4, 4, 8, 8), r(1, 4, 8, 8))),  # per head
            (_sdpa, (r(4, 4, 8, 8), r(4, 4, 8, 8), r(4, 4, 8, 8),
                     _bool_mask(4, 4, 8, 8, g=g))),                                  # boolean
            (_sdpa, (r(2, 4, 4, 8, 8), r(2, 4, 4, 8, 8), r(2, 4, 4, 8, 8),
                     r(4, 4, 8, 8)))],                       # windows x heads (Swin), 5-D
    }
    return table.get(name, [])


def strided_ops(name: str, g: torch.Generator) -> list[Sample]:
    """Samples of the ops a strided split goes through (heads inside a merged batch-and-heads
    dim, DeBERTa's attention): the merge and its undoing, `repeat` of a split dim, `gather`
    with an index expanded over the merged dim, bmm over it."""
    r = lambda *s: _r(*s, g=g)                                                  # noqa: E731
    idx = torch.randint(0, 16, (1, 8, 8), generator=g)
    table: dict[str, list[Sample]] = {
        "view": [(lambda x: x.view(-1, 4, 8, 8), (r(16, 8, 8),)),      # (B*H) -> (B, H)
                 (lambda x: x.view(16, 8), (r(2, 8, 8),))],
        "repeat": [(lambda x: x.repeat(2, 1, 1), (r(4, 8, 4),)),       # per-batch copies
                   (lambda x: x.repeat(3, 2, 1), (r(4, 8, 4),)),
                   (lambda x: x.repeat(2, 1, 1), (r(8, 4),))],         # a new leading dim
        "gather": [(lambda x, i: torch.gather(x, -1, i.expand(8, 8, 8)), (r(8, 8, 16), idx)),
                   (lambda x, i: torch.gather(x, 0, i), (r(8, 4),
                                                        torch.randint(0, 8, (4, 4), generator=g)))],
        "expand": [(lambda i: i.expand(8, 8, 8), (idx,))],
        "bmm": [(torch.bmm, (r(8, 4, 4), r(8, 4, 4)))],
    }
    return table.get(name, [])


def samples(name: str, g: torch.Generator) -> list[Sample]:
    """Hand-written samples of the rule registered under `name` (an op name, maybe with an
    overload: 'split.Tensor')."""
    from ..rules.pointwise import BINARY, UNARY
    base = name.split(".")[0]
    if base in UNARY:
        out = unary(base, g)
    elif base in BINARY:
        out = binary(base, g)
    else:
        out = model_ops(base, g)
    return out + head_ops(base, g) + conv_ops(base, g) + strided_ops(base, g)
