"""The collective table: what each placement change means, in one place.

One `Collective` per kind of `comm.<name>` op: the placement transition it implements, the
function of runtime/program/comm.py that runs it, the kind its backward runs (its dual), the payload
bytes per rank that `nncompile show` reports, the alpha-beta ring cost the autodist cost model
prices, the weight the greedy policies rank it by, its process group and its gloo fallback.
insert_comm, runtime/program/comm.py, the cost model, comm_stats and the greedy policies read this
table, so a new collective is one new entry.

    name            transition     backward        payload/rank  ring cost    gloo runs
    all_reduce      P -> R         identity        full          2 (g-1)/g B
    chunk           R -> S(d)      all_gather      0 (local)
    all_gather      S(d) -> R      chunk [1]       full          (g-1)/g B
    reduce_scatter  P -> S(d)      all_gather      full          (g-1)/g B    all_reduce + chunk
    all_to_all      S(i) -> S(j)   all_to_all      local         (g-1)/g B/g  all_gather + chunk
    to_partial      R -> P         identity        0 (local)     (rank 0 keeps the value)
    sync_grad       R -> R [2]     all_reduce      0             (Megatron's `f`)
    identity        -              identity        0             (a dual only: runs nothing)

A pair with no entry goes through Replicate: S(d) -> P is all_gather, then to_partial.
[1] all_gather with reduce_grad=True reduce-scatters its gradient instead (it absorbs sync_grad).
[2] Inserted only when a replicated value's users leave partial gradients (see insert_comm).
`comm.cross_entropy_rows` is a loss's local implementation (rules/nn_ops.py), not a placement
change; it has no entry and moves only a scalar count.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterator

from nncompile.ir import PLAN_GROUP, Partial, Placement, Replicate, Shard, StridedShard, Symbol

PlacementType = type


def _no_kwargs(src: Placement, dst: Placement) -> dict:
    return {}


def _dst_dim(src: Placement, dst: Placement) -> dict:
    return {"dim": dst.dim}


def _src_dim(src: Placement, dst: Placement) -> dict:
    return {"dim": src.dim}


def _both_dims(src: Placement, dst: Placement) -> dict:
    return {"src_dim": src.dim, "dst_dim": dst.dim}


def _full(full: int, local: int, n: int) -> int:
    return full


def _local(full: int, local: int, n: int) -> int:
    return local


def _nothing(full: int, local: int, n: int) -> int:
    return 0


@dataclass(frozen=True)
class Collective:
    """One kind of comm op. Bytes: `full` is the whole tensor's, `local` this rank's piece of
    the input; `g` is the group size."""
    name: str                                   # the IR target is comm.<name>
    forward: str | None                         # its function in runtime/program/comm.py; None: none
    dual: str                                   # the kind its backward runs
    transitions: tuple[tuple[PlacementType, PlacementType], ...] = ()   # (src, dst) types
    kwargs: Callable[[Placement, Placement], dict] = _no_kwargs   # what insert_comm passes
    payload: Callable[[int, int, int], int] = _nothing   # bytes per rank (full, local, n)
    ring_rounds: int = 0                        # latency terms: ring_rounds * (g-1) * alpha
    ring_bytes: Callable[[float, int], float] | None = None   # bytes sent per rank (B, g)
    greedy_weight: float = 0.0                  # volume in full tensors, as greedy ranks it
    group: str = "plan"     # the mesh axis it runs on ("plan": any of TENSOR_AXES, each on its group)
    gloo_fallback: tuple[str, ...] = ()         # the kinds runtime/program/comm.py runs on gloo
    reduce_grad_dual: str | None = None         # dual with reduce_grad=True (absorbs sync_grad)
    syncs_grad: bool = False                    # its backward sums the gradient over the group

    @property
    def is_local(self) -> bool:
        """Moves no data between ranks."""
        return self.ring_bytes is None

    def backward_kind(self, reduce_grad: bool = False) -> str:
        return self.reduce_grad_dual if reduce_grad and self.reduce_grad_dual else self.dual


# Axes that split tensors the way the plan axis does: the plan's collectives run on each, on
# the axis's own process group (PLAN_GROUP, CP_GROUP, EP_GROUP). An entry whose `group` names another
# axis runs on that axis only.
TENSOR_AXES = ("plan", "cp", "ep")


def runs_on(c: Collective, axis: str) -> bool:
    """Entry `c` may run along mesh axis `axis`."""
    return c.group == axis or (c.group == "plan" and axis in TENSOR_AXES)


TABLE: dict[str, Collective] = {c.name: c for c in (
    Collective("all_reduce", "all_reduce", "identity", ((Partial, Replicate),),
               payload=_full, ring_rounds=2, ring_bytes=lambda b, g: 2 * (g - 1) / g * b,
               greedy_weight=2.0),
    Collective("chunk", "chunk", "all_gather", ((Replicate, Shard),), _dst_dim,
               greedy_weight=0.01),
    Collective("all_gather", "all_gather", "chunk", ((Shard, Replicate),), _src_dim,
               payload=_full, ring_rounds=1, ring_bytes=lambda b, g: (g - 1) / g * b,
               greedy_weight=1.0, reduce_grad_dual="reduce_scatter"),
    Collective("reduce_scatter", "reduce_scatter", "all_gather", ((Partial, Shard),), _dst_dim,
               payload=_full, ring_rounds=1, ring_bytes=lambda b, g: (g - 1) / g * b,
               greedy_weight=1.0, gloo_fallback=("all_reduce", "chunk")),
    Collective("all_to_all", "all_to_all", "all_to_all", ((Shard, Shard),), _both_dims,
               payload=_local, ring_rounds=1, ring_bytes=lambda b, g: (g - 1) / g * b / g,
               greedy_weight=1.0, gloo_fallback=("all_gather", "chunk")),
    Collective("to_partial", "to_partial", "identity", ((Replicate, Partial),),
               greedy_weight=0.01),
    Collective("sync_grad", "sync_grad", "all_reduce", ((Replicate, Replicate),),
               syncs_grad=True),
    Collective("identity", None, "identity"),
)}


def by_name(kind: str) -> Collective:
    """The entry for `kind` ('all_gather')."""
    if kind not in TABLE:
        raise ValueError(f"unknown collective {kind!r}; known: {', '.join(TABLE)}")
    return TABLE[kind]


def lookup(kind: str) -> Collective | None:
    """The entry for `kind`, None when the table has none."""
    return TABLE.get(kind)


def of_target(target: str) -> Collective | None:
    """The entry an op target 'comm.<kind>' runs; None for any other target."""
    return TABLE.get(target[len("comm."):]) if target.startswith("comm.") else None


def transition(src: Placement | PlacementType, dst: Placement | PlacementType,
               axis: str = "plan") -> Collective | None:
    """The one collective along mesh axis `axis` that turns placement (type) `src` into
    `dst`, if any; of several, the one registered last."""
    # a strided split moves the bytes a plain one does (insert_comm runs it on an unmerged view)
    pair = tuple(Shard if isinstance(p, Shard) or p is StridedShard else
                 p if isinstance(p, type) else type(p) for p in (src, dst))
    for c in reversed(TABLE.values()):
        if pair in c.transitions and not c.syncs_grad and runs_on(c, axis):
            return c
    return None


def grad_sync_collective(axis: str = "plan") -> Collective:
    """The collective whose backward sums a replicated value's partial gradients over
    `axis`."""
    return next(c for c in reversed(TABLE.values()) if c.syncs_grad and runs_on(c, axis))


def route(src: Placement, dst: Placement | None, axis: str = "plan"
          ) -> list[tuple[Collective, Placement, Placement]]:
    """[(collective, from, to)] turning `src` into `dst` along mesh axis `axis`: none when
    they agree, one entry when the table has the transition, else two through Replicate()."""
    if dst is None or src == dst:
        return []
    c = transition(src, dst, axis)
    if c is not None:
        return [(c, src, dst)]
    first, second = transition(src, Replicate, axis), transition(Replicate, dst, axis)
    if first is None or second is None:
        raise ValueError(f"no collective along mesh axis {axis!r} turns {src!r} into "
                         f"{dst!r}; add an entry to nncompile/collectives.py's TABLE")
    return [(first, src, Replicate()), (second, Replicate(), dst)]


def group_symbol(axis: str):
    """The name generated code gives the process group along mesh axis `axis`: PLAN_GROUP
    for "plan", `<AXIS>_GROUP` for any other (the runtime binds it)."""
    return PLAN_GROUP if axis == "plan" else Symbol(f"{axis.upper()}_GROUP")


def axis_of(op) -> str:
    """The mesh axis a comm op runs along, read from its group (`group=CP_GROUP`: "cp");
    "plan" for PLAN_GROUP or no group."""
    group = str(op.kwargs.get("group", "PLAN_GROUP"))
    return "plan" if group == "PLAN_GROUP" or not group.endswith("_GROUP") \
        else group[:-len("_GROUP")].lower()


@contextlib.contextmanager
def registered(*entries: Collective) -> Iterator[None]:
    """Add (or replace) entries for the duration of a block, e.g. in a test."""
    saved = dict(TABLE)
    TABLE.update({c.name: c for c in entries})
    try:
        yield
    finally:
        TABLE.clear()
        TABLE.update(saved)
