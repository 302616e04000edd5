"""Autograd-aware collectives on the plan unit's process group.

Each forward collective is paired with its backward dual, so `loss.backward()` on every rank
produces correct local gradients. Which transition each one implements, its dual, its bytes
and its gloo fallback are listed once, in nncompile/collectives.py (`TABLE`); a table entry
whose `forward` names a function of another name resolves here as an alias.

Under torch.compile (ParallelModule.compile) the same functions run PyTorch's functional
collectives (torch.distributed._functional_collectives), which dynamo records as graph ops
and inductor schedules; reduce-scatter and all-to-all then run natively on every backend (gloo
included). Eagerly they run torch.distributed's in-place calls, with the gloo fallbacks of the
table. Both sum the same values, so the numbers agree.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from nncompile.collectives import lookup

from ..protocol.hang_report import wait_for
from ..store.zero import gather as zero_gather, prefetch as zero_prefetch
from .experts import dispatch_moe, local_moe  # noqa: F401  (mixture-of-experts layers)


def __getattr__(name: str):
    """comm.<kind> for a table entry whose runtime function has another name."""
    c = lookup(name)
    if c is not None and c.forward and c.forward != name:
        return globals()[c.forward]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _size(group) -> int:
    return dist.get_world_size(group)


def _rank(group) -> int:
    return dist.get_rank(group)


def _tracing() -> bool:
    """True while torch.compile traces: collectives must be functional graph ops."""
    return torch.compiler.is_compiling()


def _gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    if _tracing():
        # gathered along dim 0 and waited for, then re-laid along `dim` here: torch 2.11's
        # dynamo cannot trace funcol's own re-layout for gather_dim != 0 (a graph break under
        # fullgraph), and its compiled backward returns an unwaited gather as a gradient
        out = funcol.wait_tensor(funcol.all_gather_tensor(x.contiguous(), gather_dim=0,
                                                          group=group))
        return out if dim == 0 else torch.cat(out.chunk(_size(group), dim=0), dim=dim)
    parts = [torch.empty_like(x) for _ in range(_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _chunk(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    piece = x.chunk(_size(group), dim=dim)[_rank(group)]
    if _tracing():
        # a new tensor, not a view of the input: torch 2.11's compiled autograd.Function
        # drops the gradient of an output that is a view of its input (zeros come back)
        return piece.clone(memory_format=torch.contiguous_format)
    return piece.contiguous()


def _reduce(x: torch.Tensor, group) -> torch.Tensor:
    if _tracing():
        return funcol.all_reduce(x.contiguous(), "sum", group=group)
    out = x.contiguous().clone()
    dist.all_reduce(out, group=group)
    return out


def _reduce_scatter(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    if _tracing():
        return funcol.reduce_scatter_tensor(x.contiguous(), "sum", scatter_dim=dim, group=group)
    if dist.get_backend(group) == "gloo":
        return _chunk(_reduce(x, group), dim, group)
    parts = [p.contiguous() for p in x.chunk(_size(group), dim=dim)]
    out = torch.empty_like(parts[0])
    dist.reduce_scatter(out, parts, group=group)
    return out


def _all_to_all(x: torch.Tensor, src_dim: int, dst_dim: int, group) -> torch.Tensor:
    """Shard(src_dim) -> Shard(dst_dim): split along dst_dim, exchange, concatenate src_dim."""
    if _tracing():
        # the dst chunks stacked on a new dim 0: piece i goes to rank i, piece j comes from j
        sends = torch.stack(x.chunk(_size(group), dim=dst_dim))
        recvs = funcol.all_to_all_single(sends, None, None, group=group)
        return torch.cat(recvs.unbind(0), dim=src_dim)
    if dist.get_backend(group) == "gloo":
        # gloo has no all_to_all: gather everything, keep this rank's dst chunk
        return _chunk(_gather(x, src_dim, group), dst_dim, group)
    sends = [p.contiguous() for p in x.chunk(_size(group), dim=dst_dim)]
    recvs = [torch.empty_like(p) for p in sends]
    dist.all_to_all(recvs, sends, group=group)
    return torch.cat(recvs, dim=src_dim)


# The zigzag order of a sequence split over C ranks (context parallelism's load balance for
# causal attention): the sequence in 2C chunks, rank r holding chunks r and 2C-1-r, so every
# rank has as many early (cheap) as late (costly) query rows.
def _zig_chunk(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    n, r = _size(group), _rank(group)
    parts = x.chunk(2 * n, dim=dim)
    return torch.cat([parts[r], parts[2 * n - 1 - r]], dim=dim)


def _zig_gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    n = _size(group)
    pieces = _gather(x, dim, group).chunk(2 * n, dim=dim)     # rank r: chunks r, 2n-1-r
    order = [None] * (2 * n)
    for r in range(n):
        order[r], order[2 * n - 1 - r] = pieces[2 * r], pieces[2 * r + 1]
    return torch.cat(order, dim=dim)


def _zig_reduce_scatter(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    return _zig_chunk(_reduce(x, group), dim, group)


_ZIGZAG = {False: (_chunk, _gather, _reduce_scatter),
           True: (_zig_chunk, _zig_gather, _zig_reduce_scatter)}


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _reduce(x, group)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _Chunk(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group, zigzag=False):
        ctx.dim, ctx.group, ctx.zigzag = dim, group, zigzag
        return _ZIGZAG[zigzag][0](x, dim, group)

    @staticmethod
    @once_differentiable            # its backward's collective is not differentiable
    def backward(ctx, g):
        return _ZIGZAG[ctx.zigzag][1](g, ctx.dim, ctx.group), None, None, None


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group, reduce_grad, zigzag=False):
        ctx.dim, ctx.group, ctx.reduce_grad, ctx.zigzag = dim, group, reduce_grad, zigzag
        return _ZIGZAG[zigzag][1](x, dim, group)

    @staticmethod
    @once_differentiable            # its backward's collective is not differentiable
    def backward(ctx, g):
        chunk, _, reduce_scatter = _ZIGZAG[ctx.zigzag]
        if ctx.reduce_grad:
            return reduce_scatter(g, ctx.dim, ctx.group), None, None, None, None
        return chunk(g, ctx.dim, ctx.group), None, None, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group, zigzag=False):
        ctx.dim, ctx.group, ctx.zigzag = dim, group, zigzag
        return _ZIGZAG[zigzag][2](x, dim, group)

    @staticmethod
    @once_differentiable            # its backward's collective is not differentiable
    def backward(ctx, g):
        return _ZIGZAG[ctx.zigzag][1](g, ctx.dim, ctx.group), None, None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, src_dim, dst_dim, group):
        ctx.src_dim, ctx.dst_dim, ctx.group = src_dim, dst_dim, group
        return _all_to_all(x, src_dim, dst_dim, group)

    @staticmethod
    @once_differentiable            # its backward's collective is not differentiable
    def backward(ctx, g):
        return _all_to_all(g, ctx.dst_dim, ctx.src_dim, ctx.group), None, None, None


class _ToPartial(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        if _rank(group) == 0:
            return x.clone()
        if _tracing():
            # zeros computed from x: torch.compile drops collectives whose results no kept
            # op reads (torch 2.15 does across custom autograd functions), and zeros_like
            # reads no values, so this rank would skip the collectives making x while its
            # peers wait in them
            return (x * 0).nan_to_num(0.0, 0.0, 0.0)
        return torch.zeros_like(x)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _SyncGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    @once_differentiable            # its backward's collective is not differentiable
    def backward(ctx, g):
        return _reduce(g, ctx.group), None


class _GradSyncLinears(torch.autograd.Function):
    """sync_grad(x), or all_gather(x, reduce_grad=True), feeding column-split linears, with
    Megatron's backward overlap: the input gradient is computed first and all-reduced (or
    reduce-scattered) asynchronously while the weights' gradients are computed, then waited
    on. Backward does what the unfused linears' backward does, in the dtype their forward
    computed in (autocast's, when it is on), and saves what they save (the full input and the
    weights, through save_for_backward: saved-tensor hooks such as ZeRO-3's see them).
    gather_dim None: sync_grad; else the all_gather's dim."""

    @staticmethod
    def forward(ctx, x, group, gather_dim, *weights_and_biases):
        ctx.group, ctx.gather_dim = group, gather_dim
        ctx.set_materialize_grads(False)        # an unused output's gradient stays None
        ctx.bias_dtypes = [None if b is None else b.dtype for b in weights_and_biases[1::2]]
        weights = weights_and_biases[0::2]
        full = x if gather_dim is None else _gather(x, gather_dim, group)
        ctx.save_for_backward(full, *weights)
        return tuple(F.linear(full, w, b) for w, b in zip(weights, weights_and_biases[1::2]))

    @staticmethod
    @once_differentiable            # a second derivative through it is an error, never wrong
    def backward(ctx, *grads):
        full, *weights = ctx.saved_tensors
        needs, group = ctx.needs_input_grad, ctx.group
        gx, work, chunk_after = None, None, False
        if needs[0]:
            for g, w in zip(grads, weights):
                if g is not None:
                    part = g.matmul(w.to(g.dtype)).to(full.dtype)
                    gx = part if gx is None else gx.add_(part)
            if gx is None:
                gx = torch.zeros_like(full)
            gx = gx.contiguous()
            if ctx.gather_dim is not None and dist.get_backend(group) != "gloo":
                parts = [p.contiguous() for p in gx.chunk(_size(group), dim=ctx.gather_dim)]
                summed = torch.empty_like(parts[0])
                work = dist.reduce_scatter(summed, parts, group=group, async_op=True)
                gx = summed
            else:                       # gloo has no reduce_scatter: all-reduce, then chunk
                work = dist.all_reduce(gx, group=group, async_op=True)
                chunk_after = ctx.gather_dim is not None
        out = []
        for i, (g, w, bias_dtype) in enumerate(zip(grads, weights, ctx.bias_dtypes)):
            gw = gb = None
            if g is not None:
                g2 = g.reshape(-1, g.shape[-1])
                if needs[3 + 2 * i]:
                    gw = g2.t().mm(full.reshape(-1, full.shape[-1]).to(g.dtype)).to(w.dtype)
                if bias_dtype is not None and needs[4 + 2 * i]:
                    gb = g2.sum(0).to(bias_dtype)
            out += [gw, gb]
        if work is not None:
            wait_for(work, group)               # (where the hang watch sees it)
            if chunk_after:
                gx = _chunk(gx, ctx.gather_dim, group)
        return (gx, None, None, *out)


def _with_linears(x, group, gather_dim, linears, unfused):
    """The collective fused with the linears it feeds (_GradSyncLinears); while torch.compile
    traces (inductor places the wait itself) or without grad, `unfused()` then the linears."""
    if _tracing() or not torch.is_grad_enabled():
        full = unfused()
        return tuple(F.linear(full, w, b) for w, b in linears)
    return _GradSyncLinears.apply(x, group, gather_dim, *(t for wb in linears for t in wb))


def all_reduce(x, *, group):
    return _AllReduce.apply(x, group)


def chunk(x, *, dim, group, zigzag=False):
    """R -> S(dim); `zigzag`: this rank's two chunks of 2 x group size (see _zig_chunk)."""
    return _Chunk.apply(x, dim, group, zigzag)


def all_gather(x, *, dim, group, reduce_grad=False, linears=None, zigzag=False):
    """S(dim) -> R. With reduce_grad the users' gradients are partial sums: reduce-scatter them
    (all_gather + sync_grad in one step). With `linears` ((weight, bias), ...; reduce_grad
    only): the column-split linears the gathered value feeds, returned as a tuple, their
    weight gradients computed while the input gradient is reduce-scattered. `zigzag`: the
    pieces are in the zigzag order (context parallelism), put back in sequence order."""
    if linears is None:
        return _AllGather.apply(x, dim, group, reduce_grad, zigzag)
    return _with_linears(x, group, dim, linears,
                         lambda: _AllGather.apply(x, dim, group, reduce_grad, zigzag))


def reduce_scatter(x, *, dim, group, zigzag=False):
    return _ReduceScatter.apply(x, dim, group, zigzag)


def all_to_all(x, *, src_dim, dst_dim, group):
    return _AllToAll.apply(x, src_dim, dst_dim, group)


def to_partial(x, *, group):
    return _ToPartial.apply(x, group)


def sync_grad(x, *, group, linears=None):
    """Identity forward, gradient summed over `group` in backward (Megatron's `f`). With
    `linears` ((weight, bias), ...): the column-split linears x feeds, returned as a tuple,
    their weight gradients computed while the input gradient is all-reduced."""
    if linears is None:
        return _SyncGrad.apply(x, group)
    return _with_linears(x, group, None, linears, lambda: _SyncGrad.apply(x, group))


def cross_entropy_rows(input, target, weight=None, reduction=1, ignore_index=-100,
                       label_smoothing=0.0, *, group):
    """Mean cross-entropy over rows split across `group`: this rank's share of the global mean
    (local sum / global count of counted targets), a partial sum."""
    local = F.cross_entropy(input, target, weight, reduction="sum", ignore_index=ignore_index,
                            label_smoothing=label_smoothing)
    count = _reduce((target != ignore_index).sum().to(local.dtype), group)
    return local / count


def local_experts(x, w_in, w_out, offs, gmm, act, *, group):
    """nncompile_moe::experts_mlp with this rank's experts (w_in, w_out: [E/n, ...], rank r holding
    experts r E/n ..): the rows routed to them (x sorted by expert, `offs` every expert's
    last row + 1), zeros elsewhere; a partial sum over `group` (nncompile/rules/experts.py)."""
    from nncompile.experts import EXPERTS_MLP
    local = w_in.shape[0]
    first = _rank(group) * local
    ends = offs.to(torch.int64)
    start = int(ends[first - 1]) if first else 0
    end = int(ends[first + local - 1])
    mine = offs[first:first + local] - start
    y = EXPERTS_MLP(x[start:end], w_in, w_out, mine.to(offs.dtype), gmm, act)
    return F.pad(y, (0, 0, start, x.shape[0] - end))


def attention_rows(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                   scale=None, enable_gqa=False, *, group, zigzag=False):
    """Attention of this rank's query rows against every key and value (the sequence split
    across `group`: rank r holds rows r*L .. (r+1)*L-1, or with `zigzag` the chunks r and
    2C-1-r of 2C), each row seeing exactly the keys it sees unsplit. A causal mask is never
    materialized: each block of rows attends to the keys before it and to its causal
    diagonal block, merged by their log-sum-exps (CPU: the flash kernel's own lse, where q
    and v heads are one size), or to the keys up to its last row with a lower-right causal
    bias (CUDA; CPU with MLA's wider q/k heads); with a mask of the model's own, the causal
    part is and-ed into it."""
    if not is_causal:
        return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask,
                                              dropout_p=dropout_p, scale=scale,
                                              enable_gqa=enable_gqa)
    n, r = (_size(group), _rank(group)) if group is not None else (1, 0)
    rows = query.shape[-2]
    half = rows // 2            # zigzag: two blocks of rows, chunks r and 2n-1-r of 2n
    blocks = ((0, rows, r * rows),) if not zigzag else \
        ((0, half, r * half), (half, half, (2 * n - 1 - r) * half))
    if attn_mask is None and not dropout_p and query.dim() == 4 and query.device.type == "cpu" \
            and query.shape[-1] == value.shape[-1]:     # the CPU flash kernel's one head size
        return _CausalRows.apply(query, key, value, blocks, scale)
    return torch.cat([_rows_at(query[..., a:a + m, :], key, value,
                               None if attn_mask is None else attn_mask[..., a:a + m, :],
                               dropout_p, offset, scale, enable_gqa)
                      for a, m, offset in blocks], dim=-2)


