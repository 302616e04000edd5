"""Ranks whose forwards communicate run each forward together; a forward one rank runs alone
(rank-0-only evaluation) is joined by the others.

Under a plan that splits the model over a unit (tp, context or expert parallelism) or gathers
ZeRO-3 weights, each forward is a sequence of collectives that every rank of the unit (or of the
ZeRO-3 group) must enter together. DDP scripts often evaluate on rank 0 alone (nanoGPT's
`if iter_num % eval_interval == 0 and master_process: losses = estimate_loss()`), which is
right under dp and ZeRO-1/2, whose forwards communicate nothing. Here rank 0's eval forward
would meet the other ranks' next training forward, mix their collectives and die in the
transport, or hang. Instead, before each forward the ranks exchange (forward count, training
mode, grad mode, what they are about to run, which module) over a CPU (gloo) group of the
ranks involved, a 40-byte all-gather with no device synchronisation:

    before: rank 0 eval forward gathers weights with rank 1's training forward
            -> "Connection reset by peer" (gloo), a hang (NCCL)
    after:  rank 1, waiting at its training forward, receives rank 0's inputs and runs rank
            0's forward with it (in rank 0's modes, its output dropped), as often as rank 0
            evaluates; then both run the training forward. DDP's script, unchanged, prints
            DDP's numbers.

One rank may run forwards alone this way: the rank without gradients while the others have
them (or in eval mode while they train). Anything else (two ranks evaluating alone, the same
modes but different counts is fine) raises one ConfigError on every rank that says which rank
ran what. `ComputeConfig(check_lockstep=False)` turns the exchange off.

Rank 0 may also evaluate after the last step while the others go on to another collective of
nncompile's (gather_params, save_checkpoint, save_pretrained) or leave. Those calls,
`nncompile.finish()` and the end of the program are wait points (`meet`): the waiting ranks
serve rank 0's forwards there as at a forward, and go on once every rank of the group reached
the same point. torch's `destroy_process_group()` is torch's own and waits for nothing: a
script whose rank 0 evaluates after the last step calls `nncompile.finish()` on every rank
before it. A rank that left without a wait point (a crash, a bare `destroy_process_group()`)
makes the exchange fail: a ConfigError on the ranks still there that names `finish()`, never
the transport's error.

    before: rank 0 evaluates; rank 1: dist.destroy_process_group()  -> rank 0: ConfigError
    after:  rank 0 evaluates; rank 1: nncompile.finish(); dist.destroy_process_group()
            -> rank 1 serves rank 0's forwards in finish(), then both destroy the group
"""
from __future__ import annotations

import atexit
import datetime
import os
import sys
import time
import weakref

import torch
import torch.distributed as dist

from nncompile.errors import ConfigError
from nncompile.mesh import DP, PP, replica_dims

from . import hang_report
from .groups import _CACHE, cpu_backend, default_timeout, forget_job, group_along, job_cache


def lockstep_group(pm):
    """The CPU group of the ranks that share pm's forward collectives: its plan unit (tp,
    context or expert parallelism) and, under ZeRO-3, the replicas it gathers weights with
    (None: no other rank, a pipeline, or the check is off). dp and ZeRO-1/2 forwards
    communicate nothing, so their replicas exchange nothing before a forward. One gloo group
    per set of ranks, whatever plan made it: modules of several plans over the same ranks (a
    ZeRO-3 model and a tp one) exchange on one group, so a rank waiting at the end for one of
    them serves a forward of the other."""
    return _group_along(pm, with_replicas=pm.memory.zero == 3, met=True)


def state_group(pm):
    """The CPU group of the ranks whose pieces make pm's optimizer state: the lockstep group,
    plus the data-parallel replicas under ZeRO-1/2 (which shard the optimizer state, not the
    forward). None where this rank holds it all."""
    return _group_along(pm, with_replicas=bool(pm.memory.zero), met=False)


