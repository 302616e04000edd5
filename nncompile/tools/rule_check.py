"""Check op rules numerically, the way DTensor checks its sharding strategies.

For every rule in `nncompile.rules.RULES` and every split strategy it offers at n = 2 and 4:

    sample      PyTorch's OpInfo samples (op_db) where the op has an entry, plus hand-written
                ones (nncompile/tools/rule_samples.py) whose dims divide by 2 and 4
    trace       fn(*sample) with nncompile's own frontend: the op as the rules see it
    split       each input as the strategy says: S(d) chunks, S(d|o) chunks of each of the o
                blocks of dim d, R copies, P random pieces that sum to the input
    run         the op on each simulated rank's pieces (threads over the threaded process group,
                so ops whose local form communicates, e.g. comm.cross_entropy_rows, run too),
                localized like generated code (passes/localize.py: size arguments, local ops)
    combine     outputs by their placement (S cat, P sum, R each rank whole) and compare with
                the unsplit op; then backward with one upstream gradient: S inputs' gradients
                cat, R inputs' gradients sum (partial), P inputs' gradients whole on each rank;
                complex tensors (a rotary's view_as_complex) get complex upstream gradients
                and compare as (real, imaginary) pairs

    report = check_rules()          # or check_rules(["linear", "softmax"])
    print(report)                   # ops x strategies checked, and every failure
"""
from __future__ import annotations

import copy
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from ..custom_ops import REGISTRY, is_custom_op
from ..ir import Op, Partial, Replicate, Shard, Strategy, Value, join_pieces, piece_of
from ..ir.interpret import run_graph
from ..rules import RULES, draws_random, strategies, strided_splits

NS = (2, 4)
RTOL, ATOL = 1e-7, 1e-9                       # float64 samples: reordering errors ~1e-15


@dataclass
class Case:
    rule: str
    origin: str                    # 'opinfo:<name>' or 'hand'
    op: Op
    values: list[torch.Tensor]     # one per op.tensor_inputs(), full


@dataclass
class RuleReport:
    checked: dict[str, set] = field(default_factory=dict)    # rule -> {(n, strategy note)}
    cases: int = 0
    strategies_checked: int = 0
    failures: list[str] = field(default_factory=list)
    unchecked: list[str] = field(default_factory=list)       # rules with no split checked

    @property
    def ok(self) -> bool:
        return not self.failures and not self.unchecked

    def __str__(self) -> str:
        lines = [f"op-rule check: {len(self.checked)} rules, {self.cases} traced samples, "
                 f"{self.strategies_checked} (sample x strategy x n) runs: "
                 f"{'OK' if self.ok else 'FAILED'}"]
        lines += [f"  FAIL {f}" for f in self.failures[:50]]
        if self.unchecked:
            lines.append(f"  no split strategy checked for: {', '.join(self.unchecked)}")
        return "\n".join(lines)


def rule_key(op: Op) -> str | None:
    """The RULES key that `op` is looked up under (see rules/registry.lookup)."""
    t = op.target
    name = getattr(t, "_opname", None)
    if name is None or isinstance(t, str):
        return None
    if getattr(t, "namespace", "aten") != "aten":
        key = f"{t.namespace}::{name}"
        return key if key in RULES else None
    overload = f"{name}.{t._overloadname}"
    return overload if overload in RULES else name if name in RULES else None


# ---- samples ------------------------------------------------------------------------------

def _opinfo_index() -> dict[str, list]:
    try:
        from torch.testing._internal.common_methods_invocations import op_db
    except Exception:          # noqa: BLE001 - no OpInfo database: hand samples only
        return {}
    index: dict[str, list] = {}
    for info in op_db:
        for key in {info.aten_name, info.name, info.name.split(".")[-1]}:
            if key:
                index.setdefault(key, []).append(info)
    return index


def _opinfo_samples(infos: list, limit: int) -> list[tuple[str, Callable, tuple, dict]]:
    out = []
    for info in infos:
        dtype = torch.float64 if torch.float64 in info.dtypes else torch.float32
        if dtype not in info.dtypes:
            continue
        try:
            for s in info.sample_inputs("cpu", dtype, requires_grad=False):
                if s.input is not None and isinstance(s.input, torch.Tensor):
                    out.append((f"opinfo:{info.name}", info.op, (s.input, *s.args), s.kwargs))
                if len(out) >= limit:
                    return out
        except Exception:      # noqa: BLE001 - a sample generator this torch can't run
            continue
    return out


