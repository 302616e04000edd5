"""unfuse_projections: a fused projection whose output is only ever cut into pieces (q, k, v;
gate, up) becomes one projection per piece, each over its own *part* of the fused parameter,
so a plan places every part on its own (q, k and v split by heads, gate and up by columns).

Before:                                              After:
    # w: param 'attn.c_attn.weight' f32[96, 32]          # w_0: param 'attn.c_attn.weight[0/3]'
    y = aten.linear.default(x, w, b)  # [B, T, 96]       #   part of w, rows 0:32 (k, v likewise)
    q, k, v = aten.split.Tensor(y, 32, 2)                q = aten.linear.default(x, w_0, b_0)
                                                         k = aten.linear.default(x, w_1, b_1)
                                                         v = aten.linear.default(x, w_2, b_2)

A part is an ordinary PARAM Value with `Value.part` set (nncompile.ir.ParamPart: the source
parameter viewed as `view`, a box of it): the runtime reads and writes it inside the original
parameter, so checkpoints and the module keep the original layout and FQN.

Recognised projections (the spellings the planner splits as linears): `linear(x, w, b)`,
`addmm(b, x, w)` with a Conv1D `[in, out]` weight or `w.t()`, `x @ w.T` (+ `b`) and
`einsum("btd,ed->bte", x, w)`. Between the
output and its pieces: reshapes that split the features into groups (`view(B, T, H, 3 * d)`,
Falcon's `(groups, per-group, d)`) or change the batch dims, transposes and permutes; the
pieces: `split`, `split_with_sizes`, `chunk`, `unbind`, `slice`, `select` and indexing with a
constant run of indices (`qkv[..., [-2], :]`), nested splits included (q | kv, then k | v).
Each piece's projection is reshaped and permuted back to the piece's shape.

Preconditions: plan_ngpus > 1 (UnfuseProjections; a single-device plan keeps its one GEMM);
runs after fuse_attention, before the plan. The weight and bias feed only the projection;
every use of its output reaches a piece; the pieces are disjoint and cover the output;
else the projection stays fused. Idempotent: yes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from nncompile.ir import PARAM, Graph, Op, ParamPart, TensorMeta, Value, map_nested
from nncompile.ir.graph import _values_into
from nncompile.symbolic import keep_symbols

from .contract import contract
from .dce import dce
from .fuse_attention import _evaluate

aten = torch.ops.aten
_SAME = {"alias", "clone", "contiguous"}
_RESHAPES = {"view", "reshape", "_unsafe_view", "unsqueeze", "squeeze", "flatten", "unflatten"}
_SPLITS = {"split", "split_with_sizes", "chunk", "unbind"}
_WEIGHT_T = {"t", "numpy_T", "permute", "transpose"}
UNFUSED = "unfused"          # op.attrs key: which part of which fused parameter a projection reads
PART = "part"                # op.attrs key on each op of a part's projection: "[i/k]"
PART_OF = "part_of"          # ... and the fused parameter's FQN


@dataclass
class _Linear:
    """A projection: `ops` from the weight to the output `y` ([*B, O]), the weight `w` (its
    output dim `wdim`) and the bias `b`."""
    ops: list[Op]
    w: Value
    wdim: int
    b: Value | None
    y: Value


@dataclass(frozen=True)
class _Track:
    """What a value reached from a projection's output is: batch dims `bshape`, the output
    features viewed as `view`, the `box` of it the value holds, and per dim of the value
    ('b', i) for batch dim i or ('f', j) for view dim j (view dims not listed were selected
    away by an index). `sel`: made by a selection (a piece)."""
    bshape: tuple[int, ...]
    view: tuple[int, ...]
    box: tuple[tuple[int, int], ...]
    dims: tuple[tuple[str, int], ...]
    sel: bool = False

    def present(self) -> list[int]:
        return sorted(j for k, j in self.dims if k == "f")

    def natural(self) -> tuple[tuple[str, int], ...]:
        return tuple(("b", i) for i in range(len(self.bshape))) + tuple(
            ("f", j) for j in self.present())

    def fshape(self) -> tuple[int, ...]:
        return tuple(self.box[j][1] - self.box[j][0] for j in self.present())

    def full(self) -> bool:
        return len(self.present()) == len(self.view) and all(
            (a, b) == (0, s) for (a, b), s in zip(self.box, self.view))

    def narrow(self, dim: int, start: int, stop: int, keep: bool = True) -> "_Track | None":
        kind, j = self.dims[dim]
        if kind != "f":
            return None
        a = self.box[j][0]
        box = self.box[:j] + ((a + start, a + stop),) + self.box[j + 1:]
        dims = self.dims if keep else self.dims[:dim] + self.dims[dim + 1:]
        return replace(self, box=box, dims=dims, sel=True)


@contract()
def unfuse_projections(graph: Graph) -> Graph:
    """The pass (any plan size; UnfuseProjections runs it only when plan_ngpus > 1)."""
    users = graph.users()
    uses = {id(v): len(us) for v, us in users.items()}
    outputs = {id(v) for v in graph.outputs if isinstance(v, Value)}
    found = []
    for op in graph.ops:
        lin = _linear(op, users, uses)
        if lin is None:
            continue
        leaves = _pieces(graph, lin, users, outputs)
        if leaves is not None:
            found.append((lin, leaves))
    if not found:
        return graph
    g = graph.clone()
    vmap = {v.name: v for v in g.values()}
    omap = {id(old): new for old, new in zip(graph.ops, g.ops)}
    for lin, leaves in found:
        lin = _Linear([omap[id(o)] for o in lin.ops], vmap[lin.w.name], lin.wdim,
                      vmap[lin.b.name] if lin.b is not None else None, vmap[lin.y.name])
        _rewrite(g, lin, [(vmap[v.name], t) for v, t in leaves])
    return dce(g)


class UnfuseProjections:
    """unfuse_projections for a plan of `plan_ngpus` ranks: only a split plan (> 1) cuts a
    fused projection into parts; one device keeps its single GEMM."""
    name = "unfuse_projections"
    requires = produces = ()
    quiet_when_unchanged = True      # run_pipeline lists it only when it cut a projection

    def __init__(self, plan_ngpus: int = 1):
        self.plan_ngpus = plan_ngpus

    def __call__(self, graph: Graph) -> Graph:
        return unfuse_projections(graph) if self.plan_ngpus > 1 else graph


# ---- finding projections -------------------------------------------------------------------
def _name(op: Op) -> str | None:
    return getattr(op.target, "_opname", None)


def _param(v, ndim: int, uses) -> bool:
    return isinstance(v, Value) and v.kind == PARAM and v.part is None and v.meta is not None \
        and len(v.meta.shape) == ndim and uses.get(id(v)) == 1


def _weight(v, uses) -> tuple[Value, int, list[Op]] | None:
    """(parameter, its output dim, layout ops) for the right operand of `x @ w`: a Conv1D
    `[in, out]` parameter, or `w.T` of an `[out, in]` one."""
    if _param(v, 2, uses):
        return v, 1, []
    op = v.producer if isinstance(v, Value) else None
    if op is None or _name(op) not in _WEIGHT_T or uses.get(id(v)) != 1:
        return None
    w = op.args[0]
    if not _param(w, 2, uses) or tuple(v.meta.shape) != tuple(w.meta.shape)[::-1]:
        return None
    return w, 0, [op]


def _einsum_out_dim(eq, uses, w) -> int | None:
    """The weight's output dim of `einsum("btd,ed->bte", x, w)`: its index that is the
    output's last and nowhere else; None for any other equation."""
    if not isinstance(eq, str) or "->" not in eq or not _param(w, 2, uses):
        return None
    ins, out = eq.replace(" ", "").split("->")
    xs, ws = (ins.split(",") + [""])[:2]
    if not out or len(ws) != 2 or "." in ws:
        return None
    e = out[-1]
    if ws.count(e) != 1 or e in xs or out.count(e) != 1:
        return None
    return ws.index(e)


