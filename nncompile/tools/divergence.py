"""Find the first op whose parallel result diverges from the single-device one.

Every value of a generated forward is a local variable named like its IR value, so capturing
`forward_impl`'s locals (and those of its recompute closures) on each rank gives every shard of
every intermediate. The reference is the traced graph run on full tensors (`run_graph`). For a
value placed S(d) the shards of a plan unit are concatenated on d, for P they are summed, for R
every rank must hold the full value; then it is compared with the reference. Gradients of the
same values are caught with tensor hooks and compared the same way (a replicated or partial
value's gradient may be full on every rank or a partial sum over the unit; both are right).

    forward: the first op (in program order) whose output diverges
    backward: the last op whose output's gradient diverges (backward runs in reverse), i.e.
              the ops reading that value have a wrong backward
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..ir import Graph, Partial, Replicate, Shard, Value, join_pieces
from ..ir.interpret import run_graph
from ..mesh import DP, Mesh

# intermediate values: generous enough for float32 reordering, far below real plan bugs
VALUE_RTOL, VALUE_ATOL = 1e-4, 1e-5
# ops whose output holds uninitialized memory until later ops fill it: nothing to compare
_UNDEFINED = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}


@dataclass
class Divergence:
    """Where a parallel run first differs from one device."""
    phase: str              # "forward" or "backward"
    value: str              # IR value name
    op: str                 # the op producing it (its target)
    rank: int               # the first rank whose piece is wrong
    placement: str
    max_error: float
    ref_max: float
    source: str             # the user's file:line and code, when known
    readers: list[str]      # backward: the ops reading the value

    def __str__(self) -> str:
        where = f" at {self.source}" if self.source else ""
        text = (f"first divergence in {self.phase}: value %{self.value} = {self.op}"
                f"{where}\n    rank {self.rank}, placement {self.placement}: max abs error "
                f"{self.max_error:.3e} (reference max {self.ref_max:.3e})")
        if self.phase == "backward":
            text += (f"\n    its gradient is wrong: the backward of "
                     f"{', '.join(self.readers) or 'its readers'} is unsound")
        return text


class Capture:
    """Records the tensor locals of every generated-code frame of `path` run while active,
    line by line (the generated code deletes each value after its last use, so a frame's
    locals at its return are not all of them)."""

    def __init__(self, path: str):
        self.path = path
        self.values: dict[str, Any] = {}
        self.grads: dict[str, torch.Tensor] = {}

    def _trace(self, frame, event, arg):
        return self._local if frame.f_code.co_filename == self.path else None

    def _local(self, frame, event, arg):
        if event in ("line", "return"):
            for k, x in frame.f_locals.items():
                if isinstance(x, torch.Tensor) and k not in self.values:
                    self.values[k] = x
        return self._local

    def __enter__(self):
        self._old = sys.gettrace()
        sys.settrace(self._trace)
        return self

    def __exit__(self, *exc):
        sys.settrace(self._old)

    def watch_grads(self) -> None:
        """Hook every captured value that takes part in autograd (call before backward)."""
        for name, x in self.values.items():
            if x.requires_grad:
                x.register_hook(_store(self.grads, name))


def _store(into: dict, name: str) -> Callable:
    def hook(g):
        into[name] = g.detach().clone()
    return hook


def reference_run(graph: Graph, module: torch.nn.Module, inputs: list[Any],
                  loss_of: Callable) -> tuple[Capture, torch.Tensor]:
    """The traced graph on full tensors, recording every value and its gradient."""
    cap = Capture("<reference>")
    state = {}
    for fqn, t in list(module.named_parameters(remove_duplicate=False)) + \
            list(module.named_buffers(remove_duplicate=False)):
        state[fqn] = t.detach().clone().requires_grad_(t.requires_grad)
    env: dict[str, Any] = {}
    outs = run_graph(graph, state, inputs, record=env)
    cap.values = {k: x for k, x in env.items() if isinstance(x, torch.Tensor)}
    cap.watch_grads()
    loss = loss_of(outs)
    if loss.requires_grad:
        loss.backward()
    return cap, loss


def _unit_value(pieces: list, placement) -> Any:
    """A plan unit's pieces of one value, combined: S(d) cat, P sum, R the first piece."""
    if isinstance(placement, Shard):
        return join_pieces(pieces, placement)          # a strided split interleaves them
    if isinstance(placement, Partial):
        return torch.stack(pieces).sum(0)
    return pieces[0]


