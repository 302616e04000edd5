"""From a finished torch.profiler run to one rank's memory timeline by nncompile's categories
(nncompile.memory.profile calls `analyse`).

The bytes come from the allocations and frees the profiler traced, replayed per address
(`_replay`); the categories from PyTorch's memory profiler (torch.profiler._memory_profiler.
MemoryProfile), corrected by what nncompile knows: the live parameters and optimizer state by
address, the collectives and the generated forward by the Python frames around an allocation.

PyTorch's analysis rebuilds the data flow between ops and checks that the tensor versions it
infers are consistent; it refuses traces with torch.distributed's in-place collectives, whose
outputs an op it cannot follow writes. A trace with nncompile's collectives therefore runs the
same analysis with the checks relaxed (a new allocation starts at version 0, a mutation bumps
whatever version was seen, a deleted tensor read again starts over), which gives the strict
result wherever the strict one passes; a trace without runs the strict one first. If both fail,
allocations are still counted, by address and frames only.
"""
from __future__ import annotations

import importlib.util
import logging
import os
import sys
import warnings
from typing import Any, NamedTuple

import torch

from .memory import CATEGORIES, COMM_FILES, COMM_SCOPE, COPY_SCOPE, STEP_SCOPE, RankMemory

_FAILURES = (AttributeError, ImportError, TypeError, KeyError, AssertionError, ValueError)


def _resolve(filename: str, _cache: dict[str, str] = {}) -> str:
    """The absolute path of a profiler frame's file: torch shortens a file under a sys.path
    entry to the part below it."""
    path = _cache.get(filename)
    if path is None:
        path = os.path.normpath(os.path.abspath(filename))
        if not os.path.isabs(filename):
            found = (os.path.join(p or os.getcwd(), filename) for p in sys.path)
            path = os.path.normpath(next((f for f in found if os.path.isfile(f)), path))
        _cache[filename] = path
    return path


def comm_file(filename: str, _cache: dict[str, str] = {}) -> str:
    """The name ("comm.py", ...) if this Python file is one of nncompile/runtime's COMM_FILES
    (program/comm.py, program/reducer.py, store/zero.py; installed, or in a checkout), else
    ""."""
    hit = _cache.get(filename)
    if hit is None:
        path = _resolve(filename)
        folder, name = os.path.split(path)
        pkg = COMM_FILES.get(name)
        hit = name if pkg is not None and (
            folder == os.path.join(_runtime_dir(), pkg)
            or path.replace(os.sep, "/").endswith(f"runtime/{pkg}/{name}")) else ""
        _cache[filename] = hit
    return hit


def _runtime_dir() -> str:
    spec = importlib.util.find_spec("nncompile.runtime")
    return os.path.normpath(os.path.dirname(spec.origin)) if spec and spec.origin else ""


def context(event, forward_files: frozenset = frozenset()) -> tuple[bool, int | None, bool]:
    """(inside nncompile's collectives?, when the innermost runtime/program/comm.py function around it
    returned, inside the generated forward?). Inside the collectives: a Python frame of
    COMM_FILES or a record_function named "nncompile.comm*" encloses the event. comm.py's
    functions keep no state: a buffer they allocate and do not return is dead when they return
    (see _replay). The generated forward: a frame of one of `forward_files` (gencode{R}.py)."""
    from torch._C._profiler import _EventType
    e, comm, until, forward = event.parent, False, None, False
    while e is not None:
        kind = e.typed[0]
        name = ""
        if kind == _EventType.PyCall:
            path = e.typed[1].callsite.file_name
            name = comm_file(path)
            forward = forward or (bool(forward_files) and _resolve(path) in forward_files)
        if name == "comm.py" and until is None and not comm:
            until = e.end_time_ns
        comm = comm or bool(name) or (kind == _EventType.TorchOp and e.name.startswith(COMM_SCOPE))
        e = e.parent
    return comm, until, forward


def _walk(events):
    stack = list(reversed(events))
    while stack:
        e = stack.pop()
        yield e
        stack.extend(reversed(e.children))


