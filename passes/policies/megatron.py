"""`tp` and `tp_sp`: Megatron-LM's tensor-parallel plan, found on any attention + MLP graph.

A *region* starts at column-split linears (weight split on its output dim, input replicated:
q/k/v, fc, gate/up), runs through ops that follow the split without communication (head
reshapes, RoPE, attention split by heads, activations, gating products) and ends at
row-split linears (weight split on its input dim) whose outputs are partial sums. Everything
outside regions runs replicated, so one forward all-reduce per region remains (Megatron's `g`);
the backward all-reduce before the region (Megatron's `f`) is insert_comm's `sync_grad`.

    x = layer_norm(h)                       R        x = layer_norm(h)                    R
    q = linear(x, wq); k = ...; v = ...     R   ->   q = linear(sync_grad(x), wq[rank])  S(2)
    a = sdpa(q, k, v)                       R        a = sdpa(q, k, v)  (heads split)     S(1)
    o = linear(a, wo)                       R        o = linear(a, wo[:, rank])           P
    h = h + o                               R        h = h + all_reduce(o)                R

Which linears start regions is found, not named: every single-use 2-D weight op with a
replicated input is tried as a column split; when a split cannot reach a row-split linear
without communication (the embedding, a tied or untied lm_head feeding the loss, a fused qkv
weight whose rows interleave heads, heads not divisible by the plan), the column splits it
came from are vetoed and the walk runs again, until every region closes.

`tp_sp` adds Megatron's sequence parallelism: ops of the layer blocks outside regions (norms,
residual adds, dropout) run split on the sequence dim (dim 1), so the region's entry becomes an
all_gather whose backward is a reduce-scatter, and its exit a reduce-scatter:

    x = layer_norm(h)              S(1)      (per-rank rows of the sequence)
    x_g = all_gather(x, dim=1)     R         backward: reduce_scatter
    ... region ...
    h = h + reduce_scatter(o)      S(1)      backward: all_gather
"""
from __future__ import annotations

import warnings

from nncompile.ir import FREE_KINDS, PARAM, Graph, Op, Partial, Replicate, Shard, Strategy, \
    Value
from nncompile.rules import replicated, strategies
from nncompile.symbolic import warn_unsplit_sequence

from ..pipeline_stages import layer_of

SEQ_DIM = 1                     # [batch, sequence, hidden] activations


