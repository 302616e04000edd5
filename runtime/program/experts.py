"""The pieces of a mixture-of-experts layer's experts (nncompile/rules/experts.py), as the
generated code calls them: `comm.local_moe(...)`, `comm.dispatch_moe(...)`.

local_moe: every rank has every token; it computes the picks of its own experts (rank r of
n holds experts r E/n .. (r+1) E/n - 1) and leaves zeros for the rest, a partial sum over the
group.

dispatch_moe (expert parallelism): every rank has its own tokens and its own experts.

    1. sort this rank's picks by expert; count them per expert        [E]
    2. all-to-all the counts: how many rows each rank sends me, per expert of mine
    3. all-to-all the rows (variable split sizes), compute them with my experts
    4. all-to-all the results back, weight them, add each token's picks

Steps 3 and 4 are differentiable (the backward runs the same exchanges reversed), so each
rank's expert gradients sum every rank's tokens. A rank whose experts get no pick sends and
receives empty pieces and still takes part; nothing is dropped.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from nncompile.experts import expert_rows, routed_sum


def _rank(group) -> int:
    return dist.get_rank(group) if group is not None else 0


def _size(group) -> int:
    return dist.get_world_size(group) if group is not None else 1


def local_moe(x, top_k_index, top_k_weights, w_in, w_out, act, transposed, *, group):
    """moe_experts with this rank's experts only: the picks of experts r E/n .. (r+1) E/n - 1
    weighted and summed, zeros for the rest (a partial sum over `group`)."""
    return routed_sum(x, top_k_index, top_k_weights, w_in, w_out, act, transposed,
                      first=_rank(group) * w_in.shape[0])


def dispatch_moe(x, top_k_index, top_k_weights, w_in, w_out, act, transposed, *, group):
    """moe_experts of this rank's tokens, each pick computed by the rank holding its expert
    (the module docstring's steps): the same rows as unsplit, exactly routed."""
    n = _size(group)
    if n == 1:
        return routed_sum(x, top_k_index, top_k_weights, w_in, w_out, act, transposed)
    mine = w_in.shape[0]
    k = top_k_index.shape[-1]
    flat = top_k_index.reshape(-1)
    picks = ((flat >= 0) & (flat < n * mine)).nonzero().squeeze(1)
    experts = flat[picks]
    order = torch.argsort(experts, stable=True)
    picks, experts = picks[order], experts[order]
    send = torch.bincount(experts, minlength=n * mine)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)        # [source rank, my expert]
    send_split = send.view(n, mine).sum(1).tolist()
    recv_split = recv.view(n, mine).sum(1).tolist()
    rows = picks // k
    got = funcol.all_to_all_single_autograd(x[rows].contiguous(), recv_split, send_split,
                                            group)
    local = torch.arange(mine, device=x.device).repeat(n).repeat_interleave(recv)
    y = expert_rows(funcol.wait_tensor(got), local, w_in, w_out, act, transposed)
    back = funcol.wait_tensor(funcol.all_to_all_single_autograd(
        y.contiguous(), send_split, recv_split, group))
    back = back * top_k_weights.reshape(-1)[picks].unsqueeze(-1).to(back.dtype)
    return x.new_zeros(x.shape[0], back.shape[-1]).index_add(0, rows, back.to(x.dtype))