def _linear(op: Op, users, uses) -> _Linear | None:
    name = _name(op)
    if not op.outputs or op.outputs[0].meta is None or op.kwargs or op.float8:
        return None         # a float8 linear's scale is its whole weight's: kept whole
    y = op.outputs[0]
    if name == "linear":
        x, w, *rest = op.args
        b = rest[0] if rest else None
        if not _param(w, 2, uses) or (b is not None and not _param(b, 1, uses)):
            return None
        lin = _Linear([op], w, 0, b, y)
    elif name == "addmm" and len(op.args) == 3:
        b, x, wt = op.args
        found = _weight(wt, uses)
        if found is None or not _param(b, 1, uses):
            return None
        lin = _Linear(found[2] + [op], found[0], found[1], b, y)
    elif name in ("matmul", "mm") and len(op.args) == 2:
        x = op.args[0]
        found = _weight(op.args[1], uses)
        if found is None:
            return None
        lin = _Linear(found[2] + [op], found[0], found[1], None, y)
        after = users.get(y, [])
        if len(after) == 1 and _name(after[0]) == "add" and not after[0].kwargs \
                and len(after[0].args) == 2 and y in after[0].args:
            b = after[0].args[1] if after[0].args[0] is y else after[0].args[0]
            if _param(b, 1, uses) and b.meta.shape[0] == y.meta.shape[-1]:
                lin.ops.append(after[0])
                lin.b, lin.y = b, after[0].outputs[0]
    elif name == "einsum" and len(op.args) == 2 and len(op.args[1]) == 2:
        x, w = op.args[1]
        wdim = _einsum_out_dim(op.args[0], uses, w)
        if wdim is None:
            return None
        lin = _Linear([op], w, wdim, None, y)
    else:
        return None
    if not isinstance(x, Value) or x.meta is None or len(lin.y.meta.shape) < 1 \
            or lin.y.meta.shape[-1] != lin.w.meta.shape[lin.wdim] \
            or (lin.b is not None and lin.b.meta.shape[0] != lin.y.meta.shape[-1]):
        return None
    return lin


