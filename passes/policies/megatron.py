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
replicated input is tried as a column split (a weight seen through `w.T`, a transpose or a
reshape counts as the weight, so `x @ w.T + b`, `addmm(b, x, w.t())` and an einsum over `w`
split as `linear(x, w, b)` does); when a split cannot reach a row-split linear
without communication (the embedding, a tied or untied lm_head feeding the loss, heads not
divisible by the plan), the column splits it
came from are vetoed and the walk runs again, until every region closes. Linears of the layer
blocks left replicated are named in one warning, a line per layer kind with the reason found
(where the split stopped; head counts only where they do not divide).

A fused projection cut into pieces (nanoGPT's `c_attn` then `.split`) reaches the policy as one
linear per piece over *parts* of the fused weight (passes/unfuse_projections.py): q, k and v
split by heads, gate and up by columns, each part on its own. Where a split fails at an op
whose other split inputs fit a strategy, only the sources of the inputs off it are undone: a
multi-query k/v (one head) stays whole on every rank while q splits by heads, as in
Megatron-LM, and is not named in the warning.

A weight several projections read (a query projection applied to the hidden states and to a
relative-position table) splits when every reader takes it alike, else it stays replicated
(never split for one reader and gathered for another). Heads split inside a merged
(batch * heads) dim are a strided split S(0|batch) (rules under `strided_splits()`), so
attention that runs bmm over that dim stays in the region.

A low-rank down-projection normed before its up-projection (DeepSeek's MLA: q_a_proj ->
q_a_layernorm -> q_b_proj) runs replicated (all its parts, when it was fused with another
projection), so the up-projection starts the column split, and a replicated activation
broadcast into the heads (`expand` of MLA's shared rotary key) enters the
region split like a column output (its backward is Megatron's `f`).

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
    StridedShard, Value
from nncompile.rules import replicated, strategies, strided_splits
from nncompile.experts import EXPERTS_MLP, MOE_EXPERTS
from nncompile.symbolic import warn_unsplit_sequence

from ..contract import tensor_ranks
from ..pipeline_stages import layer_of
from .tp_warning import _kind, replicated_warning, split_share  # noqa: F401 (split_share: public)

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
        self.entries: set[str] = set()              # expands that start a split
        self.placed_by: dict[int, str] = {}         # shared weight -> the column op splitting it
        self.views = weight_views(g, uses)

    # ---- placements ------------------------------------------------------------------------
    def is_free(self, v: Value) -> bool:
        """A parameter, buffer or constant, or a weight seen through layout ops (`w.T`): its
        placement is chosen by its first user."""
        return v.kind in FREE_KINDS or id(v) in self.views

    def current(self, v: Value):
        if self.is_free(v):
            return self.free.get(id(v))
        return self.place.get(id(v), Replicate())

    def _view_chain(self, v: Value, want):
        """[(layout op, its strategy)] that give the weight view `v` placement `want`, from
        `v` up to its parameter, and the parameter's placement; None where no rule can."""
        chain = []
        while id(v) in self.views:
            op = self.views[id(v)]
            s = next((s for s in self.cands[id(op)] if s.outputs[0] == want), None)
            if s is None:
                return None
            chain.append((op, s))
            v, want = op.tensor_inputs()[0], s.inputs[0]
        return chain, v, want

    def _free_ok(self, v: Value, want, column: bool = False) -> bool:
        placed = self.free.get(id(v))
        if isinstance(want, Partial):
            return not isinstance(placed, Shard)        # to_partial of a replicated value
        if placed is None:
            if id(v) in self.views and isinstance(want, Shard) \
                    and self._view_chain(v, want) is None:
                return False
            # a weight several projections read (a query projection applied to the hidden
            # states and to a position table) splits when every reader takes it alike
            # (checked at the end of the walk, `shared_ok`)
            return isinstance(want, Replicate) or self.uses[id(v)] == 1 \
                or not v.requires_grad or (column and v.kind == PARAM)
        if placed == want:
            return True
        return isinstance(placed, Replicate) and isinstance(want, Shard) \
            and not v.requires_grad                     # a local chunk, no backward traffic

    def _weight_split(self, op: Op, s: Strategy) -> bool:
        return any((v.kind == PARAM or id(v) in self.views) and len(v.meta.shape) >= 2
                   and isinstance(p, Shard) for v, p in zip(op.tensor_inputs(), s.inputs))

    # ---- choices ---------------------------------------------------------------------------
    def column(self, op: Op) -> Strategy | None:
        """A split of a weight on its output dim, every activation input replicated. An op
        that reads no activation (a table indexed by positions) splits its last (feature)
        dim only: a norm of a position table split by rows is no projection."""
        if op.name in self.vetoed:
            return None
        tables = all(self.is_free(v) for v in op.tensor_inputs())
        for s in self.cands[id(op)]:
            if len(s.outputs) != 1 or not isinstance(s.outputs[0], Shard) \
                    or not self._weight_split(op, s):
                continue
            if tables and s.outputs[0].dim != len(op.outputs[0].meta.shape) - 1:
                continue
            if all(self._free_ok(v, p, column=not tables) if self.is_free(v)
                   else isinstance(p, Replicate) for v, p in zip(op.tensor_inputs(), s.inputs)):
                return s
        return None

    def entry(self, op: Op) -> Strategy | None:
        """A replicated activation broadcast into a split dim (`expand` of a size-1 dim): MLA's
        rotary key, shared by every head, expanded to the local heads of a region."""
        if not is_entry(op) or op.name in self.vetoed \
                or not all(v.requires_grad and not self.is_free(v) for v in op.tensor_inputs()):
            return None
        for s in self.cands[id(op)]:
            if isinstance(s.outputs[0], Shard) \
                    and all(isinstance(p, Replicate) for p in s.inputs if p is not None):
                self.entries.add(op.name)
                return s
        return None

    def experts(self, op: Op) -> Strategy | None:
        """A mixture-of-experts layer's experts (passes/fuse_experts.py) split across the
        ranks: expert weights on their expert dim, the token rows replicated, the output a
        partial sum (nncompile/rules/experts.py)."""
        if op.target not in (EXPERTS_MLP, MOE_EXPERTS) or op.name in self.vetoed:
            return None
        for s in self.cands[id(op)]:
            if isinstance(s.outputs[0], Partial) and all(
                    self._free_ok(v, p) if self.is_free(v) else isinstance(p, Replicate)
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
                if self.is_free(v):
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

    def blame(self, op: Op, split: list[Value]) -> frozenset:
        """The column splits to undo where `op` takes none of its split inputs as they are:
        those of the inputs a strategy wants otherwise, for the strategy that keeps the most
        split inputs (and none of whose sources it shares); empty when none keeps any."""
        best: frozenset = frozenset()
        kept_most = 0
        for s in self.cands[id(op)]:
            kept = [v for v, p in zip(op.tensor_inputs(), s.inputs)
                    if v in split and p == self.current(v)]
            off = [v for v in split if v not in kept]
            if not off or len(kept) <= kept_most:
                continue
            keep = frozenset().union(*(self.prov.get(id(v), frozenset()) for v in kept))
            undo = frozenset().union(*(self.prov.get(id(v), frozenset()) for v in off))
            if undo and not undo & keep:
                best, kept_most = undo, len(kept)
        return best

    def record(self, op: Op, s: Strategy, prov: frozenset) -> None:
        self.choice[id(op)] = s
        for v, want in zip(op.tensor_inputs(), s.inputs):
            if self.is_free(v) and id(v) not in self.free and self.uses.get(id(v), 0) > 1 \
                    and v.kind == PARAM and isinstance(want, Shard) and prov == {op.name}:
                self.placed_by[id(v)] = op.name          # a column split of a shared weight
            if self.is_free(v) and id(v) not in self.free:
                # a strided split is no box of the tensor: the value stays whole, chunked at use
                self.free[id(v)] = want if isinstance(want, Shard) \
                    and not isinstance(want, StridedShard) else Replicate()
                if id(v) in self.views:
                    self._place_view(v, self.free[id(v)])
        for v, p in zip(op.outputs, s.outputs):
            self.place[id(v)] = p if v.is_tensor else Replicate()
            if v.is_tensor and not isinstance(p, Replicate):
                self.prov[id(v)] = prov

    def _place_view(self, v: Value, want) -> None:
        """The layout ops between a parameter and its view `v` take the strategies that give
        `v` its placement; the parameter takes the placement they need."""
        chain, root, root_want = self._view_chain(v, want) or self._view_chain(v, Replicate())
        for op, s in chain:
            self.choice[id(op)] = s
            self.place[id(op.outputs[0])] = s.outputs[0]
        self.free[id(root)] = root_want

    def run(self) -> set[str]:
        for op in self.g.ops:
            if op.outputs and id(op.outputs[0]) in self.views:
                self.choice[id(op)] = replicated(op)    # until its user places the view
                continue
            ins = op.tensor_inputs()
            split = [v for v in ins if not self.is_free(v)
                     and isinstance(self.current(v), Shard)]
            prov = frozenset().union(*(self.prov.get(id(v), frozenset()) for v in split))
            s = None
            if split:
                s = self.follow(op)
                if s is None:
                    # the split cannot close here: undo its source, a broadcast entry last;
                    # only the sources of the inputs split off a strategy the others fit
                    # (multi-query: q by heads, the one k/v head split along head_dim)
                    prov = self.blame(op, split) or prov
                    prov = frozenset(p for p in prov if p not in self.entries) or prov
                    self.failed |= prov
                    for name in prov:
                        self.stopped_at.setdefault(name, op)
            else:
                s = self.column(op) or self.entry(op) or self.experts(op)
                if s is not None:
                    prov = frozenset([op.name])
            self.record(op, s or replicated(op), prov)
        nupd = len(self.g.trace_info.buffer_updates)     # new buffer values: into their shards
        for v in self.g.outputs[:len(self.g.outputs) - nupd]:
            if isinstance(v, Value) and isinstance(self.place.get(id(v)), Shard):
                self.failed |= self.prov.get(id(v), frozenset())
        self.shared_ok()
        return self.failed

    def shared_ok(self) -> None:
        """A weight read by several ops, split by the first: every other reader must take it
        as it is placed, else the first one's column split is undone (no weight gathers)."""
        for op in self.g.ops:
            for v, want in zip(op.tensor_inputs(), self.choice[id(op)].inputs):
                first = self.placed_by.get(id(v))
                if first is not None and want is not None and want != self.free.get(id(v)):
                    self.failed.add(first)
                    self.stopped_at.setdefault(first, op)


# layout ops through which a weight still reads as a weight: `w.T`, `w.t()`, a transpose,
# a reshape or a cast (FalconLinear's `x @ self.weight.T`, an einsum over a reshaped weight)
WEIGHT_VIEW_OPS = {"t", "numpy_T", "transpose", "permute", "view", "reshape", "_unsafe_view",
                   "alias", "contiguous", "clone", "_to_copy", "to"}


def weight_views(g: Graph, uses: dict[int, int]) -> dict[int, Op]:
    """{id of a value: the layout op producing it} for a 2-D or larger parameter seen through
    WEIGHT_VIEW_OPS, each link used once: `x @ w.T + b` then splits as `linear(x, w, b)`
    does, the parameter split on the dim the view's user splits."""
    views: dict[int, Op] = {}
    for op in g.ops:
        ins = op.tensor_inputs()
        if getattr(op.target, "_opname", None) not in WEIGHT_VIEW_OPS or len(ins) != 1 \
                or len(op.outputs) != 1 or not op.outputs[0].is_tensor:
            continue
        v = ins[0]
        if uses.get(id(v)) == 1 and (id(v) in views or v.kind == PARAM
                                      and len(v.meta.shape) >= 2):
            views[id(op.outputs[0])] = op
    return views


def is_entry(op: Op) -> bool:
    """An op that may start a split with no weight: an `expand`."""
    return getattr(op.target, "_opname", None) == "expand"


# reductions over the features of a norm: a down-projection normed before its up-projection
NORM_REDUCTIONS = {"mean", "var", "rms_norm", "layer_norm", "native_layer_norm"}


def _low_rank_downs(g: Graph) -> set[str]:
    """Names of the block linears whose whole output is normed before anything else reads it
    (MLA's q_a_proj -> q_a_layernorm, kv_a_proj_with_mqa -> split -> kv_a_layernorm): small
    down-projections that run replicated, so the up-projection after the norm starts the
    column split (Megatron's plan for DeepSeek's attention).

        q = q_b_proj(q_a_layernorm(q_a_proj(x)))   ->   q_a_proj, the norm: R; q_b_proj: S(0)
    """
    users: dict[int, list[Op]] = {}
    for op in g.ops:
        for v in op.tensor_inputs():
            users.setdefault(id(v), []).append(op)
    found = set()
    for op in g.ops:
        if layer_of(op.module_path) is None or len(op.outputs) != 1 \
                or not any(v.kind == PARAM and len(v.meta.shape) == 2
                           for v in op.tensor_inputs()):
            continue
        todo, depth = [op.outputs[0]], 0
        while todo and depth < 4 and op.name not in found:
            nxt = []
            for v in todo:
                for u in users.get(id(v), []):
                    acts = [w for w in u.tensor_inputs() if w.kind not in FREE_KINDS]
                    if len(acts) != 1 or any(o.is_tensor and len(o.meta.shape) != 3
                                             for o in u.outputs):
                        continue
                    if getattr(u.target, "_opname", None) in NORM_REDUCTIONS:
                        found.add(op.name)
                    nxt += [o for o in u.outputs if o.is_tensor]
            todo, depth = nxt, depth + 1
    return found


def _one_head_kv(g: Graph, walk: _Walk) -> set[str]:
    """Names of the replicated block linears whose output is one attention head (a multi-query
    k or v, e.g. a part of a fused qkv) in a layer whose attention splits q by heads: Megatron
    keeps them whole on every rank, so they are the plan, not a split that stopped."""
    head_dims: dict[str, set[int]] = {}
    for op in g.ops:
        if getattr(op.target, "_opname", None) == "scaled_dot_product_attention" \
                and isinstance(walk.choice[id(op)].outputs[0], Shard):
            head_dims.setdefault(layer_of(op.module_path), set()).add(
                op.tensor_inputs()[0].meta.shape[-1])
    return {op.name for op in g.ops
            if op.outputs and op.outputs[0].is_tensor and not walk.choice[id(op)].is_split
            and layer_of(op.module_path) in head_dims
            and any(v.kind == PARAM or id(v) in walk.views for v in op.tensor_inputs())
            and op.outputs[0].meta.shape[-1] in head_dims[layer_of(op.module_path)]}


def _stop_alone(g: Graph, n: int, col: Op, vetoed: set[str], cands, uses) -> Op | None:
    """Where the column split of `col` stops with every other veto kept: its own reason, not
    that of a split it was undone with."""
    walk = _Walk(g, n, vetoed - {col.name}, cands, uses)
    walk.run()
    return walk.stopped_at.get(col.name)


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
        acts = [v for v in ins if not walk.is_free(v)]
        seq = [v for v in acts if isinstance(place.get(id(v)), (Shard, Partial))]
        if not seq and not any(v.requires_grad for v in acts):
            continue                         # masks, positions: not the residual stream
        for s in cands[id(op)]:
            outs = [p for v, p in zip(op.outputs, s.outputs) if v.is_tensor]
            if outs and all(p == Shard(SEQ_DIM) for p in outs) and all(
                    _seq_input_ok(v, place.get(id(v)), want, walk.is_free(v))
                    for v, want in zip(ins, s.inputs)):
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


def _seq_input_ok(v: Value, have, want, free: bool) -> bool:
    """An input of a sequence-split op: parameters stay replicated (their gradients are summed
    over the unit), split values keep their split, partial sums are reduce-scattered and
    replicated activations chunked (Megatron-SP's scatter; its backward gathers)."""
    if free:
        return isinstance(want, Replicate)
    if isinstance(have, Shard):
        return want == have
    if isinstance(have, Partial):
        return isinstance(want, Shard)
    return isinstance(want, (Shard, Replicate))


def megatron(graph: Graph, config, sequence_parallel: bool = False) -> Graph:
    g = graph.clone()
    n = g.plan_ngpus = tensor_ranks(graph, config)    # (passes/planner.py)
    if n == 1:
        return g
    with strided_splits():                      # heads inside a merged (batch * heads) dim
        cands = {id(op): strategies(op, n) for op in g.ops}
    uses: dict[int, int] = {}
    for op in g.ops:
        for v in op.tensor_inputs():
            uses[id(v)] = uses.get(id(v), 0) + 1
    low_rank = _low_rank_downs(g)               # stay replicated, as Megatron keeps them
    fused = {op.attrs["part_of"] for op in g.ops if op.name in low_rank and "part_of" in op.attrs}
    low_rank |= {op.name for op in g.ops if op.attrs.get("part_of") in fused}   # its other parts
    vetoed: set[str] = set(low_rank)
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
    one_head = _one_head_kv(g, walk)            # multi-query k/v: whole, as Megatron keeps them
    in_block_ops = [op for op in g.ops
                    if op.name in vetoed and layer_of(op.module_path) is not None
                    and not is_entry(op) and op.name not in low_rank
                    and op.name not in one_head
                    and not walk._weight_split(op, walk.choice[id(op)])]
    if in_block_ops:
        firsts = {}
        for op in in_block_ops:
            firsts.setdefault(_kind(op.module_path or op.name) + op.attrs.get("part", ""), op)
        own = {op.name: _stop_alone(g, n, op, vetoed, cands, uses) for op in firsts.values()}
        stops.update({k: v for k, v in own.items() if v is not None})
        warnings.warn(replicated_warning(g, n, in_block_ops, stops), stacklevel=2)
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