def _group_along(pm, with_replicas: bool, met: bool):
    if not dist.is_initialized() or pm.PIPELINE is not None or \
            not pm.compute_config.check_lockstep:
        return None
    mesh = pm.mesh
    dims = tuple(n for n in mesh.names if n not in (DP, PP) and mesh.size(n) > 1)
    if with_replicas:
        dims += tuple(d for d in replica_dims(mesh) if mesh.size(d) > 1 and d not in dims)
    if not dims or group_along(dims, pm.PLAN_NGPUS, pm.RUNTIME_NGPUS, pm.PIPE_RANKS,
                               pm.mesh_axes) is None:
        return None
    sets = mesh.groups_along(tuple(dims)) if len(dims) < len(mesh.names) else \
        [list(range(dist.get_world_size()))]
    cache = _CACHE.setdefault(dist.distributed_c10d._get_default_group(), {})
    mine = next(tuple(sorted(r)) for r in sets if dist.get_rank() in r)
    for ranks in sorted(tuple(sorted(r)) for r in sets):    # every rank, in one order
        if ("lockstep", ranks) not in cache:
            cache[("lockstep", ranks)] = dist.new_group(list(ranks), backend=cpu_backend(),
                                                        timeout=default_timeout())
    group = cache[("lockstep", mine)]
    order = cache.setdefault("lockstep_order", [])
    if met and group not in order:              # the groups this rank meets at the end
        order.append(group)
    return group


def _mode(training: bool, grad: bool) -> str:
    return f"{'training' if training else 'eval'} mode {'with' if grad else 'without'} gradients"


FORWARD, SERVICE, MEET = 0, 1, 2   # what a rank is about to do: its forward, a service call,
                                   # or a collective every rank calls (a wait point)
POINTS = {"exit": "nncompile.finish() (or the end of the program)",
          "gather_params": "pm.gather_params()", "gather_grads": "pm.gather_grads()",
          "save_checkpoint": "nncompile.save_checkpoint", "save_pretrained":
          "nncompile.save_pretrained"}            # wait points; a MEET row's first field
ANY = -1                                          # a MEET row's module at the end: any
SERVICES: dict = {}             # name -> fn(pm, *args, leader): collective operations on pm


def service(name: str):
    """Register fn(pm, *args, leader) as an operation one rank may run alone (run_together)."""
    def register(fn):
        SERVICES[name] = fn
        return fn
    return register


# ---- the modules of this process and their groups ---------------------------------------------
# Modules with one mesh share one group, so a row names its module by load order (every rank
# loads the job's modules in one order); per default group, as a simulated rank has its own.
_MODULES = job_cache()          # default group -> ids
_LEADERS: dict = {}            # group -> the rank that last ran a forward alone on it


def _modules() -> dict:
    return _MODULES.setdefault(dist.distributed_c10d._get_default_group(),
                               {"next": 0, "by_id": weakref.WeakValueDictionary()})


def _group(pm):
    """pm's lockstep group (lockstep_group), made once; pm gets its number on the job's
    modules when it has this group or a state group."""
    group = pm.__dict__.get("_lockstep_group", False)
    if group is False:
        group = pm.__dict__["_lockstep_group"] = lockstep_group(pm)
        _number(pm, group)
    return group


def _state_group(pm):
    group = pm.__dict__.get("_state_group", False)
    if group is False:
        group = pm.__dict__["_state_group"] = state_group(pm)
        _number(pm, group)
    return group


def _number(pm, group) -> None:
    if group is not None and "_lockstep_id" not in pm.__dict__:
        known = _modules()
        pm.__dict__["_lockstep_id"] = known["next"]
        known["by_id"][known["next"]] = pm
        known["next"] += 1


def register(pm) -> None:
    """Make pm's lockstep and state groups at load (every rank loads it, and makes groups in
    one order), so that its ranks meet at the end of the program even if it never ran a
    forward."""
    _hold(pm, _group(pm))
    _state_group(pm)


