"""Random ops inside a plan unit, exact whatever the plan: dropout on a shard masks exactly
what dropout on the whole tensor masks on one device.

Every rank of a plan unit holds the same generator state (seed every rank alike, as
docs/concepts.md says), so each rank draws the random tensor of the *full* value, as the
unsplit op would, and keeps its own slice:

    before (tp, h: f32[8, 64] S(1)):  h2 = aten.dropout.default(h, 0.5, True)   # a mask per rank
    after:                            h2 = rng.dropout(h, 0.5, True, dim=1, group=PLAN_GROUP)

Every rank consumes the same random numbers, so the generators stay equal and later random
ops agree too. The price is one transient full-size mask per rank. The full mask is drawn by
aten.dropout itself on a tensor of ones of the full shape, so it is the mask the unsplit op
draws on that device (CPU: bernoulli_(1 - p) / (1 - p); CUDA: the fused native_dropout).

`scaled_dot_product_attention` with dropout_p > 0, split over batch or heads, computes
softmax(q k^T * scale + mask) * dropout-noise @ v with the full attention-probability noise
sliced the same way (the math kernel's draw; fused CUDA kernels draw theirs differently, see
docs/concepts.md).

Simulated ranks (threads of one process: nncompile.verify) share one default generator;
`rank_generator(state)` gives each thread its own generator with that state, used here.
"""
from __future__ import annotations

import contextlib
import math
import threading

import torch

from .comm import _rank, _size

_thread = threading.local()


@contextlib.contextmanager
def rank_generator(state: torch.Tensor):
    """Draw this thread's random numbers from a private CPU generator starting at `state`."""
    g = torch.Generator()
    g.set_state(state)
    _thread.generator = g
    try:
        yield g
    finally:
        _thread.generator = None


def recompute_draws():
    """`checkpoint(..., context_fn=rng.recompute_draws)`: the recompute of a checkpointed
    region draws the numbers its forward drew. checkpoint's own preserve_rng_state rewinds
    the default generators; a simulated rank draws from its thread's generator instead, so
    this rewinds that one too (and puts back where it stood after the recompute):

        forward:    state s0 -> region draws -> s1 -> ... -> sN
        recompute:  sN saved, generator set to s0 -> region draws -> sN put back
    """
    g = getattr(_thread, "generator", None)
    if g is None:
        return contextlib.nullcontext(), contextlib.nullcontext()
    start = g.get_state()

    @contextlib.contextmanager
    def rewound():
        now = g.get_state()
        g.set_state(start)
        try:
            yield
        finally:
            g.set_state(now)
    return contextlib.nullcontext(), rewound()


def _noise(shape: list[int], p: float, like: torch.Tensor) -> torch.Tensor:
    """What aten.dropout multiplies a tensor of `shape` by: 0 or 1 / (1 - p) per element."""
    g = getattr(_thread, "generator", None)
    if g is not None and like.device.type == "cpu":    # aten.dropout's CPU draw, on g
        return torch.empty(shape, dtype=like.dtype).bernoulli_(1 - p, generator=g).div_(1 - p)
    return torch.ops.aten.dropout.default(like.new_ones(shape), p, True)


def _full_shape(x: torch.Tensor, dim: int | None, group) -> list[int]:
    shape = list(x.shape)
    if dim is not None:
        shape[dim] *= _size(group)
    return shape


def _mine(full: torch.Tensor, dim: int | None, size: int, group) -> torch.Tensor:
    """This rank's slice of a full tensor split evenly along `dim` (all of it when None)."""
    return full if dim is None else full.narrow(dim, _rank(group) * size, size)


def dropout(input, p=0.5, train=True, *, dim, group):
    """aten.dropout of the full tensor, sliced: `input` is this rank's piece along `dim`."""
    if not train or p == 0 or input.numel() == 0:
        return input
    if p == 1:
        return input * torch.zeros((), dtype=input.dtype, device=input.device)
    noise = _noise(_full_shape(input, dim, group), p, input)
    return input * _mine(noise, dim, None if dim is None else input.shape[dim], group)