class _Walk:
    """One pass over the ops with a fixed set of vetoed column splits."""

    def __init__(self, g: Graph, n: int, vetoed: set[str], cands: dict[int, list[Strategy]],
                 uses: dict[int, int]):
        self.g, self.n, self.vetoed, self.cands, self.uses = g, n, vetoed, cands, uses
        self.place: dict[int, object] = {id(v): Replicate() for v in g.inputs}
        self.free: dict[int, object] = {}           # free inputs placed by their first user
        self.prov: dict[int, frozenset] = {}        # split value -> column ops it came from
        self.choice: dict[int, Strategy] = {}
        self.failed: set[str] = set()
        self.stopped_at: dict[str, Op] = {}         # column op -> where its split stopped

    # ---- placements ------------------------------------------------------------------------
    def current(self, v: Value):
        if v.kind in FREE_KINDS:
            return self.free.get(id(v))
        return self.place.get(id(v), Replicate())

    def _free_ok(self, v: Value, want) -> bool:
        placed = self.free.get(id(v))
        if isinstance(want, Partial):
            return not isinstance(placed, Shard)        # to_partial of a replicated value
        if placed is None:
            return isinstance(want, Replicate) or self.uses[id(v)] == 1 or not v.requires_grad
        if placed == want:
            return True
        return isinstance(placed, Replicate) and isinstance(want, Shard) \
            and not v.requires_grad                     # a local chunk, no backward traffic

    def _weight_split(self, op: Op, s: Strategy) -> bool:
        return any(v.kind == PARAM and len(v.meta.shape) >= 2 and isinstance(p, Shard)
                   for v, p in zip(op.tensor_inputs(), s.inputs))

    # ---- choices ---------------------------------------------------------------------------
    def column(self, op: Op) -> Strategy | None:
        """A split of a weight on its output dim, every activation input replicated."""
        if op.name in self.vetoed:
            return None
        for s in self.cands[id(op)]:
            if len(s.outputs) != 1 or not isinstance(s.outputs[0], Shard) \
                    or not self._weight_split(op, s):
                continue
            if all(self._free_ok(v, p) if v.kind in FREE_KINDS else isinstance(p, Replicate)
                   for v, p in zip(op.tensor_inputs(), s.inputs)):
                return s
        return None

    def follow(self, op: Op) -> Strategy | None:
        """A strategy that takes the split inputs as they are, with no communication: outputs
        stay split, or a weight split on its input dim leaves a partial sum (a row linear)."""
        best = None
        for s in self.cands[id(op)]:
            outs = [p for v, p in zip(op.outputs, s.outputs) if v.is_tensor]
            row = all(isinstance(p, Partial) for p in outs) and self._weight_split(op, s)
            if not outs or not (row or all(isinstance(p, Shard) for p in outs)):
                continue
            chunks = 0
            for v, want in zip(op.tensor_inputs(), s.inputs):
                have = self.current(v)
                if v.kind in FREE_KINDS:
                    if not self._free_ok(v, want):
                        break
                elif isinstance(have, Shard):
                    if want != have:
                        break
                elif isinstance(have, Partial):
                    if not isinstance(want, Replicate):
                        break                            # all_reduce first
                elif isinstance(want, Shard):
                    if v.requires_grad:
                        break                            # would all_gather its gradient
                    chunks += 1
                elif not isinstance(want, Replicate):
                    break
            else:
                if best is None or chunks < best[0]:
                    best = (chunks, s)
        return best[1] if best else None

    def record(self, op: Op, s: Strategy, prov: frozenset) -> None:
        self.choice[id(op)] = s
        for v, want in zip(op.tensor_inputs(), s.inputs):
            if v.kind in FREE_KINDS and id(v) not in self.free:
                self.free[id(v)] = want if isinstance(want, Shard) else Replicate()
        for v, p in zip(op.outputs, s.outputs):
            self.place[id(v)] = p if v.is_tensor else Replicate()
            if v.is_tensor and not isinstance(p, Replicate):
                self.prov[id(v)] = prov

    def run(self) -> set[str]:
        for op in self.g.ops:
            ins = op.tensor_inputs()
            split = [v for v in ins if v.kind not in FREE_KINDS
                     and isinstance(self.current(v), Shard)]
            prov = frozenset().union(*(self.prov.get(id(v), frozenset()) for v in split))
            s = None
            if split:
                s = self.follow(op)
                if s is None:
                    self.failed |= prov           # the split cannot close here: undo its source
                    for name in prov:
                        self.stopped_at.setdefault(name, op)
            else:
                s = self.column(op)
                if s is not None:
                    prov = frozenset([op.name])
            self.record(op, s or replicated(op), prov)
        for v in self.g.outputs:
            if isinstance(v, Value) and isinstance(self.place.get(id(v)), Shard):
                self.failed |= self.prov.get(id(v), frozenset())
        return self.failed


def _where(stops: dict[str, Op], vetoed: list[Op]) -> str:
    """Where the first vetoed linear's split stopped, with the source line."""
    for col in vetoed:
        op = stops.get(col.name)
        if op is not None:
            src = f" ({op.source})" if op.source else ""
            return (f" The split of {col.module_path or col.name} stopped at {op.target_name} in "
                    f"{op.module_path or 'the model'}{src}: no rule takes its inputs split as "
                    "they arrive.")
    return ""