# ---- following the output to its pieces -----------------------------------------------------
def _pieces(g: Graph, lin: _Linear, users, outputs) -> list[tuple[Value, _Track]] | None:
    """The pieces the projection's output is cut into, each with what it holds; None unless
    every use reaches a piece and the pieces are disjoint and cover the output."""
    shape = tuple(lin.y.meta.shape)
    start = _Track(shape[:-1], (shape[-1],), ((0, shape[-1]),),
                   tuple(("b", i) for i in range(len(shape) - 1)) + (("f", 0),))
    todo, leaves = [(lin.y, start)], []
    while todo:
        v, t = todo.pop()
        after = users.get(v, [])
        if t.sel and (id(v) in outputs or not after
                      or not all(_name(u) in _SPLITS and u.args[0] is v for u in after)):
            leaves.append((v, t))
            continue
        if id(v) in outputs or not after:
            return None
        for u in after:
            nxt = _step(g, u, v, t)
            if nxt is None:
                return None
            todo += nxt
    if len(leaves) < 2 or not _covers(leaves, shape[-1]):
        return None
    return sorted(leaves, key=lambda lt: _flat(lt[1])[0].item())


def _flat(t: _Track) -> torch.Tensor:
    box = tuple(slice(a, b) for a, b in t.box)
    return torch.arange(math.prod(t.view)).reshape(t.view)[box].flatten()


def _covers(leaves, size: int) -> bool:
    flat = torch.cat([_flat(t) for _, t in leaves]).sort().values
    return flat.numel() == size and bool((flat == torch.arange(size)).all())