def analyse(prof, device: torch.device, rank: int, tensors: dict, live: dict[int, str],
            max_points: int, forward_files=()) -> RankMemory:
    """Bytes per category over time on `device`. live: storage address -> category of the
    parameters and optimizer state alive after the run; forward_files: the files defining the
    module's forward (gencode{R}.py): what runs there allocates activations (see _replay)."""
    forward_files = frozenset(os.path.normpath(os.path.abspath(f)) for f in forward_files)
    from torch._C._profiler import _EventType
    tree = prof.profiler.kineto_results.experimental_event_tree()
    steps, raw, copies = [], [], []
    for e in _walk(tree):
        if e.typed[0] == _EventType.TorchOp and e.name.startswith(STEP_SCOPE):
            steps.append((e.start_time_ns, e.end_time_ns))
        elif e.typed[0] == _EventType.TorchOp and e.name.startswith(COPY_SCOPE):
            copies.append((e.start_time_ns, e.end_time_ns, e.name[len(COPY_SCOPE):]))
        elif e.typed[0] == _EventType.Allocation and e.typed[1].device == device \
                and e.typed[1].alloc_size != 0:
            a = e.typed[1]
            where = context(e, forward_files) if a.alloc_size > 0 else (False, None, False)
            raw.append(Alloc(e.start_time_ns, a.ptr, a.alloc_size, a.id, a.allocation_id,
                             *where))
    steps.sort()
    raw.sort(key=lambda r: r.t)
    log = logging.getLogger("torch.profiler._memory_profiler")
    level = log.level
    log.setLevel(logging.ERROR)            # not a warning per "Mismatch between allocation..."
    try:
        events, source = _torch_categories(prof, device, live, raw)
    finally:
        log.setLevel(level)
    if events is None:
        events = _replay(raw, [], lambda who, version: "other", live)
        source = "torch.profiler allocations (by address and frames only)"
    return _aggregate(events, steps, rank, str(device), tensors, max_points, source, copies)


class Alloc(NamedTuple):
    """One allocation (size > 0) or free (size < 0) the profiler traced."""
    t: int
    ptr: int
    size: int
    id: int | None              # the tensor id torch's memory profiler knows it by
    allocation_id: int | None
    comm: bool = False          # made inside nncompile's collectives
    until: int | None = None    # when the runtime/program/comm.py function that made it returned
    forward: bool = False       # made inside the generated forward


def _torch_categories(prof, device, live, raw):
    """(events, source) from torch's memory profile, or (None, "") when it fails."""
    from torch.profiler._memory_profiler import Action, Category, TensorKey
    builds = [prof._memory_profile, lambda: _relaxed_memory_profile(prof)]
    mp = error = None
    for build in builds[::-1] if any(r.comm for r in raw) else builds:
        try:
            mp = build()
            break
        except _FAILURES as e:
            error = e
    if mp is None:
        warnings.warn(f"PyTorch's memory profiler failed on this trace ({type(error).__name__}: "
                      f"{str(error)[:200]}); allocations are categorised by address and Python "
                      "frames only")
        return None, ""
    source = "torch.profiler memory profile" + (
        " (data-flow checks relaxed)" if getattr(mp, "_nncompile_relaxed", False) else "")
    known_state = "optimizer_state" in live.values()
    named = {Category.GRADIENT: "gradients", Category.OPTIMIZER_STATE: "optimizer_state",
             Category.ACTIVATION: "activations", Category.INPUT: "input"}

    def category(key, version) -> str:
        c = mp._categories.get(key, version) if isinstance(key, TensorKey) else None
        if c == Category.GRADIENT:
            return "gradients"
        if c == Category.OPTIMIZER_STATE and known_state:
            return "other"                # not what the optimizer holds: a temporary
        return named.get(c, "other")      # PARAMETER not in pm.parameters(): a temporary

    try:
        timeline = [e for e in mp.timeline if e[2][0].device == device]
        pre = [(key, nbytes) for t, action, (key, _), nbytes in timeline
               if action == Action.PREEXISTING and isinstance(key, TensorKey)]
        bumps = [(t, key, version) for t, action, (key, version), _ in timeline
                 if action == Action.INCREMENT_VERSION and isinstance(key, TensorKey)]
        key = lambda r: TensorKey._make(r.id, r.ptr, r.allocation_id, device)  # noqa: E731
        return _replay(raw, pre, category, live, bumps, key), source
    except _FAILURES as e:
        warnings.warn(f"PyTorch's memory timeline failed ({type(e).__name__}: {str(e)[:200]}); "
                      "allocations are categorised by address and Python frames only")
        return None, ""


