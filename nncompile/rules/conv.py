"""Convolutions and batch norm: the channel splits that let a plan split a CNN's weights.

    convolution(x [N, Cin, *sp], w [Cout, Cin/G, *k], b [Cout]) -> y [N, Cout, *sp]

groups G == 1:
    split batch     x S(0), w R,    b R     -> y S(0)
    split out       x R,    w S(0), b S(0)  -> y S(1)   (a column split)
    split in        x S(1), w S(1), b P     -> y P      (a row split: partial sums; the bias
                                                          is added on one rank only)
groups G > 1 (grouped; depthwise when G == Cin), G divisible by n:
    split groups    x S(1), w S(0), b S(0)  -> y S(1)   each rank runs G/n whole groups:
                                                         localize passes groups=G/n
Transposed convolutions swap the weight's two channel dims (w [Cin, Cout/G, *k]). Spatial
dims are never split: a kernel reads across them (halos). An unbatched input ([Cin, *sp])
has its channels on dim 0 and no batch split.

Padding (`F.pad`, TensorFlow-style "same" padding before a convolution) follows a split of
any dim it does not pad.

Batch norm normalizes each channel with that channel's statistics, so a channel split is
exact in training too: each rank normalizes its channels, and the running statistics (the
buffers) are split with them, each rank writing back its own channels' new values. A batch
(or spatial) split is exact only where the running statistics normalize (eval mode): in
training each rank would normalize with its own rows' statistics.
"""
from __future__ import annotations

from ..ir import P, Op, Replicate, Shard, Value
from .registry import LOCAL_ARGS, divisible, make, register

# op name -> (index of `groups`, index of `transposed` or the fixed flag)
_CONV = {"convolution": (8, 6), "conv1d": (6, False), "conv2d": (6, False),
         "conv3d": (6, False), "conv_transpose1d": (6, True), "conv_transpose2d": (6, True),
         "conv_transpose3d": (6, True)}


def _conv_args(op: Op) -> tuple[int, bool]:
    gi, ti = _CONV[op.target._opname]
    groups = op.args[gi] if len(op.args) > gi else op.kwargs.get("groups", 1)
    if isinstance(ti, bool):
        return int(groups), ti
    return int(groups), bool(op.args[ti] if len(op.args) > ti else op.kwargs.get("transposed"))


@register(*_CONV)
def convolution(op: Op, n: int):
    x, w = op.args[:2]
    b = op.args[2] if len(op.args) > 2 and isinstance(op.args[2], Value) else None
    out = op.outputs[0]
    groups, transposed = _conv_args(op)
    batched = len(x.meta.shape) == len(w.meta.shape)
    c = 1 if batched else 0                      # the channel dim of x and y
    w_out, w_in = (1, 0) if transposed else (0, 1)
    strategies = []
    if batched and divisible(x, 0, n) and divisible(out, 0, n):
        strategies.append(make(op, {x: Shard(0)}, [Shard(0)], "split batch"))
    if groups == 1:
        if divisible(w, w_out, n) and divisible(out, c, n):
            places = {x: Replicate(), w: Shard(w_out)}
            if b is not None:
                places[b] = Shard(0)
            strategies.append(make(op, places, [Shard(c)], "split out channels"))
        if divisible(w, w_in, n) and divisible(x, c, n):
            places = {x: Shard(c), w: Shard(w_in)}
            if b is not None:
                places[b] = P
            strategies.append(make(op, places, [P], "split in channels"))
    elif groups % n == 0 and divisible(x, c, n) and divisible(out, c, n) \
            and divisible(w, 0, n):
        places = {x: Shard(c), w: Shard(0)}
        if b is not None:
            places[b] = Shard(0)
        strategies.append(make(op, places, [Shard(c)], "split groups"))
    return strategies


def _local_groups(op: Op, n: int) -> None:
    """A grouped convolution split by groups runs groups // n of them on each rank."""
    groups, _ = _conv_args(op)
    s = op.strategy
    if groups == 1 or s is None or s.inputs[1] != Shard(0):
        return                                   # inputs[1]: the weight, split by groups
    gi = _CONV[op.target._opname][0]
    if len(op.args) > gi:
        op.args = op.args[:gi] + (groups // n,) + op.args[gi + 1:]
    else:
        op.kwargs = {**op.kwargs, "groups": groups // n}


for _name in _CONV:
    LOCAL_ARGS[_name] = _local_groups


# batch norm ops: x, weight, bias, running_mean, running_var, then `training` at this index
# (None: never training)
_BN = {"batch_norm": 5, "_native_batch_norm_legit_functional": 5,
       "_native_batch_norm_legit_no_training": None}


@register(*_BN)
def batch_norm(op: Op, n: int):
    """Split channels (dim 1; weight, bias and running statistics follow); in eval mode also
    any other dim of x (each element normalized by its channel's running statistics)."""
    x = op.args[0]
    params = [v for v in op.args[1:5] if isinstance(v, Value)]
    ti = _BN[op.target._opname]
    training = ti is not None and (op.args[ti] if len(op.args) > ti
                                   else op.kwargs.get("training", True)) is not False
    running = all(isinstance(v, Value) for v in op.args[3:5])
    rank = len(x.meta.shape)
    # the per-channel outputs (saved mean and inverse std, new running statistics) follow the
    # channels; the eval form's empty saved statistics ([0]) hold nothing: "split" alike
    stats = [Shard(0)] * (len(op.outputs) - 1)
    strategies = []
    if rank >= 2 and divisible(x, 1, n):
        places = {x: Shard(1), **{v: Shard(0) for v in params}}
        strategies.append(make(op, places, [Shard(1)] + stats, "split channels"))
    if not training and running and all(v.meta.shape == (0,) for v in op.outputs[1:]):
        for d in range(rank):
            if d != 1 and divisible(x, d, n):
                strategies.append(make(op, {x: Shard(d)}, [Shard(d)] + stats, f"split dim {d}"))
    return strategies


@register("pad", "constant_pad_nd")
def pad(op: Op, n: int):
    """Split any dim the padding leaves alone (pad lists (left, right) pairs from the last
    dim backwards)."""
    x, pads = op.args[0], op.args[1]
    out = op.outputs[0]
    rank = len(x.meta.shape)
    padded = {rank - 1 - i // 2 for i, p in enumerate(pads) if p != 0}
    return [make(op, {x: Shard(d)}, [Shard(d)], f"split dim {d}") for d in range(rank)
            if d not in padded and divisible(x, d, n) and divisible(out, d, n)]