def _step(g: Graph, op: Op, v: Value, t: _Track) -> list[tuple[Value, _Track]] | None:
    """What `op` makes of the tracked `v` (its first argument): [(output, track)], or None
    when it is not a layout change or a selection of the features."""
    name = _name(op)
    if not op.args or op.args[0] is not v or sum(x is v for x in op.inputs()) != 1 \
            or any(x.meta is None for x in op.outputs):
        return None
    outs = op.outputs
    nd = len(v.meta.shape)
    if name in _SAME and len(outs) == 1:
        return [(outs[0], t)]
    if name in _RESHAPES and len(outs) == 1:
        nt = _reshape(t, tuple(outs[0].meta.shape))
        return None if nt is None else [(outs[0], nt)]
    if name == "transpose" and len(op.args) == 3:
        d0, d1 = (d % nd for d in op.args[1:])
        dims = list(t.dims)
        dims[d0], dims[d1] = dims[d1], dims[d0]
        return [(outs[0], replace(t, dims=tuple(dims)))]
    if name == "permute" and len(op.args) == 2:
        return [(outs[0], replace(t, dims=tuple(t.dims[d % nd] for d in op.args[1])))]
    if name in _SPLITS:
        dim = (op.args[1] if name == "unbind" and len(op.args) > 1 else
               op.args[2] if len(op.args) > 2 else op.kwargs.get("dim", 0)) % nd
        got, start = [], 0
        for o in outs:
            size = 1 if name == "unbind" else o.meta.shape[dim]
            nt = t.narrow(dim, start, start + size, keep=name != "unbind")
            if nt is None:
                return None
            got.append((o, nt))
            start += size
        return got if start == v.meta.shape[dim] else None
    if name == "slice":
        dim, begin, end, step = (list(op.args[1:]) + [0, None, None, 1][len(op.args) - 1:])[:4]
        if step != 1:
            return None
        dim %= nd
        begin, end, _ = slice(begin, end).indices(v.meta.shape[dim])
        nt = t.narrow(dim, begin, max(begin, end))
        return None if nt is None else [(outs[0], nt)]
    if name == "select" and len(op.args) == 3:
        dim = op.args[1] % nd
        i = op.args[2] % v.meta.shape[dim]
        nt = t.narrow(dim, i, i + 1, keep=False)
        return None if nt is None else [(outs[0], nt)]
    if name == "index" and len(op.args) == 2:
        idx = [(d, x) for d, x in enumerate(op.args[1]) if x is not None]
        if len(idx) != 1 or not isinstance(idx[0][1], Value):
            return None
        dim, x = idx[0]
        run = _evaluate(g, x)
        if not isinstance(run, torch.Tensor) or run.dim() != 1 or run.dtype.is_floating_point \
                or run.numel() == 0:
            return None
        run = run.long() % v.meta.shape[dim]
        lo = int(run[0])
        if not bool((run == torch.arange(lo, lo + run.numel())).all()):
            return None
        nt = t.narrow(dim, lo, lo + run.numel())
        return None if nt is None else [(outs[0], nt)]
    return None


def _reshape(t: _Track, shape: tuple[int, ...]) -> _Track | None:
    """A reshape of a value whose dims are in order: of its batch dims only, or (while it holds
    the whole output) of its features into new groups."""
    if t.dims != t.natural():
        return None
    f = t.fshape()
    nb = len(shape) - len(f)
    if nb >= 0 and tuple(shape[nb:]) == f and math.prod(shape[:nb]) == math.prod(t.bshape):
        bshape = tuple(shape[:nb])
        return replace(t, bshape=bshape, dims=tuple(("b", i) for i in range(nb)) + tuple(
            ("f", j) for j in t.present()))
    k = len(t.bshape)
    if t.full() and tuple(shape[:k]) == t.bshape and math.prod(shape[k:]) == math.prod(f):
        view = tuple(shape[k:])
        return _Track(t.bshape, view, tuple((0, s) for s in view),
                      tuple(("b", i) for i in range(k)) + tuple(("f", j) for j in range(len(view))),
                      t.sel)
    return None