def _hold(pm, group) -> None:
    if group is not None:
        # the module this rank last ran (or loaded) on the group, kept alive to serve a rank
        # still evaluating it at the end; per default group, freed with it
        _modules().setdefault("held", {})[group] = pm


def register_copy(pm) -> None:
    """A copy of a module (copy.deepcopy, AveragedModel) is a module of its own: a number of
    its own (every rank copies in one order), so a forward of the copy one rank runs alone
    is served with the copy, not with the original."""
    for key in ("_lockstep_group", "_state_group", "_lockstep_id", "_forward_count",
                "_serving", "_meeting"):
        pm.__dict__.pop(key, None)
    _group(pm)


def _module(group, number: int, ranks: list[int], leader: int, doing: str):
    """The module the leader runs (by its number), after every rank of the group said
    whether it still holds it: a rank that dropped it (the module a script's main() returned
    from, while rank 0 still evaluates a copy) is one ConfigError on every rank, before any
    of the forward's collectives."""
    pm = _modules()["by_id"].get(number)
    mine = torch.tensor([int(pm is not None or dist.get_rank() == ranks[leader])])
    seen = [torch.empty_like(mine) for _ in ranks]
    _collective(lambda: dist.all_gather(seen, mine, group=group), group, doing)
    lacking = [r for r, t in zip(ranks, seen) if not int(t)]
    if lacking:
        raise ConfigError(
            f"rank {ranks[leader]} runs a forward of parallelized module #{number + 1} alone, "
            f"and rank(s) {lacking} of its group no longer hold that module to run it with "
            f"it (they keep the last module they ran); keep the module alive on every rank "
            f"(a reference outside the function that returns), or evaluate it on every rank")
    return pm


# ---- the exchange -----------------------------------------------------------------------------
def _collective(fn, group, doing: str):
    """fn() (a collective on the lockstep group); a peer gone (exited, crashed, its group
    destroyed) or a timeout is a ConfigError naming what this rank was doing, not gloo's."""
    try:
        return fn()
    except RuntimeError as e:
        ranks = dist.get_process_group_ranks(group)
        raise ConfigError(
            f"rank {dist.get_rank()} was at {doing} and its group {ranks} (the ranks that "
            f"run each forward together under this plan) stopped answering: "
            f"{_first_words(e)}. Another rank of it "
            f"left (it crashed, or called destroy_process_group without nncompile.finish() "
            f"first) or waits in a collective nncompile does not see (dist.barrier, torch's "
            f"DCP save). After a rank evaluates alone, have every rank reach one of "
            f"nncompile's calls (a forward, gather_params, save_checkpoint, "
            f"nncompile.finish()) before torch's collectives and destroy_process_group"
        ) from e


def _first_words(e: Exception) -> str:
    text = (str(e).splitlines() or [type(e).__name__])[0]
    return text.split(". This is typically")[0].rstrip(".")


def _exchange(group, row: list[int], doing: str, collective_call: str | None = None
              ) -> list[tuple[int, ...]]:
    """All-gather this rank's row on `group`. `collective_call`: the exchange opens a call
    every rank of the group must make (no rank serves it at a forward), named so."""
    mine = torch.tensor(row, dtype=torch.int64)
    seen = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    if hang_report.watching(group):
        _collective(lambda: _watched(dist.all_gather(seen, mine, group=group, async_op=True),
                                     group, doing, collective_call), group, doing)
    else:
        _collective(lambda: dist.all_gather(seen, mine, group=group), group, doing)
    return [tuple(t.tolist()) for t in seen]


WAIT_SLICE_S = 2.0        # an exchange waiting longer asks where the others are