def _rows_at(query, key, value, attn_mask, dropout_p, offset, scale, enable_gqa):
    """Causal attention of rows offset .. offset+L-1 against the keys up to its last row: a
    lower-right causal bias (CUDA), or a boolean mask (CPU with a mask of the model's own)."""
    rows = query.shape[-2]
    key, value = key[..., :offset + rows, :], value[..., :offset + rows, :]
    if attn_mask is None and not dropout_p and query.dim() == 4:
        from torch.nn.attention.bias import causal_lower_right
        return F.scaled_dot_product_attention(
            query, key, value, attn_mask=causal_lower_right(rows, offset + rows),
            scale=scale, enable_gqa=enable_gqa)
    causal = torch.arange(offset + rows, device=query.device)[None, :] <= \
        torch.arange(rows, device=query.device)[:, None] + offset
    if attn_mask is None:
        attn_mask = causal
    else:
        attn_mask = attn_mask[..., :offset + rows]
        attn_mask = attn_mask & causal if attn_mask.dtype == torch.bool else \
            attn_mask.masked_fill(~causal, float("-inf"))
    return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask,
                                          dropout_p=dropout_p, scale=scale,
                                          enable_gqa=enable_gqa)


def _key_blocks(offset: int, rows: int) -> list[tuple[int, int, bool]]:
    """(first key, end key, causal) of the keys before a block of rows and its diagonal."""
    return ([(0, offset, False)] if offset else []) + [(offset, offset + rows, True)]