def _sequence_parallel(g: Graph, n: int, walk: _Walk,
                       cands: dict[int, list[Strategy]]) -> None:
    """Split the layer blocks' ops outside regions on the sequence dim (see module doc); when
    none can be (a dynamic sequence that is not a declared multiple of n), warn."""
    region = {id(op) for op in g.ops if walk.choice[id(op)].is_split}
    place = walk.place
    sp: set[int] = set()
    for op in g.ops:
        if id(op) in region or layer_of(op.module_path) is None:
            continue
        ins = op.tensor_inputs()
        acts = [v for v in ins if v.kind not in FREE_KINDS]
        seq = [v for v in acts if isinstance(place.get(id(v)), (Shard, Partial))]
        if not seq and not any(v.requires_grad for v in acts):
            continue                         # masks, positions: not the residual stream
        for s in cands[id(op)]:
            outs = [p for v, p in zip(op.outputs, s.outputs) if v.is_tensor]
            if outs and all(p == Shard(SEQ_DIM) for p in outs) and all(
                    _seq_input_ok(v, place.get(id(v)), want) for v, want in zip(ins, s.inputs)):
                walk.record(op, s, frozenset())
                sp.add(id(op))
                break
    # an op whose every user runs replicated in the block (attention that is not split, say)
    # would be gathered right away: run it replicated too, back to the residual stream
    users: dict[int, list[Op]] = {}
    for op in g.ops:
        for v in op.tensor_inputs():
            users.setdefault(id(v), []).append(op)
    changed = True
    while changed:
        changed = False
        for op in reversed(g.ops):
            if id(op) not in sp:
                continue
            after = [u for v in op.outputs for u in users.get(id(v), [])]
            if after and all(id(u) not in sp and id(u) not in region
                             and layer_of(u.module_path) is not None for u in after):
                sp.discard(id(op))
                walk.record(op, replicated(op), frozenset())
                changed = True
    if not sp:
        warn_unsplit_sequence(g, n, [v.meta.shape[SEQ_DIM] for op in g.ops
                                     if id(op) not in region
                                     and layer_of(op.module_path) is not None
                                     for v in op.outputs
                                     if v.is_tensor and len(v.meta.shape) > SEQ_DIM])


def _seq_input_ok(v: Value, have, want) -> bool:
    """An input of a sequence-split op: parameters stay replicated (their gradients are summed
    over the unit), split values keep their split, partial sums are reduce-scattered and
    replicated activations chunked (Megatron-SP's scatter; its backward gathers)."""
    if v.kind in FREE_KINDS:
        return isinstance(want, Replicate)
    if isinstance(have, Shard):
        return want == have
    if isinstance(have, Partial):
        return isinstance(want, Shard)
    return isinstance(want, (Shard, Replicate))


def megatron(graph: Graph, config, sequence_parallel: bool = False) -> Graph:
    g = graph.clone()
    n = g.plan_ngpus = config.plan_ngpus
    if n == 1:
        return g
    cands = {id(op): strategies(op, n) for op in g.ops}
    uses: dict[int, int] = {}
    for op in g.ops:
        for v in op.tensor_inputs():
            uses[id(v)] = uses.get(id(v), 0) + 1
    vetoed: set[str] = set()
    stops: dict[str, Op] = {}                   # vetoed column op -> where its split stopped
    while True:
        walk = _Walk(g, n, vetoed, cands, uses)
        failed = walk.run() - vetoed
        if not failed:
            break
        for name in failed:
            if name in walk.stopped_at:
                stops[name] = walk.stopped_at[name]
        vetoed |= failed
    in_block_ops = [op for op in g.ops
                    if op.name in vetoed and layer_of(op.module_path) is not None
                    and not walk._weight_split(op, walk.choice[id(op)])]
    in_blocks = [op.module_path or op.name for op in in_block_ops]
    if in_blocks:
        warnings.warn(f"tp at plan {n}: {len(in_blocks)} linear(s) in the layer blocks run "
                      f"replicated, because splitting them would need extra communication "
                      f"(heads or key/value heads not divisible by {n}, or a fused weight "
                      f"whose rows interleave heads): {', '.join(sorted(set(in_blocks))[:6])}"
                      f"{' ...' if len(set(in_blocks)) > 6 else ''}. Pick a plan size that "
                      f"divides the head counts to split them.{_where(stops, in_block_ops)}",
                      stacklevel=2)
    if sequence_parallel:
        _sequence_parallel(g, n, walk, cands)
    for op in g.ops:
        s = walk.choice[id(op)]
        op.strategy = s
        for v, p in zip(op.outputs, s.outputs):
            v.placement = p if v.is_tensor else Replicate()
    for v in g.params + g.buffers + g.consts:
        v.placement = walk.free.get(id(v)) or Replicate()
    return g


def tp(graph: Graph, config) -> Graph:
    """Megatron tensor parallelism: column-split q/k/v/fc/gate/up, row-split proj/down,
    attention split by heads, everything else replicated (one forward all-reduce per
    attention and per MLP)."""
    return megatron(graph, config)


def tp_sp(graph: Graph, config) -> Graph:
    """`tp` plus sequence parallelism in the layer blocks: norms, residuals and dropout split
    on the sequence dim; all_gather before and reduce_scatter after each region."""
    return megatron(graph, config, sequence_parallel=True)