def _watched(work, group, doing: str, collective_call: str | None) -> None:
    """Wait for an exchange; every WAIT_SLICE_S ask (through the hang watch) whether a rank
    of the group waits in another collective that spans this rank, so that neither can ever
    end: one of the script's own (rank 0 evaluates alone while rank 1 is in
    `dist.barrier()`), or, before a call every rank must make (`collective_call`), any (rank
    0 gathers the ZeRO-1/2 optimizer state alone while rank 1 reduces gradients; seen at two
    asks in a row, as nncompile's own collective may be one this rank launched
    asynchronously and is about to end). That is a ConfigError now, naming where each such
    rank is, not the transport's timeout."""
    limit = default_timeout()
    start = time.monotonic()
    before: dict = {}
    while True:
        try:
            work.wait(datetime.timedelta(seconds=WAIT_SLICE_S))
            return
        except RuntimeError:      # a failure completes the work; a slice that ran out does not
            if work.is_completed() or (
                    limit is not None and time.monotonic() - start > limit.total_seconds()):
                raise
        me = dist.get_rank()
        away = hang_report.peers_waiting_on_me(
            [r for r in dist.get_process_group_ranks(group) if r != me], group,
            script_only=collective_call is None)
        if collective_call is not None:
            away, before = {r: w for r, w in away.items() if before.get(r) == w}, away
        if not away:
            continue
        where = "; ".join(f"rank {r}: {w}" for r, w in sorted(away.items()))
        ranks = dist.get_process_group_ranks(group)
        if collective_call is not None:
            raise hang_report.ends_job(ConfigError(
                f"rank {me} called {collective_call} and waits for its group {ranks} to call "
                f"it too, but {where} - a collective that waits for rank {me} in turn, so "
                f"neither can end. Under this plan the state it gathers is spread over all "
                f"these ranks and no forward of theirs communicates, so they cannot serve a "
                f"call made alone: call it on every rank (as torch's "
                f"ZeroRedundancyOptimizer.consolidate_state_dict), then save on rank 0"))
        raise hang_report.ends_job(ConfigError(
            f"rank {me} is at {doing} and waits for its group {ranks}, but {where} - a "
            f"torch.distributed call of the script's own that waits for rank {me} in turn, "
            f"so neither can end. After a rank runs forwards alone (evaluation on rank 0), "
            f"the others serve them only at nncompile's calls (their next forward, "
            f"gather_params, save_checkpoint, nncompile.finish()): have every rank reach one "
            f"of those before torch's own collectives, or evaluate on every rank"))


def _broadcast(box: list, src: int, group, doing: str) -> None:
    _collective(lambda: dist.broadcast_object_list(box, src=src, group=group), group, doing)


def _leader(rows: list[tuple[int, ...]]) -> int | None:
    """The index of the one rank running something the others are not: a service call while
    they wait at a forward, a forward without gradients while they have them (or in eval
    mode while they train), or anything but training while they wait at a later call; None
    when there is no such single rank."""
    waiting = {i for i, row in enumerate(rows) if row[3] == MEET}
    if waiting:
        alone = [i for i in range(len(rows)) if i not in waiting]
        if len(alone) != 1:
            return None
        _, training, grad, kind, _ = rows[alone[0]]
        return alone[0] if kind == SERVICE or not (training and grad) else None
    asking = [i for i, row in enumerate(rows) if row[3] == SERVICE]
    if asking:
        return asking[0] if len(asking) == 1 else None
    for field in (2, 1):                     # grad mode first, then training mode
        values = {row[field] for row in rows}
        if len(values) == 2:
            alone = [i for i, row in enumerate(rows) if row[field] == 0]
            others_agree = len({row[1:] for i, row in enumerate(rows) if i not in alone}) == 1
            return alone[0] if len(alone) == 1 and others_agree else None
    return None


