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
without communication (the embedding, a tied or untied lm_head feeding the loss, a fused qkv
weight whose rows interleave heads, heads not divisible by the plan), the column splits it
came from are vetoed and the walk runs again, until every region closes. Linears of the layer
blocks left replicated are named in one warning, a line per layer kind with the reason found
(where the split stopped; head counts only where they do not divide).

A low-rank down-projection normed before its up-projection (DeepSeek's MLA: q_a_proj ->
q_a_layernorm -> q_b_proj) runs replicated, so the up-projection starts the column split, and a
replicated activation broadcast into the heads (`expand` of MLA's shared rotary key) enters the
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
        self.entries: set[str] = set()              # expands that start a split
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

    def _free_ok(self, v: Value, want) -> bool:
        placed = self.free.get(id(v))
        if isinstance(want, Partial):
            return not isinstance(placed, Shard)        # to_partial of a replicated value
        if placed is None:
            if id(v) in self.views and isinstance(want, Shard) \
                    and self._view_chain(v, want) is None:
                return False
            return isinstance(want, Replicate) or self.uses[id(v)] == 1 or not v.requires_grad
        if placed == want:
            return True
        return isinstance(placed, Replicate) and isinstance(want, Shard) \
            and not v.requires_grad                     # a local chunk, no backward traffic

    def _weight_split(self, op: Op, s: Strategy) -> bool:
        return any((v.kind == PARAM or id(v) in self.views) and len(v.meta.shape) >= 2
                   and isinstance(p, Shard) for v, p in zip(op.tensor_inputs(), s.inputs))

    # ---- choices ---------------------------------------------------------------------------
    def column(self, op: Op) -> Strategy | None:
        """A split of a weight on its output dim, every activation input replicated."""
        if op.name in self.vetoed:
            return None
        for s in self.cands[id(op)]:
            if len(s.outputs) != 1 or not isinstance(s.outputs[0], Shard) \
                    or not self._weight_split(op, s):
                continue
            if all(self._free_ok(v, p) if self.is_free(v) else isinstance(p, Replicate)
                   for v, p in zip(op.tensor_inputs(), s.inputs)):
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

    def record(self, op: Op, s: Strategy, prov: frozenset) -> None:
        self.choice[id(op)] = s
        for v, want in zip(op.tensor_inputs(), s.inputs):
            if self.is_free(v) and id(v) not in self.free:
                self.free[id(v)] = want if isinstance(want, Shard) else Replicate()
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
                    # the split cannot close here: undo its source, a broadcast entry last
                    prov = frozenset(p for p in prov if p not in self.entries) or prov
                    self.failed |= prov
                    for name in prov:
                        self.stopped_at.setdefault(name, op)
            else:
                s = self.column(op) or self.entry(op)
                if s is not None:
                    prov = frozenset([op.name])
            self.record(op, s or replicated(op), prov)
        nupd = len(self.g.trace_info.buffer_updates)     # new buffer values: into their shards
        for v in self.g.outputs[:len(self.g.outputs) - nupd]:
            if isinstance(v, Value) and isinstance(self.place.get(id(v)), Shard):
                self.failed |= self.prov.get(id(v), frozenset())
        return self.failed


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


def _kind(path: str) -> str:
    """`transformer.h.3.attn.c_attn` -> `attn.c_attn`: the same layer in every block."""
    layer = layer_of(path)
    return path[len(layer) + 1:] if layer and path.startswith(layer + ".") else path


def _head_counts(g: Graph, layer: str) -> list[int]:
    """Head counts in `layer`: the heads dim of reshapes `[b, t, C] -> [b, t, H, ...]` and of
    attention's q, k and v."""
    attention, reshapes = [], []
    for op in g.ops:
        if layer_of(op.module_path) != layer or not op.outputs or not op.outputs[0].is_tensor:
            continue
        name = getattr(op.target, "_opname", None)
        ins, out = op.tensor_inputs(), op.outputs[0].meta.shape
        if name == "scaled_dot_product_attention":
            attention += [v.meta.shape[-3] for v in ins[:3] if len(v.meta.shape) >= 3]
        elif name in ("view", "reshape", "_unsafe_view") and ins:
            shape = ins[0].meta.shape
            if len(shape) == 3 and len(out) >= 4 and tuple(out[:2]) == tuple(shape[:2]) \
                    and _numel(out[2:]) == shape[2]:
                reshapes.append(out[2])
    return attention or reshapes


def _numel(shape) -> int:
    total = 1
    for d in shape:
        total *= d
    return total


def _fed_by(col: Op, stop: Op, replicated_linears: dict[int, int]) -> list[Op]:
    """The replicated linears of `col`'s block that its input comes from, when its column
    split stopped where it meets the residual stream (`stop` adds a replicated activation):
    such a linear closes a region as a row split, once the linears before it split."""
    if getattr(stop.target, "_opname", None) not in ("add", "sub"):
        return []
    stream = {id(v) for v in stop.tensor_inputs() if v.requires_grad and v.kind not in FREE_KINDS
              and len(v.meta.shape) == len(stop.outputs[0].meta.shape)}
    layer, found, seen = layer_of(col.module_path), [], set()
    todo = [v for v in col.tensor_inputs() if v.kind not in FREE_KINDS]
    while todo:
        v = todo.pop()
        op = v.producer
        if id(v) in stream or op is None or id(op) in seen or layer_of(op.module_path) != layer:
            continue
        seen.add(id(op))
        if id(op) in replicated_linears:
            found.append(op)
            continue
        todo += [u for u in op.tensor_inputs() if u.kind not in FREE_KINDS]
    return sorted(found, key=lambda op: replicated_linears[id(op)])


def _why(g: Graph, n: int, col: Op, stop: Op | None, replicated_linears: dict[int, int]
         ) -> str:
    """Why the column split of `col` was undone: the reason actually found."""
    if stop is None:
        return "its split reaches the model's output still split"
    src = f" ({stop.source})" if stop.source else ""
    where = f"{stop.target_name} in {stop.module_path or 'the model'}{src}"
    feeds = _fed_by(col, stop, replicated_linears)
    if feeds:
        names = ", ".join(dict.fromkeys(_kind(op.module_path or op.name) for op in feeds))
        return (f"its input comes from {names}, which run replicated (a row split needs it "
                f"split); as a column split its output would meet the residual stream at "
                f"{where}")
    shapes = [v.meta.shape for v in stop.tensor_inputs() + stop.outputs if v.is_tensor]
    layer = layer_of(col.module_path)
    heads = sorted(set(_head_counts(g, layer)), reverse=True) if layer else []
    if any(len(sh) >= 4 for sh in shapes) and any(h % n for h in heads):
        return (f"heads not divisible by {n} ({' / '.join(map(str, heads))} heads in "
                f"{layer}); its split stopped at {where}")
    return f"its split stopped at {where}: no rule takes its inputs split as they arrive"


def _stop_alone(g: Graph, n: int, col: Op, vetoed: set[str], cands, uses) -> Op | None:
    """Where the column split of `col` stops with every other veto kept: its own reason, not
    that of a split it was undone with."""
    walk = _Walk(g, n, vetoed - {col.name}, cands, uses)
    walk.run()
    return walk.stopped_at.get(col.name)


def _replicated_warning(g: Graph, n: int, ops: list[Op], stops: dict[str, Op]) -> str:
    """One line per layer kind (`attn.c_attn` of every block), in graph order, with the
    reason found for its first block (`stops`: where each one's split stopped)."""
    kinds: dict[str, list[Op]] = {}
    for op in ops:
        kinds.setdefault(_kind(op.module_path or op.name), []).append(op)
    lines = []
    for kind, members in kinds.items():
        blocks = [layer_of(op.module_path) or op.name for op in members]
        shown = ", ".join(blocks[:3]) + (f", ... ({len(blocks)} blocks)" if len(blocks) > 3
                                         else "")
        first = next((op for op in members if op.name in stops), members[0])
        why = _why(g, n, first, stops.get(first.name), {id(op): i for i, op in enumerate(ops)})
        lines.append(f"  {kind} ({shown}): {why}.")
    text = "\n".join(lines)
    hint = ""
    if "heads not divisible" in text:
        hint = (" A single key/value head cannot be split by any plan size."
                if " / 1 heads in " in text or "(1 heads in " in text else
                " Pick a plan size that divides the head counts to split them.")
    convs = sum("conv" in op.target_name for op in ops)
    what = ("convolution(s)" if convs == len(ops) else "linear(s)" if not convs
            else "linear(s) and convolution(s)")
    return (f"tp at plan {n}: {len(ops)} {what} in the layer blocks run replicated, "
            f"because splitting them would need extra communication:\n{text}{hint}")


def split_share(graph: Graph) -> float:
    """Share of the layer blocks' weight elements (parameters of 2 or more dims inside
    numbered blocks, `h.3.attn.c_attn.weight`) that a planned graph splits: 1.0 for a full
    Megatron plan, 0.0 when every block runs replicated."""
    total = split = 0
    for v in graph.params:
        if len(v.meta.shape) < 2 or layer_of(v.fqn or "") is None:
            continue
        total += _numel(v.meta.shape)
        if isinstance(v.placement, Shard):
            split += _numel(v.meta.shape)
    return split / total if total else 0.0


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
    n = g.plan_ngpus = config.plan_ngpus
    if n == 1:
        return g
    cands = {id(op): strategies(op, n) for op in g.ops}
    uses: dict[int, int] = {}
    for op in g.ops:
        for v in op.tensor_inputs():
            uses[id(v)] = uses.get(id(v), 0) + 1
    low_rank = _low_rank_downs(g)               # stay replicated, as Megatron keeps them
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
    in_block_ops = [op for op in g.ops
                    if op.name in vetoed and layer_of(op.module_path) is not None
                    and not is_entry(op) and op.name not in low_rank
                    and not walk._weight_split(op, walk.choice[id(op)])]
    if in_block_ops:
        firsts = {}
        for op in in_block_ops:
            firsts.setdefault(_kind(op.module_path or op.name), op)
        own = {op.name: _stop_alone(g, n, op, vetoed, cands, uses) for op in firsts.values()}
        stops.update({k: v for k, v in own.items() if v is not None})
        warnings.warn(_replicated_warning(g, n, in_block_ops, stops), stacklevel=2)
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
