"""The rule of a mixture-of-experts layer's fused experts (nncompile_moe::experts_mlp, made by
passes/fuse_experts.py): split the experts.

    x: [S, H] R   w_in: [E, H, 2I] S(0)   w_out: [E, I, H2] S(0)   offs: [E] R  ->  [S, H2] P

Rank r of n holds experts [r E/n, (r+1) E/n) and computes the rows routed to them (every
rank has every token copy and the whole `offs`), zeros elsewhere: the sum over the plan is
the layer's output (comm.local_experts). Routing stays exact (no capacity, no dropped
tokens); each rank's expert weights, their gradients and optimizer state are 1/n.
"""
from __future__ import annotations

from nncompile.ir import Op, Partial, Shard

from .registry import make, register


@register("nncompile_moe::experts_mlp")
def experts_mlp(op: Op, n: int):
    x, w_in, w_out, offs = op.args[:4]
    experts = w_in.meta.shape[0]
    if experts % n or w_out.meta.shape[0] != experts:
        return []
    return [make(op, {w_in: Shard(0), w_out: Shard(0)}, [Partial()],
                 f"split experts ({experts // n} per rank)", local_target="comm.local_experts")]