def _round(group, rows: list[tuple[int, ...]], inputs: list[torch.Tensor], doing: str
           ) -> bool:
    """One exchange's outcome when the ranks differ: the single rank that leads sends its
    forward's inputs (or its service call) and the others run it with it, on the module it
    names; True on the leader (which then runs its own forward). No such rank: one
    ConfigError on every rank."""
    ranks = dist.get_process_group_ranks(group)
    me = ranks.index(dist.get_rank())
    leader = _leader(rows)
    if leader is None:
        _refuse(ranks, rows)
    box = [[x.detach().cpu() for x in inputs] if leader == me else None]
    _broadcast(box, ranks[leader], group, doing)
    if rows[leader][3] != SERVICE:
        _LEADERS[group] = ranks[leader]
    pm = _module(group, rows[leader][4], ranks, leader, doing)
    if leader == me:
        return True
    if rows[leader][3] == SERVICE:
        name, args = box[0]
        _serving(pm, lambda: SERVICES[name](pm, *args, leader=ranks[leader]))
    else:
        _serve_forward(pm, box[0], rows[leader])
    return False


def _agreed(pm, group) -> None:
    """Every rank is at the same call: if one ran forwards alone since they last were, the
    ranks of its plan unit take its random generators (torch's CPU one and this device's):
    the unit's ranks draw one stream, and the leader's drew for the batches it evaluated, as
    every rank of the unit would have on one device. Other units keep theirs (a data-parallel
    replica seeds its own)."""
    leader = _LEADERS.pop(group, None)
    if leader is None or pm is None:       # (at the end of the program: nothing to follow)
        return
    box = [(torch.get_rng_state(), torch.cuda.get_rng_state(pm.device)
            if pm.device.type == "cuda" else None) if dist.get_rank() == leader else None]
    _broadcast(box, leader, group, "the end of a forward run alone")
    if dist.get_rank() != leader and pm.mesh.unit_of(dist.get_rank()) == pm.mesh.unit_of(leader):
        cpu, device = box[0]
        torch.set_rng_state(cpu)
        if device is not None:
            torch.cuda.set_rng_state(device, pm.device)


# ---- the three calls: a forward, a service call, a wait point ---------------------------------
def agree_before_forward(pm, inputs: list[torch.Tensor]) -> bool:
    """Before each forward: returns when this rank's forward may run, True when every rank of
    the group runs it as its own (False: one rank's forward that the others join). A rank
    waiting here while one other rank of its group runs a forward or a service call alone runs
    it with it (the forward's inputs, or the call's arguments, received from it), then waits
    again; anything else is one ConfigError on every rank."""
    group = _group(pm)
    if group is None:
        return True
    if pm.__dict__.get("_serving"):
        return False
    count = pm.__dict__.get("_forward_count", 0) + 1
    pm.__dict__["_forward_count"] = count
    _hold(pm, group)
    row = [count, int(pm.training), int(torch.is_grad_enabled()), FORWARD,
           pm.__dict__["_lockstep_id"]]
    while True:
        rows = _exchange(group, row, f"forward #{count}")
        if len({r[1:] for r in rows}) == 1:
            _agreed(pm, group)
            return True
        if _round(group, rows, inputs, f"forward #{count}"):
            return False


def run_together(pm, name: str, *args, whole_state: bool = False, to: int | None = None):
    """Run service `name` on this rank, with the other ranks of its group: called by all of
    them, or by this one alone while the others wait at their next forward (rank 0 saving a
    checkpoint in a DDP script) or at a later call. `whole_state`: the service needs the
    optimizer state's pieces (state_group); where those span more ranks than the forwards do
    (ZeRO-1/2), every rank of them calls it. `to`: when every rank calls it, the rank that
    gets the result (the others None), where it is in the group. `args` must pickle; the
    result is the service's."""
    group = _group(pm)
    if whole_state and _state_group(pm) is not group:
        return _run_on_every_rank(pm, name, args, to)
    if group is None and to is not None and dist.is_initialized() and dist.get_rank() != to:
        return None                     # this rank holds it all, and only `to` wants it
    if group is None or pm.__dict__.get("_serving"):
        return SERVICES[name](pm, *args, leader=None)
    count = pm.__dict__.get("_forward_count", 0)
    rows = _exchange(group, [count, int(pm.training), int(torch.is_grad_enabled()), SERVICE,
                             pm.__dict__["_lockstep_id"]], SERVICE_WORDS)
    ranks = dist.get_process_group_ranks(group)
    if all(r[3] == SERVICE for r in rows) and len({r[4] for r in rows}) == 1:
        return SERVICES[name](pm, *args, leader=to if to in ranks else None)
    if _leader(rows) != ranks.index(dist.get_rank()):
        _refuse(ranks, rows)
    _broadcast([(name, args)], dist.get_rank(), group, SERVICE_WORDS)
    _module(group, pm.__dict__["_lockstep_id"], ranks, ranks.index(dist.get_rank()),
            SERVICE_WORDS)                      # every rank holds pm (as in _round)
    return _serving(pm, lambda: SERVICES[name](pm, *args, leader=dist.get_rank()))