class _Call(torch.nn.Module):
    """fn(*args, **kwargs) with the tensors as forward inputs, everything else baked in."""

    def __init__(self, fn: Callable, args: tuple, kwargs: dict):
        super().__init__()
        self.fn, self.spec = fn, pytree.tree_flatten((args, kwargs))
        self.slots = [i for i, x in enumerate(self.spec[0]) if isinstance(x, torch.Tensor)]

    def tensors(self) -> tuple:
        return tuple(self.spec[0][i] for i in self.slots)

    def forward(self, *tensors):
        leaves = list(self.spec[0])
        for i, t in zip(self.slots, tensors):
            leaves[i] = t
        args, kwargs = pytree.tree_unflatten(leaves, self.spec[1])
        return self.fn(*args, **kwargs)


def _trace_cases(rule: str, origin: str, fn: Callable, args: tuple, kwargs: dict) -> list[Case]:
    from ..frontend import trace
    call = _Call(fn, args, kwargs)
    tensors = call.tensors()
    if not tensors or any(t.numel() == 0 for t in tensors):
        return []
    try:
        graph = trace(call, tensors)
        env: dict[str, Any] = {}
        run_graph(graph, {}, list(tensors), record=env)
    except Exception:          # noqa: BLE001 - a sample our frontend or the op refuses
        return []
    out = []
    for op in graph.ops:
        if rule_key(op) == rule and not draws_random(op):
            vals = [env.get(v.name) for v in op.tensor_inputs()]
            if all(isinstance(x, torch.Tensor) for x in vals):
                out.append(Case(rule, origin, op, [x.detach() for x in vals]))
    return out


def collect_cases(rules: list[str] | None = None, opinfo_limit: int = 4, seed: int = 0,
                  extra: dict[str, list[tuple[Callable, tuple]]] | None = None) -> list[Case]:
    """Traced cases for `rules` (default: every built-in rule). `extra` adds samples
    `{rule: [(fn, args), ...]}`, e.g. for a custom op's rule ('nncompile::my_op')."""
    from .rule_samples import samples
    names = list(rules) if rules else [r for r in sorted(RULES) if "::" not in r]
    index = _opinfo_index() if any("::" not in r for r in names) else {}
    cases = []
    for rule in names:
        g = torch.Generator().manual_seed(seed + zlib.crc32(rule.encode()))
        base = rule.split(".")[0]
        calls = [("hand", fn, args, {}) for fn, args in samples(rule, g)]
        calls += [("given", fn, args, {}) for fn, args in (extra or {}).get(rule, [])]
        calls += _opinfo_samples(index.get(base, []), opinfo_limit)
        for origin, fn, args, kwargs in calls:
            cases += _trace_cases(rule, origin, fn, args, kwargs)
    return cases


# ---- running one strategy on simulated ranks -----------------------------------------------

def _pieces(x: torch.Tensor, p, n: int, g: torch.Generator) -> list[torch.Tensor]:
    if isinstance(p, Shard):                    # a strided split S(d|o) too
        return [piece_of(x, p, r, n).clone() for r in range(n)]
    if isinstance(p, Partial) and _differentiable(x):
        parts = [torch.randn(x.shape, generator=g, dtype=x.dtype) for _ in range(n - 1)]
        return parts + [x - sum(parts)]
    return [x.clone() for _ in range(n)]


def _upstream(op: Op, seed: int) -> list[torch.Tensor | None]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(v.meta.shape, generator=g, dtype=v.meta.dtype)
            if v.is_tensor and (v.meta.dtype.is_floating_point or v.meta.dtype.is_complex)
            else None for v in op.outputs]


def _differentiable(x: torch.Tensor) -> bool:
    return x.is_floating_point() or x.is_complex()


def _call(op: Op, local: bool, tensors: list[torch.Tensor]):
    """Run `op` (its localized form when `local`) with its tensor inputs replaced in order."""
    it = iter(tensors)
    target = op.target
    args, kwargs = _substitute(op, it)
    if isinstance(target, str):                      # a local implementation: comm.<name>
        from nncompile.runtime.program import comm
        target = getattr(comm, target.split(".", 1)[1])
        kwargs = {**kwargs, "group": dist.group.WORLD}
    elif is_custom_op(target):
        target = REGISTRY[target._opname].impl
    if not local and target is torch.ops.aten.view.default:
        target = torch.ops.aten.reshape.default
    out = target(*args, **kwargs)
    return list(out) if op.multi_output else [out]