def _error(a: torch.Tensor, ref: torch.Tensor) -> float | None:
    """Max abs error, or None when within tolerance (exact for non-float)."""
    if a.shape != ref.shape:
        return float("inf")
    if not (ref.is_floating_point() or ref.is_complex()):
        return None if torch.equal(a, ref) else float((a.detach().double() - ref.double()).abs().max())
    if ref.numel() == 0:
        return None
    wide = torch.complex128 if ref.is_complex() else torch.float64     # complex: |difference|
    got, want = a.detach().to(wide), ref.detach().to(wide)
    same = (got == want) | (torch.isnan(got) & torch.isnan(want))   # equal infinities too
    diff = (got - want).abs()
    err = float(torch.where(same, torch.zeros((), dtype=diff.dtype), diff).max())
    finite = want[torch.isfinite(want)]          # a masked score's -inf sets no scale
    bound = VALUE_ATOL + VALUE_RTOL * (float(finite.abs().max()) if finite.numel() else 0.0)
    return None if err <= bound and err == err else err


def _unzigzag(pieces: list, placement) -> torch.Tensor:
    """The whole tensor from pieces in the zigzag order (piece r: chunks r and 2n-1-r; of
    each outer block under a strided split)."""
    d = placement.dim % pieces[0].dim()
    outer = getattr(placement, "outer", 1)
    if outer > 1:
        pieces = [p.unflatten(d, (outer, -1)) for p in pieces]
        d += 1
    n = len(pieces)
    order = [None] * (2 * n)
    for r, p in enumerate(pieces):
        order[r], order[2 * n - 1 - r] = p.chunk(2, dim=d)
    whole = torch.cat(order, dim=d)
    return whole.flatten(d - 1, d) if outer > 1 else whole


def _check_axes(pieces_by_rank: dict[int, Any], ref: torch.Tensor, v, mesh: Mesh,
                grad: bool, zigzag: tuple = ()) -> tuple[int, float] | None:
    """_check for a mesh with axes beyond dp and plan (cp): each unit's pieces combined along
    plan, then along each other axis, innermost first (S joined, P summed, R the first piece;
    a gradient of a value whole along an axis may also be a partial sum there)."""
    inner = [a for a in mesh.names if a not in (DP,)]
    units: dict[int, list[int]] = {}
    for r in sorted(pieces_by_rank):
        units.setdefault(mesh.unit_of(r), []).append(r)
    for unit, ranks in units.items():
        errs = []
        for summed in ((False, True) if grad else (False,)):
            level = {tuple(mesh.coords(r)[a] for a in inner): pieces_by_rank[r] for r in ranks}
            for depth in range(len(inner), 0, -1):
                axis = inner[depth - 1]
                p = v.placement_on(axis)
                if grad and isinstance(p, Partial):
                    p = Replicate()          # a partial sum's gradient is whole on every rank
                groups: dict[tuple, list] = {}
                for key in sorted(level):
                    groups.setdefault(key[:depth - 1], []).append(level[key])
                level = {k: (torch.stack(ps).sum(0) if summed and isinstance(p, Replicate)
                             else _unzigzag(ps, p) if axis in zigzag and isinstance(p, Shard)
                             else _unit_value(ps, p)) for k, ps in groups.items()}
            errs.append(_error(level[()], ref))
        if all(e is not None for e in errs):
            return ranks[0], errs[0]
    return None