def _relaxed_memory_profile(prof):
    """torch's MemoryProfile with its data-flow version checks relaxed (see the docstring)."""
    from torch.profiler import _memory_profiler as tmp

    class Graph(tmp.DataFlowGraph):
        def __init__(self, op_tree) -> None:           # as DataFlowGraph's, without validate()
            self._op_tree = op_tree
            self._leaf_events = self._extract_leaf_events(op_tree)
            self._active_version = {}
            self._flow_nodes = sorted((Node(e, self) for e in self._leaf_events),
                                      key=lambda n: n.start_time)

        def lookup(self, key):
            if self._active_version.get(key, 0) is None:   # read after its free was seen
                self._active_version[key] = 0
            return self._active_version.setdefault(key, 0)

        def bump(self, key) -> None:
            self._active_version[key] = (self._active_version.get(key) or 0) + 1

    class Node(tmp.DataFlowNode):
        def __init__(self, event, graph) -> None:
            self._event, self._graph = event, graph
            self._edges = self._determine_edges()
            for key, edge in self._edges.items():
                if edge.is_allocation:
                    graph._active_version[key] = 0
                elif edge.mutated:
                    graph.bump(key)

    mp = tmp.MemoryProfile.__new__(tmp.MemoryProfile)
    mp._op_tree = tmp.OpTree(prof.profiler.kineto_results)
    mp._data_flow_graph = Graph(mp._op_tree)
    mp._size_map = tmp.SizeMap(mp._op_tree)
    mp._categories = tmp.CategoryDict()
    mp._nncompile_relaxed = True
    for phase in ("_set_gradients_and_temporaries", "_set_parameters_using_python_tracer",
                  "_set_inputs", "_set_parameters_using_data_flow", "_set_activations",
                  "_set_optimizer_state", "_set_autograd_detail"):
        getattr(mp, phase)()
    return mp


def _replay(raw: list[Alloc], pre, category, live: dict[int, str], bumps=(), key=None
            ) -> list[tuple[int, str, int]]:
    """(time ns, category, +-bytes), replaying the traced allocations and frees per address.

    The profiler does not see frees made on threads it does not follow: a buffer handed to a
    torch.distributed collective is freed by the backend's worker thread when that thread
    drops the last reference. So an allocation at an address another allocation still holds
    ends that one, and a buffer made by runtime/program/comm.py whose free is not traced ends when the
    comm.py function that made it returns (its functions keep no state). pre: (tensor, bytes)
    that existed before profiling began; bumps: (time, tensor, version) when an in-place op
    made a new version of a tensor (its category may change); category(tensor, version) is
    torch's. Whatever holds an address of `live` at the end is what `live` says; anything else
    made inside nncompile's collectives is a communication buffer unless it holds a gradient;
    a tensor the generated forward makes is an activation unless torch tells it is a gradient or
    optimizer state (torch's own flood-fill of activations stops at the collectives, whose
    outputs it cannot follow); memory that is not a tensor's (a cuBLAS workspace) is not."""
    who = key or (lambda r: None)
    events: list[tuple] = [(-1, 0, "pre", k.storage.ptr, n, k) for k, n in pre if k.storage.ptr]
    last: dict[int, tuple] = {}                  # address -> (Alloc, who) whose free is pending
    for r in raw:
        if r.size < 0:
            last.pop(r.ptr, None)
            events.append((r.t, 3, "free", r.ptr, r.size, None))
            continue
        if r.ptr in last and last[r.ptr][0].until is not None:       # untraced free
            events.append((min(last[r.ptr][0].until, r.t), 3, "end", r.ptr, 0, last[r.ptr][1]))
        last[r.ptr] = (r, who(r) or (r.ptr, r.t))
        events.append((r.t, 1, "alloc", r.ptr, r.size, last[r.ptr][1]))
    events += [(r.until, 3, "end", ptr, 0, w) for ptr, (r, w) in last.items()
               if r.until is not None]
    comm = {who(r) or (r.ptr, r.t) for r in raw if r.comm}
    events += [(t, 2, "bump", k.storage.ptr, version, k) for t, k, version in bumps]
    events.sort(key=lambda e: (e[0], e[1]))
    holder: dict[int, Any] = {}                  # who holds each address at the end
    for e in events:
        if e[2] in ("pre", "alloc"):
            holder[e[3]] = e[5]
        elif e[2] == "free" or (e[2] == "end" and holder.get(e[3]) == e[5]):
            holder.pop(e[3], None)
    final = {w: live[ptr] for ptr, w in holder.items() if ptr and ptr in live}

    forward = {who(r) or (r.ptr, r.t) for r in raw if r.forward and r.id is not None}

    def kind(w, version: int) -> str:
        if w in final:
            return final[w]
        c = category(w, version)
        if w in comm and c != "gradients":
            return "communication_buffers"
        if w in forward and c in ("input", "other"):
            return "activations"          # made by the generated forward
        return "other" if c == "input" else c

    out: list[tuple[int, str, int]] = []
    alive: dict[int, list] = {}                 # address -> [category, bytes, who]
    for t, _, what, ptr, n, w in events:
        if what in ("pre", "alloc"):
            if ptr in alive:                    # its free was not traced
                cat, size, _ = alive.pop(ptr)
                out.append((t, cat, -size))
            alive[ptr] = [kind(w, 0), n, w]
            out.append((t, alive[ptr][0], n))
        elif ptr in alive and (what == "free" or alive[ptr][2] == w):
            if what == "bump":
                new = kind(w, n + 1)
                if new != alive[ptr][0]:
                    out += [(t, alive[ptr][0], -alive[ptr][1]), (t, new, alive[ptr][1])]
                    alive[ptr][0] = new
            else:                               # a free, or the end of a comm.py buffer
                cat, size, _ = alive.pop(ptr)
                out.append((t, cat, -size))
    return out