def _substitute(op: Op, it) -> tuple[tuple, dict]:
    from ..ir.printer import Symbol

    def sub(x):
        if isinstance(x, Value):
            return next(it) if x.is_tensor else None
        if isinstance(x, Symbol) or isinstance(x, torch.device):
            return torch.device("cpu")
        return x
    args = tuple(_map(sub, a) for a in op.args)
    kwargs = {k: _map(sub, v) for k, v in op.kwargs.items() if k != "group"}
    return args, kwargs


def _map(fn, x):
    if isinstance(x, (list, tuple)) and not isinstance(x, Value):
        return type(x)(_map(fn, e) for e in x)
    return fn(x)


def _localized(op: Op, s: Strategy, n: int) -> Op:
    from nncompile.passes.localize import localize_op
    local = copy.copy(op)
    local.outputs = [copy.copy(v) for v in op.outputs]
    for v, p in zip(local.outputs, s.outputs):
        v.placement = p if v.is_tensor else Replicate()
    local.strategy = s
    localize_op(local, n)
    return local


def _run_rank(case: Case, s: Strategy, n: int, rank: int, seed: int):
    """This rank's outputs and input gradients for one (case, strategy)."""
    g = torch.Generator().manual_seed(seed)
    pieces = [_pieces(x, p, n, g)[rank] for x, p in zip(case.values, s.inputs)]
    ups = [u if u is None else _local_grad(u, p, n, rank)
           for u, p in zip(_upstream(case.op, seed + 1), s.outputs)]
    return _forward_backward(_localized(case.op, s, n), True, pieces, ups)


def _local_grad(u: torch.Tensor, p, n: int, rank: int) -> torch.Tensor:
    return piece_of(u, p, rank, n) if isinstance(p, Shard) else u


def _reference(case: Case, seed: int):
    return _forward_backward(case.op, False, [x.clone() for x in case.values],
                             _upstream(case.op, seed + 1))


_NO_GRAD_ARGS = {"running_mean", "running_var"}     # batch norm's running statistics


def _no_grad_inputs(op: Op) -> set[int]:
    """Positions (among op.tensor_inputs()) of inputs autograd gives no gradient to."""
    schema = getattr(op.target, "_schema", None)
    if schema is None or any(isinstance(a, (list, tuple)) for a in op.args):
        return set()
    names = [a.name for a in schema.arguments]
    tensors = [(names[k] if k < len(names) else None) for k, a in enumerate(op.args)
               if isinstance(a, Value) and a.is_tensor]
    return {i for i, name in enumerate(tensors) if name in _NO_GRAD_ARGS}


def _forward_backward(op: Op, local: bool, inputs: list[torch.Tensor], ups: list):
    """(outputs, input gradients) of `op` with upstream gradients `ups` (None: no gradient)."""
    fixed = _no_grad_inputs(op)
    leaves = [x.requires_grad_(_differentiable(x) and i not in fixed)
              for i, x in enumerate(inputs)]
    outs = _call(op, local, leaves)
    pairs = [(o, u) for o, u in zip(outs, ups)
             if u is not None and isinstance(o, torch.Tensor) and o.requires_grad]
    grads = [None] * len(leaves)
    if pairs:
        wrt = [x for x in leaves if x.requires_grad]
        got = iter(torch.autograd.grad([o for o, _ in pairs], wrt, [u for _, u in pairs],
                                       allow_unused=True))
        grads = [next(got) if x.requires_grad else None for x in leaves]
    grads = [torch.zeros_like(x) if gr is None and x.requires_grad else gr
             for x, gr in zip(leaves, grads)]
    return [o.detach() if isinstance(o, torch.Tensor) else o for o in outs], grads


def _close(a: torch.Tensor, b: torch.Tensor) -> str | None:
    if a.shape != b.shape:
        return f"shape {list(a.shape)} != {list(b.shape)}"
    if a.is_complex() and b.is_complex():          # compared as (real, imaginary) pairs
        a, b = torch.view_as_real(a.resolve_conj()), torch.view_as_real(b.resolve_conj())
    if not b.is_floating_point():
        return None if torch.equal(a, b) else "values differ"
    if b.numel() == 0:
        return None
    err = float((a.double() - b.double()).abs().max())
    scale = float(b.double().abs().max())
    tol = ATOL * max(1.0, scale) + RTOL * scale * 10
    return None if err <= tol and err == err else f"max abs error {err:.3e} (scale {scale:.3e})"