def _check(pieces_by_rank: dict[int, Any], ref: torch.Tensor, placement, mesh: Mesh,
           grad: bool) -> tuple[int, float] | None:
    """(rank, error) of the first wrong plan unit's piece, or None."""
    units: dict[int, list[int]] = {}
    for r in sorted(pieces_by_rank):
        units.setdefault(mesh.unit_of(r), []).append(r)
    for unit, ranks in units.items():
        pieces = [pieces_by_rank[r] for r in ranks]
        if grad and not isinstance(placement, Shard):
            # full on every rank, or a partial sum over the unit: either is a right gradient
            errs = [_error(p, ref) for p in pieces]
            if all(e is None for e in errs) or _error(torch.stack(pieces).sum(0), ref) is None:
                continue
            bad = next((i for i, e in enumerate(errs) if e is not None), 0)
            return ranks[bad], errs[bad] if errs[bad] is not None else 0.0
        if not grad and not isinstance(placement, (Shard, Partial)):
            for r, p in zip(ranks, pieces):
                e = _error(p, ref)
                if e is not None:
                    return r, e
            continue
        e = _error(_unit_value(pieces, placement), ref)
        if e is not None:
            return ranks[0], e
    return None


def first_divergence(graph: Graph, ref: Capture, ranks: list[Capture]) -> Divergence | None:
    """Compare every op output of the final (localized) `graph` with the reference."""
    mesh = Mesh.of(graph.plan_ngpus, len(ranks), 1, graph.axes)   # a Capture per rank
    zigzag = graph.plan_state.zigzag_axes
    check = (lambda pieces, ref, v, grad: _check_axes(pieces, ref, v, mesh, grad, zigzag)) \
        if graph.axes else (lambda pieces, ref, v, grad: _check(pieces, ref, v.placement, mesh,
                                                               grad))
    users: dict[str, list[str]] = {}
    for op in graph.ops:
        if op.is_structural:            # lowering markers read values but compute nothing
            continue
        for v in op.inputs():
            users.setdefault(v.name, []).append(op.target_name)
    # an uninitialized tensor, and a slice of one written into (`z = x.new_empty(...);
    # z[..., :d].copy_(y)`): the part not yet written holds whatever memory held
    undefined: set[str] = set()
    for op in graph.ops:
        name = getattr(op.target, "_opname", "")
        base = op.args[0] if op.args else None
        if name in _UNDEFINED or name == "slice_scatter" and isinstance(base, Value) \
                and base.name in undefined:
            undefined |= {v.name for v in op.outputs}
    order: list[Value] = [v for op in graph.ops if not op.target_name.startswith("comm.")
                          and not any(o.name in undefined for o in op.outputs)
                          for v in op.outputs if v.is_tensor and v.name in ref.values]

    def make(phase, v, hit):
        op = v.producer
        src = f"{op.source.file}:{op.source.line}  {op.source.code}" if op.source else ""
        readers = [t for t in users.get(v.name, [])]
        refx = (ref.grads if phase == "backward" else ref.values)[v.name]
        return Divergence(phase, v.name, op.target_name, hit[0], repr(v.placement), hit[1],
                          float(refx.detach().abs().max()) if refx.is_floating_point() and refx.numel()
                          else 0.0, src, sorted(set(readers)))

    for v in order:
        pieces = {r: c.values.get(v.name) for r, c in enumerate(ranks)}
        if any(p is None for p in pieces.values()):
            continue
        hit = check(pieces, ref.values[v.name], v, False)
        if hit:
            return make("forward", v, hit)
    for v in reversed(order):
        want = ref.grads.get(v.name)
        if want is None:
            continue
        pieces = {r: c.grads.get(v.name) for r, c in enumerate(ranks)}
        pieces = {r: (p if p is not None else torch.zeros_like(ranks[r].values[v.name]))
                  for r, p in pieces.items() if v.name in ranks[r].values}
        if len(pieces) != len(ranks):
            continue
        hit = check(pieces, want, v, True)
        if hit:
            return make("backward", v, hit)
    return None
