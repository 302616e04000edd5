"""The rules of a mixture-of-experts layer's fused experts (passes/fuse_experts.py).

nncompile_moe::moe_experts(x [T, H], top_k_index [T, k], top_k_weights [T, k], w_in [E, ...],
w_out [E, ...]) is token-wise, so its tokens and its experts can each be split:

    split experts, tokens whole   x, index, weights R   w S(0)  ->  P     comm.local_moe
    dispatch tokens (ep)          x, index, weights S(0) w S(0)  ->  S(0)  comm.dispatch_moe
    split tokens, experts whole   x, index, weights S(0) w R     ->  S(0)  (each rank's rows)

Under `split experts` rank r of n holds experts [r E/n, (r+1) E/n), routes every token itself
and computes the picks of its own experts, zeros elsewhere: the sum over the plan is the
output. Under `dispatch` each rank holds its own tokens and experts: it sends every pick to
the rank holding its expert and gets the results back (all-to-all with the counts exchanged
first: expert parallelism). Routing is exact either way: no capacity, no dropped token.

nncompile_moe::experts_mlp(x, w_in, w_out, offs) (sorted token copies): split experts only.

    x: [S, H] R   w_in: [E, H, 2I] S(0)   w_out: [E, I, H2] S(0)   offs: [E] R  ->  [S, H2] P
"""
from __future__ import annotations

from nncompile.ir import Op, Partial, Shard

from .registry import divisible, make, register

DISPATCH, LOCAL = "comm.dispatch_moe", "comm.local_moe"


def dispatch_bytes(op: Op, n: int, split: int | None = None) -> float:
    """Bytes one rank sends in one all-to-all of `dispatch` over n ranks when the picks
    spread evenly over the experts (each of its T/split tokens' k picks, hidden wide,
    (n - 1)/n of them away; split: n unless the tokens split further); forward sends them and
    gets them back, backward the same."""
    x, index = op.args[:2]
    tokens, k = index.meta.shape[0], index.meta.shape[-1]
    if type(tokens) is not int:
        return 0.0
    return tokens / (split or n) * k * x.meta.shape[-1] * x.meta.dtype.itemsize * (n - 1) / n


@register("nncompile_moe::moe_experts")
def moe_experts(op: Op, n: int):
    x, index, weights, w_in, w_out = op.args[:5]
    experts = w_in.meta.shape[0]
    out = []
    if experts % n == 0:
        out.append(make(op, {w_in: Shard(0), w_out: Shard(0)}, [Partial()],
                        f"split experts ({experts // n} per rank)", local_target=LOCAL))
    if all(divisible(v, 0, n) for v in (x, index, weights)):
        tokens = {x: Shard(0), index: Shard(0), weights: Shard(0)}
        if experts % n == 0:
            kib = dispatch_bytes(op, n) / 1024
            out.append(make(op, {**tokens, w_in: Shard(0), w_out: Shard(0)}, [Shard(0)],
                            f"dispatch tokens to split experts ({experts // n} per rank; "
                            f"all-to-all ~{kib:.1f} KiB per rank each way)",
                            local_target=DISPATCH))
        out.append(make(op, tokens, [Shard(0)], "split tokens"))
    return out


@register("nncompile_moe::experts_mlp")
def experts_mlp(op: Op, n: int):
    x, w_in, w_out, offs = op.args[:4]
    experts = w_in.meta.shape[0]
    if experts % n or w_out.meta.shape[0] != experts:
        return []
    return [make(op, {w_in: Shard(0), w_out: Shard(0)}, [Partial()],
                 f"split experts ({experts // n} per rank)", local_target="comm.local_experts")]