def _run_on_every_rank(pm, name: str, args: tuple, to: int | None = None):
    """Service `name` as a collective call of every rank of pm's state group (ZeRO-1/2: the
    data-parallel replicas, whose forwards exchange nothing). The ranks first agree that
    they all make it, on one module; one rank calling it alone is a ConfigError on that rank
    within seconds where the others are seen waiting in another collective (hang watch),
    else the transport's timeout's."""
    group = _state_group(pm)
    if group is None:
        return None if to is not None and dist.get_rank() != to else \
            SERVICES[name](pm, *args, leader=None)
    count = pm.__dict__.get("_forward_count", 0)
    rows = _exchange(group, [count, int(pm.training), int(torch.is_grad_enabled()), SERVICE,
                             pm.__dict__["_lockstep_id"]], SERVICE_WORDS,
                     "nncompile.full_optimizer_state_dict")
    ranks = dist.get_process_group_ranks(group)
    if not all(r[3] == SERVICE for r in rows) or len({r[4] for r in rows}) != 1:
        _refuse(ranks, rows)
    return SERVICES[name](pm, *args, leader=to if to in ranks else None)


def meet(pm, point: str) -> None:
    """A wait point before a collective every rank of the job calls (POINTS): returns once
    every rank of pm's lockstep group is at `point`, having run with the one rank that still
    evaluates (or gathers the full state) alone whatever it ran meanwhile. Ranks at different
    points, or a training forward while the others wait here, are one ConfigError on each."""
    group = _group(pm)
    if group is None or pm.__dict__.get("_serving") or pm.__dict__.get("_meeting"):
        return
    pm.__dict__["_meeting"] = True
    _hold(pm, group)
    try:
        _wait(pm, group, point, pm.__dict__["_lockstep_id"])
    finally:
        pm.__dict__["_meeting"] = False


def _wait(pm, group, point: str, number: int) -> None:
    """Exchange MEET rows on `group` until every rank is at `point` (`pm`: the module waiting,
    None at the end of the program)."""
    training = pm.training if pm is not None else False
    row = [list(POINTS).index(point), int(training), int(torch.is_grad_enabled()), MEET,
           number]
    while True:
        rows = _exchange(group, row, POINTS[point])
        if all(r[3] == MEET for r in rows):
            if len({(r[0], r[4]) for r in rows}) > 1:
                _refuse(dist.get_process_group_ranks(group), rows)
            _agreed(pm, group)
            return
        _round(group, rows, [], POINTS[point])


def _serving(pm, fn):
    pm.__dict__["_serving"] = True
    try:
        return fn()
    finally:
        pm.__dict__["_serving"] = False


def _serve_forward(pm, inputs: list[torch.Tensor], row: tuple[int, ...]) -> None:
    """Run another rank's forward with it: its inputs, its modes; the output is dropped."""
    training, grad = bool(row[1]), bool(row[2])
    was = pm.training
    try:
        pm.training = training
        with torch.set_grad_enabled(grad):
            _serving(pm, lambda: pm._run([x.to(pm.device) for x in inputs]))
    finally:
        pm.training = was