def native_dropout(input, p, train, *, dim, group):
    """aten.native_dropout (output, mask) of the full tensor, sliced."""
    if train is False or input.numel() == 0:
        return input.clone(), torch.ones_like(input, dtype=torch.bool)
    scale = 0.0 if p == 1 else 1.0 / (1 - p)
    noise = _noise(_full_shape(input, dim, group), p, input) if p < 1 else \
        torch.zeros(_full_shape(input, dim, group), dtype=input.dtype, device=input.device)
    mask = _mine(noise, dim, None if dim is None else input.shape[dim], group) != 0
    return input * mask * scale, mask


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                 is_causal=False, scale=None, enable_gqa=False, *, dim, group):
    """Attention whose probability dropout draws the full (batch, heads, L, S) noise, sliced
    along `dim` (0: batch, 1: heads) like q, k and v."""
    if dropout_p == 0:
        return torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask, 0.0, is_causal, scale=scale, enable_gqa=enable_gqa)
    L, S = query.shape[-2], key.shape[-2]
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        rep = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(rep, -3), value.repeat_interleave(rep, -3)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    scores = query @ key.transpose(-2, -1) * scale
    if is_causal:
        causal = torch.ones(L, S, dtype=torch.bool, device=query.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool \
            else scores + attn_mask
    probs = torch.softmax(scores, dim=-1)
    size = None if dim is None else probs.shape[dim]
    noise = _noise(_full_shape(probs, dim, group), dropout_p, probs)
    return (probs * _mine(noise, dim, size, group)) @ value


def generator_of(device: torch.device) -> torch.Generator:
    """The generator the generated code draws from on `device`: this thread's (simulated
    ranks) on CPU, else the device's default generator."""
    device = torch.device(device)
    g = getattr(_thread, "generator", None)
    if device.type == "cpu":
        return g if g is not None else torch.default_generator
    mod = torch.get_device_module(device.type)
    return mod.default_generators[device.index if device.index is not None
                                  else mod.current_device()]


def replay(draws: list[tuple], device: torch.device) -> None:
    """Draw and discard what a forward making `draws` (nncompile/codegen/pipeline.py stage_draws) draws,
    with the same calls, so the generator ends where that forward leaves it.

    CPU (mt19937) has no skip-ahead, so the numbers are drawn; CUDA (Philox) could advance its
    offset directly, but the offset a kernel consumes depends on its launch configuration, so
    the same kernels run here too. Cost: generating the noise (one tensor of each draw's shape,
    freed at once); an unsplit attention with dropout on an accelerator runs the attention
    kernel on zeros, since its fused kernel draws inside."""
    for kind, shape, dtype, p, *extra in draws:
        dt = getattr(torch, dtype)
        if kind == "dropout":
            torch.ops.aten.dropout.default(torch.empty(shape, dtype=dt, device=device), p, True)
        elif kind == "native_dropout":
            torch.ops.aten.native_dropout.default(torch.empty(shape, dtype=dt, device=device),
                                                  p, True)
        elif kind == "noise" or (kind == "sdpa" and torch.device(device).type == "cpu"):
            # CPU attention with dropout runs the math kernel: aten.dropout of the probabilities
            _noise(shape, p, torch.empty(0, dtype=dt, device=device))
        elif kind == "sdpa":
            q, k, v, mask, causal, scale, gqa = extra
            zeros = [torch.zeros(s, dtype=dt, device=device) for s in (q, k, v)]
            m = None if mask is None else torch.zeros(mask[0], dtype=getattr(torch, mask[1]),
                                                      device=device)
            torch.ops.aten.scaled_dot_product_attention.default(
                *zeros, m, p, causal, scale=scale, enable_gqa=gqa)
        else:
            raise ValueError(f"unknown random draw {kind!r}")