def _heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """k or v with each of its heads repeated for the query heads it serves (GQA)."""
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


class _CausalRows(torch.autograd.Function):
    """Causal attention of blocks of rows (first row in q, rows, first row in the sequence)
    on CPU: per block, the flash kernel on the keys before it and on its diagonal, merged by
    log-sum-exp into one output; backward runs each piece's flash backward with the merged
    output and lse (the merge's exact gradient). Saves q, k, v, the output and the lse."""

    @staticmethod
    def forward(ctx, q, k, v, blocks, scale):
        heads = q.shape[1]
        kx, vx = _heads(k, heads), _heads(v, heads)
        wide = torch.promote_types(q.dtype, torch.float32)     # the merge's precision
        out = torch.empty_like(q)
        lse = q.new_empty(q.shape[:-1], dtype=wide)
        for a, m, offset in blocks:
            o = s = None
            for ka, kb, causal in _key_blocks(offset, m):
                ob, sb = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                    q[..., a:a + m, :], kx[..., ka:kb, :], vx[..., ka:kb, :], 0.0, causal,
                    scale=scale)
                if o is None:
                    o, s = ob.to(wide), sb
                    continue
                merged = torch.logaddexp(s, sb)
                o = o * torch.exp(s - merged).unsqueeze(-1) + \
                    ob.to(wide) * torch.exp(sb - merged).unsqueeze(-1)
                s = merged
            out[..., a:a + m, :] = o
            lse[..., a:a + m] = s
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.blocks, ctx.scale = blocks, scale
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        heads = q.shape[1]
        kx, vx = _heads(k, heads), _heads(v, heads)
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(kx), torch.zeros_like(vx)
        for a, m, offset in ctx.blocks:
            rows = slice(a, a + m)
            g, qb = grad[..., rows, :].contiguous(), q[..., rows, :].contiguous()
            ob, sb = out[..., rows, :].contiguous(), lse[..., rows].contiguous()
            for ka, kb, causal in _key_blocks(offset, m):
                gq, gk, gv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                    g, qb, kx[..., ka:kb, :], vx[..., ka:kb, :], ob, sb, 0.0, causal,
                    scale=ctx.scale)
                dq[..., rows, :] += gq
                dk[..., ka:kb, :] += gk
                dv[..., ka:kb, :] += gv
        if k.shape[1] != heads:         # GQA: each k/v head's gradient from its query heads
            g = heads // k.shape[1]
            dk = dk.unflatten(1, (k.shape[1], g)).sum(2)
            dv = dv.unflatten(1, (v.shape[1], g)).sum(2)
        return dq, dk, dv, None, None
