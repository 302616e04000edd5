"""Contraction ops (linear, addmm, mm, bmm, matmul) from einsum-like annotations.

    "* k+, n k+, =n -> * n"     linear(x, weight, bias)

Operands are separated by commas, dims by spaces. `*` stands for the leading dims an operand
has beyond its named ones; `k+` is a contracted dim (splitting it leaves partial sums); `d^`
is never split (e.g. the dim a softmax normalizes); an operand marked `=` is added to the
result, so when a contracted dim is split it must be Partial (one rank holds it, the others
hold zeros). Custom ops (nncompile.register_op) use the same annotations.
"""
from __future__ import annotations

from ..ir import Op, P, Partial, Replicate, Shard, Strategy, StridedShard, Value
from .registry import divisible, make, outers, register


def _labels(spec: str, rank: int) -> list[str]:
    names = spec.split()
    star_count = rank - (len(names) - 1)
    out: list[str] = []
    for name in names:
        if name == "*":
            out += [f"*{i}" for i in range(star_count)]
        else:
            out.append(name.rstrip("+^"))
    # an operand with fewer dims than named (e.g. a 1-D bias) keeps its trailing names
    return out[len(out) - rank:] if len(out) > rank else out


def einsum_strategies(op: Op, operands: list, spec: str, n: int) -> list[Strategy]:
    """Strategies splitting each label of `spec` over `operands` (Values or None)."""
    lhs, rhs = spec.split("->")
    specs = [s.strip() for s in lhs.split(",")]
    out_v = op.outputs[0]
    out_rank = len(out_v.meta.shape)
    contracted = {x.rstrip("+") for s in specs for x in s.split() if x.endswith("+")}
    frozen = {x.rstrip("^") for s in specs + [rhs] for x in s.split() if x.endswith("^")}
    additive = [s.startswith("=") for s in specs]
    labels = []
    for s, v in zip(specs, operands):
        if v is None or not isinstance(v, Value):
            labels.append(None)
            continue
        labels.append(_labels(s.lstrip("="), len(v.meta.shape)))
    out_labels = _labels(rhs, out_rank)
    strategies = []
    for label in dict.fromkeys(out_labels + sorted(contracted)):
        if label in frozen:
            continue
        places = {}
        ok = True
        for v, labs, add in zip(operands, labels, additive):
            if labs is None:
                continue
            if label in labs:
                d = labs.index(label)
                if not divisible(v, d, n):
                    ok = False
                    break
                places[v] = Shard(d)
            elif label in contracted and add:
                places[v] = P
            else:
                places[v] = Replicate()
        if not ok:
            continue
        if label in out_labels:
            d = out_labels.index(label)
            if not divisible(out_v, d, n):
                continue
            output = Shard(d)
        else:
            output = Partial()
        strategies.append(make(op, places, [output], f"split {label}"))
        strategies += _strided(op, places, output, label, n)
    return strategies


def _strided(op: Op, places: dict, output, label: str, n: int) -> list[Strategy]:
    """A label kept in the output with the same size in every operand that has it (bmm's
    `b`, linear's leading dims) also takes a strided split (heads inside a merged
    batch-and-heads dim): the op maps it element by element."""
    if not isinstance(output, Shard) or any(isinstance(p, Partial) for p in places.values()):
        return []
    size = op.outputs[0].meta.shape[output.dim]
    split = {v: p for v, p in places.items() if isinstance(p, Shard)}
    if any(v.meta.shape[p.dim] != size for v, p in split.items()):
        return []
    return [make(op, {**places, **{v: StridedShard(p.dim, k) for v, p in split.items()}},
                 [StridedShard(output.dim, k)], f"split {label} strided")
            for k in outers(size, n)]


@register("linear")
def linear(op: Op, n: int):
    x, w, *rest = op.args
    b = rest[0] if rest else None
    found = einsum_strategies(op, [x, w, b], "* k+, n k+, =n -> * n", n)
    if op.float8:       # float8 casts need whole values: no partial-sum x or w
        found = [s for s in found if not any(isinstance(p, Partial) for p in s.inputs[:2])]
    return found


@register("addmm")
def addmm(op: Op, n: int):
    bias, x, w = op.args[:3]
    if op.kwargs.get("beta", 1) != 1 or op.kwargs.get("alpha", 1) != 1:
        return []
    return einsum_strategies(op, [bias, x, w], "=m n, m k+, k+ n -> m n", n)


@register("mm")
def mm(op: Op, n: int):
    return einsum_strategies(op, list(op.args[:2]), "m k+, k+ n -> m n", n)


@register("bmm")
def bmm(op: Op, n: int):
    return einsum_strategies(op, list(op.args[:2]), "b m k+, b k+ n -> b m n", n)


@register("matmul")
def matmul(op: Op, n: int):
    a, b = op.args[:2]
    if len(a.meta.shape) >= 2 and len(b.meta.shape) == 2:       # x @ w.T: leading dims batch
        return einsum_strategies(op, [a, b], "* m k+, k+ n -> * m n", n)
    if len(a.meta.shape) < 2 or len(a.meta.shape) != len(b.meta.shape):
        return []
    if a.meta.shape[:-2] != b.meta.shape[:-2]:
        return []
    return einsum_strategies(op, [a, b], "* m k+, * k+ n -> * m n", n)


@register("einsum")
def einsum(op: Op, n: int):
    """torch.einsum("...k,nk->...n", x, w): the equation read as this file's annotation (a
    label absent from the output is contracted). Equations this cannot say (a label twice in
    one operand, `...` not leading or broadcast to more dims) get no split."""
    equation, operands = op.args[0], op.args[1]
    if "->" not in equation or not all(isinstance(v, Value) for v in operands):
        return []
    lhs, rhs = equation.replace(" ", "").split("->")
    terms = lhs.split(",")
    if len(terms) != len(operands):
        return []
    out_rank = len(op.outputs[0].meta.shape)
    ellipsis = out_rank - len(rhs.replace("...", "")) if "..." in rhs else 0
    letters = [t.replace("...", "") for t in terms + [rhs]]
    if any(len(set(t)) != len(t) for t in letters):
        return []
    for t, v in zip(terms + [rhs], list(operands) + [op.outputs[0]]):
        if "..." in t and (not t.startswith("...") or len(v.meta.shape) - len(t) + 3
                           != ellipsis):
            return []
    contracted = {c for t in letters[:-1] for c in t if c not in rhs}

    def spec(term: str) -> str:
        names = ["*"] if term.startswith("...") else []
        return " ".join(names + [c + ("+" if c in contracted else "")
                                 for c in term.replace("...", "")])

    annotation = ", ".join(spec(t) for t in terms) + " -> " + spec(rhs)
    return einsum_strategies(op, list(operands), annotation, n)

