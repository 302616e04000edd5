"""Elementwise ops: split any output dim; broadcast inputs follow (size-1 dims replicate).
A strided split (StridedShard, e.g. heads inside a merged batch-and-heads dim) passes the same
way, except through ops that draw random numbers (their draw is sliced as a plain split).

Linear ops also pass partial sums through: add(P, P) -> P, mul(P, R) -> P, neg(P) -> P.
"""
from __future__ import annotations

from ..ir import P, Op, Replicate, Shard, StridedShard, Value
from .registry import divisible, draws_random, make, outers, register, tensor_inputs_of

UNARY = ["abs", "neg", "exp", "log", "sqrt", "rsqrt", "sin", "cos", "tanh", "sigmoid", "relu",
         "gelu", "silu", "erf", "pow", "reciprocal", "square", "clone", "contiguous", "alias",
         "detach", "lift_fresh_copy", "to", "_to_copy", "type_as", "dropout", "logical_not",
         "bitwise_not", "clamp", "clamp_min", "clamp_max", "softplus", "mish", "leaky_relu",
         "hardtanh", "elu", "native_dropout", "floor", "ceil", "round", "sign", "log1p", "expm1",
         "zeros_like", "ones_like", "full_like", "empty_like", "triu", "tril", "relu6",
         "hardswish", "hardsigmoid"]
BINARY = ["add", "sub", "mul", "div", "where", "masked_fill", "maximum", "minimum", "eq", "ne",
          "lt", "le", "gt", "ge", "logical_and", "logical_or", "bitwise_and", "bitwise_or",
          "rsub", "fmod", "remainder", "lerp", "addcmul", "addcdiv", "atan2", "copysign"]
# Ops through which a partial sum passes unchanged (the op is linear in that input).
LINEAR_UNARY = {"neg", "clone", "contiguous", "alias", "to", "_to_copy", "type_as"}
_NO_TRIANGLE_SPLIT = {"triu", "tril"}   # their result depends on the last two dims' offsets


def elementwise(op: Op, n: int, skip_dims: tuple[int, ...] = ()):
    """Split each output dim d; each input shards its aligned dim unless broadcast there."""
    out = op.outputs[0]
    rank = len(out.meta.shape)
    skip = {d % rank for d in skip_dims} if rank else set()
    strategies = []
    for d in range(rank):
        if d in skip or not divisible(out, d, n):
            continue
        for k in [1] + ([] if draws_random(op) else outers(out.meta.shape[d], n)):
            places = {}
            for v in tensor_inputs_of(op):
                a = d - (rank - len(v.meta.shape))
                if a >= 0 and v.meta.shape[a] == out.meta.shape[d]:
                    places[v] = StridedShard(a, k) if k > 1 else Shard(a)
                else:
                    places[v] = Replicate()
            split = StridedShard(d, k) if k > 1 else Shard(d)
            strategies.append(make(op, places, [split] * len(op.outputs),
                                   f"split dim {d}" + (" strided" if k > 1 else "")))
    return strategies


def partial_passthrough(op: Op):
    """Strategies that keep partial sums: only where the op is linear in its partial inputs."""
    name = op.target._opname
    tensors = tensor_inputs_of(op)
    if not tensors or len(op.outputs) != 1 or not op.outputs[0].meta.dtype.is_floating_point:
        return []
    if name in LINEAR_UNARY and len(tensors) == 1:
        return [make(op, {tensors[0]: P}, [P], "keep partial")]
    literals = [a for a in op.args if not isinstance(a, Value)]
    if name in ("add", "sub") and not literals and len(tensors) == 2:
        return [make(op, {t: P for t in tensors}, [P], "keep partial")]
    if name == "mul" and len(tensors) == 2 and tensors[0] is not tensors[1]:
        return [make(op, {tensors[0]: P, tensors[1]: Replicate()}, [P], "keep partial"),
                make(op, {tensors[0]: Replicate(), tensors[1]: P}, [P], "keep partial")]
    if name in ("mul", "div") and len(tensors) == 1 and op.args[0] is tensors[0]:
        return [make(op, {tensors[0]: P}, [P], "keep partial")]
    if name == "div" and len(tensors) == 2 and op.args[0] is tensors[0] \
            and tensors[0] is not tensors[1]:
        return [make(op, {tensors[0]: P, tensors[1]: Replicate()}, [P], "keep partial")]
    return []


@register(*UNARY, *BINARY)
def pointwise(op: Op, n: int):
    if op.target._opname in _NO_TRIANGLE_SPLIT:
        return elementwise(op, n, skip_dims=(-1, -2))
    if op.target._opname == "dropout" and len(op.args) > 1 and op.args[1] not in (0, 0.0):
        return elementwise(op, n)          # random masks differ per shard; no partial
    return elementwise(op, n) + partial_passthrough(op)


@register("softmax", "log_softmax", "_softmax", "_log_softmax")
def softmax(op: Op, n: int):
    return elementwise(op, n, skip_dims=(op.args[1],))


@register("topk")
def topk(op: Op, n: int):
    """Each row's k largest along `dim`: split along any other dim (values and indices)."""
    x = op.args[0]
    rank = len(x.meta.shape)
    along = (op.args[2] if len(op.args) > 2 else op.kwargs.get("dim", -1)) % rank
    return [make(op, {x: Shard(d)}, [Shard(d), Shard(d)], f"split dim {d}")
            for d in range(rank) if d != along and divisible(x, d, n)]


@register("layer_norm", "rms_norm")
def norm(op: Op, n: int):
    x, normalized_shape = op.args[0], op.args[1]
    lead = len(x.meta.shape) - len(normalized_shape)
    out = op.outputs[0]
    strategies = []
    for d in range(lead):
        if divisible(out, d, n):
            strategies.append(make(op, {x: Shard(d)}, [Shard(d)], f"split dim {d}"))
            strategies += [make(op, {x: StridedShard(d, k)}, [StridedShard(d, k)],
                                f"split dim {d} strided") for k in outers(out.meta.shape[d], n)]
    return strategies