# ---- the rewrite ---------------------------------------------------------------------------
def _rewrite(g: Graph, lin: _Linear, leaves: list[tuple[Value, _Track]]) -> None:
    k = len(leaves)
    at = g.ops.index(lin.ops[-1])
    new_ops: list[Op] = []
    repl: dict[Value, Value] = {}
    parts: dict[Value, list[Value]] = {lin.w: [], **({lin.b: []} if lin.b is not None else {})}
    for i, (leaf, t) in enumerate(leaves):
        size = math.prod(b - a for a, b in t.box)
        sub = {}
        for p in parts:
            sub[p] = _part(g, p, lin.wdim if p is lin.w else 0, t, size, i, k)
            parts[p].append(sub[p])
        for op in lin.ops:                   # the projection over the parts
            new = _emit(g, op.target, _map(op.args, sub), _map(op.kwargs, sub), op,
                        f"{op.outputs[0].name}_{i}", op.outputs[0].meta.shape)
            sub[op.outputs[0]] = new.outputs[0]
            new.attrs[PART], new.attrs[PART_OF] = f"[{i}/{k}]", lin.w.fqn
            new_ops.append(new)
        new_ops[-1].attrs[UNFUSED] = (f"part {i} of {k} of {lin.w.fqn!r} (a fused projection, "
                                      f"one projection per piece)")
        out = sub[lin.y]
        shape = t.bshape + t.fshape()        # the piece's dims, in order
        like = leaf.producer
        if tuple(out.meta.shape) != shape:
            new = _emit(g, aten.view.default, (out, list(shape)), {}, like, f"{leaf.name}_view",
                        shape)
            new_ops.append(new)
            out = new.outputs[0]
        perm = [t.natural().index(d) for d in t.dims]
        if perm != list(range(len(perm))):
            new = _emit(g, aten.permute.default, (out, perm), {}, like, f"{leaf.name}_permute",
                        tuple(out.meta.shape[d] for d in perm))
            new_ops.append(new)
            out = new.outputs[0]
        repl[leaf] = out
    g.ops[at + 1:at + 1] = new_ops
    for op in g.ops:
        op.map_values(lambda v: repl.get(v, v))
    g.outputs = [repl.get(v, v) if isinstance(v, Value) else v for v in g.outputs]
    for src, ps in parts.items():
        j = g.params.index(src)
        g.params[j:j + 1] = ps


def _part(g: Graph, src: Value, wdim: int, t: _Track, size: int, i: int, k: int) -> Value:
    """Part i of k of parameter `src` (output dim `wdim`): the rows (or columns) of piece t."""
    sshape = tuple(src.meta.shape)
    nv = len(t.view)
    view = sshape[:wdim] + t.view + sshape[wdim + 1:]
    box = tuple((0, s) for s in sshape[:wdim]) + t.box + tuple((0, s) for s in sshape[wdim + 1:])
    groups = tuple((d,) for d in range(wdim)) + (tuple(range(wdim, wdim + nv)),) + tuple(
        (d + nv - 1,) for d in range(wdim + 1, len(sshape)))
    shape = sshape[:wdim] + (size,) + sshape[wdim + 1:]
    v = Value(g.fresh_name(f"{src.name}_{i}"), TensorMeta(shape, src.meta.dtype), PARAM,
              f"{src.fqn}[{i}/{k}]", src.requires_grad)
    v.part = ParamPart(src.fqn, sshape, view, box, groups)
    return v


def _map(obj, sub: dict):
    return map_nested(obj, lambda v: sub.get(v, v))


def _emit(g: Graph, target, args, kwargs, like: Op, base: str, sizes: tuple) -> Op:
    """A new op like `like` (source line, module), its output's meta found on the meta device;
    a dim equal to `sizes`' keeps that size, so a dynamic size (a Sym) stays one."""
    def meta(v: Value):
        return torch.empty(v.meta.shape, dtype=v.meta.dtype, device="meta")
    out = target(*map_nested(args, meta), **map_nested(kwargs, meta))
    ins = _values(args) + _values(kwargs)
    v = Value(g.fresh_name(base), TensorMeta(keep_symbols(tuple(out.shape), sizes), out.dtype),
              requires_grad=any(x.requires_grad for x in ins) and out.dtype.is_floating_point)
    op = Op(target, args, kwargs, [v], like.source, like.module_path)
    op.module_stack, op.recompute, op.stage = like.module_stack, like.recompute, like.stage
    return op


def _values(obj) -> list[Value]:
    out: list[Value] = []
    _values_into(obj if isinstance(obj, (list, tuple)) else obj.values(), out)
    return out


__all__ = ["unfuse_projections", "UnfuseProjections", "UNFUSED", "PART", "PART_OF"]