def _aggregate(events, steps, rank, device, tensors, max_points, source,
               copies=()) -> RankMemory:
    starts = [t for t, _, _ in events if t >= 0] + [s for s, _ in steps]
    t0 = min(starts) if starts else 0
    cur = dict.fromkeys(CATEGORIES, 0)
    times, points = [], []
    for t, cat, delta in events:
        t = max(t, t0)                    # -1: existed before profiling began
        if times and times[-1] != t:
            points.append(tuple(cur.values()))
        if not times or times[-1] != t:
            times.append(t)
        cur[cat] += delta
    if times:
        points.append(tuple(cur.values()))
    else:
        times, points = [t0], [tuple(cur.values())]
    totals = [sum(p) for p in points]
    peak = max(range(len(points)), key=totals.__getitem__)
    keep = _thin(totals, max_points)
    ms = [round((t - t0) / 1e6, 4) for t in times]
    return RankMemory(
        rank=rank, device=device, peak_bytes=int(totals[peak]), peak_ms=ms[peak],
        peak_event=peak,
        at_peak={c: int(points[peak][i]) for i, c in enumerate(CATEGORIES)},
        max_bytes={c: int(max(p[i] for p in points)) for i, c in enumerate(CATEGORIES)},
        tensors=tensors, times_ms=[ms[i] for i in keep], events=keep,
        bytes={c: [int(points[k][i]) for k in keep] for i, c in enumerate(CATEGORIES)},
        steps_ms=[[round((a - t0) / 1e6, 4), round((b - t0) / 1e6, 4)] for a, b in steps],
        copies_ms=[[round((a - t0) / 1e6, 4), round((b - t0) / 1e6, 4), name]
                   for a, b, name in sorted(copies) if b >= t0],
        source=source)


def _thin(totals: list[int], max_points: int) -> list[int]:
    """Indices of about max_points points: the lowest and highest total of each stretch (so
    every peak, the largest first of all, survives), in time order."""
    n = len(totals)
    if n <= max_points:
        return list(range(n))
    bins = max(1, max_points // 2)
    keep = {0, n - 1}
    for b in range(bins):
        idx = range(b * n // bins, (b + 1) * n // bins)
        if idx:
            keep.add(min(idx, key=totals.__getitem__))
            keep.add(max(idx, key=totals.__getitem__))
    return sorted(keep)