def _refuse(ranks: list[int], rows: list[tuple[int, ...]]) -> None:
    several = len({r[4] for r in rows if r[4] != ANY}) > 1
    lines = [f"rank {r}: " + (f"a call of {SERVICE_WORDS}" if q == SERVICE else
                              f"waiting at {list(POINTS.values())[c]}" if q == MEET else
                              f"forward #{c} in {_mode(bool(t), bool(g))}")
             + (f" (parallelized module #{m + 1})" if several and m != ANY else "")
             for r, (c, t, g, q, m) in zip(ranks, rows)]
    raise ConfigError(
        "the ranks of a plan unit (or of a ZeRO group) ran different forwards: "
        + "; ".join(lines) + ". Under this plan each forward is computed by all of them "
        "together (its collectives split the model or gather its weights). One rank may "
        "evaluate alone (without gradients, or in eval mode, while the others wait at their "
        "training forward or at a later call every rank makes), or gather the full state "
        "alone, but not several, nor forwards in the same modes on some ranks only, nor "
        "train while the others wait; and every rank must reach the same nncompile call, on "
        "the same module, next. Evaluate on every rank and print or log on rank 0, or on one "
        "rank only.")


SERVICE_WORDS = "nncompile.full_state_dict / full_optimizer_state_dict"


# ---- the end of the program -------------------------------------------------------------------
def _meet_all(point: str) -> None:
    """Each lockstep group of this rank meets at `point`, in the order the groups were made
    (the same on every rank, whichever modules are still alive), unless an exception is on
    its way out (a crash must not wait) or the ranks are simulated threads (which end
    together)."""
    if sys.exc_info()[0] is not None or getattr(sys, "last_value", None) is not None or \
            not dist.is_initialized() or "threaded" in str(dist.get_backend()).lower():
        return
    cache = _CACHE.get(dist.distributed_c10d._get_default_group(), {})
    for group in cache.get("lockstep_order", ()):
        _wait(None, group, point, ANY)


def finish() -> None:
    """The job's end, called by every rank before `dist.destroy_process_group()`: what must
    end first (an asynchronous checkpoint still being written) finishes, each lockstep group
    meets (a rank still evaluating alone is served here), and the job's cached groups and
    modules are dropped, so their threads end with the process group. Once per job; a
    no-op without a process group.

        before: (rank 0 evaluates alone)   dist.destroy_process_group()   # rank 0: ConfigError
        after:  (rank 0 evaluates alone)   nncompile.finish(); dist.destroy_process_group()
    """
    if not dist.is_initialized():
        return
    _end_pending()
    _meet_all("exit")
    forget_job()                        # the job's groups and modules, freed with it


def _at_exit() -> None:
    """At the end of a program that did not destroy its process group: finish what must end
    first (before_end), meet, then destroy it (gloo's threads torn down by the interpreter's
    exit instead can abort the process: "terminate called without an active exception")."""
    if not dist.is_initialized():
        return
    if sys.exc_info()[0] is None and getattr(sys, "last_value", None) is None:
        _end_pending()                  # not after a crash: a crash must not wait
    if not _CACHE.get(dist.distributed_c10d._get_default_group(), {}).get("lockstep_order"):
        return
    try:
        _meet_all("exit")
    except ConfigError as e:             # the job failed: say why, and exit non-zero
        print(f"nncompile: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        os._exit(1)
    if sys.exc_info()[0] is None and getattr(sys, "last_value", None) is None and \
            "threaded" not in str(dist.get_backend()).lower():
        dist.destroy_process_group()


_BEFORE_END: list = []        # what finishes before the job's end (async_checkpoint.py)


def _end_pending() -> None:
    for end in _BEFORE_END:
        end()                           # e.g. a checkpoint still being written


def before_end(end) -> None:
    """Run `end()` at the job's end (nncompile.finish(), or the program's end unless it ends
    by an exception), before the ranks meet."""
    if end not in _BEFORE_END:
        _BEFORE_END.append(end)


atexit.register(_at_exit)