def _compare_outputs(case, s, n, ranks, ref) -> str | None:
    for i, (p, want) in enumerate(zip(s.outputs, ref[0])):
        if not isinstance(want, torch.Tensor) \
                or case.rule.split(".")[0] in ("empty_like", "new_empty"):
            continue
        pieces = [r[0][i] for r in ranks]
        if isinstance(p, Shard):
            why = _close(join_pieces(pieces, p), want)
        elif isinstance(p, Partial):
            why = _close(torch.stack(pieces).sum(0), want)
        else:
            why = next((w for w in (_close(x, want) for x in pieces) if w), None)
        if why:
            return f"output {i} ({p!r}): {why}"
    return None


def _compare_grads(case, s, n, ranks, ref) -> str | None:
    for i, (p, want) in enumerate(zip(s.inputs, ref[1])):
        if want is None or p is None:
            continue
        pieces = [r[1][i] for r in ranks]
        if any(x is None for x in pieces):
            continue
        if any(x.shape != pieces[0].shape for x in pieces):
            return f"input {i} gradient: shapes differ across ranks"
        if isinstance(p, Shard):
            why = _close(join_pieces(pieces, p), want)
        elif isinstance(p, Partial):
            why = next((w for w in (_close(x, want) for x in pieces) if w), None)
        else:                                        # replicated input: partial gradients
            why = _close(torch.stack(pieces).sum(0), want)
        if why:
            return f"gradient of input {i} ({p!r}): {why}"
    return None


def check_rules(rules: list[str] | None = None, ns: tuple[int, ...] = NS,
                opinfo_limit: int = 4, cases: list[Case] | None = None,
                samples: dict[str, list[tuple[Callable, tuple]]] | None = None,
                strided: bool = True) -> RuleReport:
    """Check every split strategy of `rules` (default: every built-in rule) at each n in
    `ns`; `samples` adds calls per rule, e.g. `{"nncompile::my_linear": [(my_linear, (x, w))]}`
    for a rule given to register_op. `strided`: the strided splits (S(d|o)) too."""
    from .simulate import run_ranks
    cases = collect_cases(rules, opinfo_limit, extra=samples) if cases is None else cases
    report = RuleReport(cases=len(cases))
    for rule in {c.rule for c in cases} | set(rules or [r for r in RULES if "::" not in r]):
        report.checked.setdefault(rule, set())
    for n in ns:
        work = []
        for k, c in enumerate(cases):
            try:
                with strided_splits(strided):
                    offered = strategies(c.op, n)
            except Exception as e:      # noqa: BLE001 - a rule that crashes is a failure
                report.failures.append(f"{c.rule} n={n} ({c.origin}, {_shapes(c)}): the rule "
                                       f"raised {type(e).__name__}: {e}")
                continue
            work += [(c, s, 1000 * k + j) for j, s in enumerate(offered) if s.is_split]
        if not work:
            continue

        def rank_fn(rank: int, work=work, n=n):
            out = []
            for c, s, seed in work:
                try:
                    out.append(_run_rank(c, s, n, rank, seed))
                except Exception as e:   # noqa: BLE001 - reported as a failure
                    out.append(e)
            return out

        results = run_ranks(n, rank_fn)
        for k, (c, s, seed) in enumerate(work):
            report.strategies_checked += 1
            per_rank = [r[k] for r in results]
            where = f"{c.rule} [{s.note}] n={n} ({c.origin}, {_shapes(c)})"
            err = next((e for e in per_rank if isinstance(e, Exception)), None)
            if err is not None:
                report.failures.append(f"{where}: raised {type(err).__name__}: {err}"[:400])
                continue
            ref = _reference(c, seed)
            why = _compare_outputs(c, s, n, per_rank, ref) or \
                _compare_grads(c, s, n, per_rank, ref)
            if why:
                report.failures.append(f"{where}: {why}")
            report.checked[c.rule].add((n, s.note))
    report.unchecked = sorted(r for r, seen in report.checked.items() if not seen)
    return report


def _shapes(c: Case) -> str:
    return ", ".join(str(list(x.shape)) for x in c.values)


__all__ = ["check_rules", "collect_cases", "RuleReport", "Case", "rule_key"]
