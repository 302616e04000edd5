"""Ranks whose forwards communicate run each forward together; a forward one rank runs alone
(rank-0-only evaluation) is joined by the others.

Under a plan that splits the model over a unit (tp, context or expert parallelism) or gathers
ZeRO-3 weights, each forward is a sequence of collectives that every rank of the unit (or of the
ZeRO-3 group) must enter together. DDP scripts often evaluate on rank 0 alone (nanoGPT's
`if iter_num % eval_interval == 0 and master_process: losses = estimate_loss()`), which is
right under dp and ZeRO-1/2, whose forwards communicate nothing. Here rank 0's eval forward
would meet the other ranks' next training forward, mix their collectives and die in the
transport, or hang. Instead, before each forward the ranks exchange (forward count, training
mode, grad mode) over a CPU (gloo) group of the ranks involved, a 24-byte all-gather with no
device synchronisation:

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
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from nncompile.errors import ConfigError
from nncompile.mesh import DP, PP, replica_dims

from .groups import _CACHE, default_timeout, group_along


def lockstep_group(pm):
    """The CPU group of the ranks that share pm's forward collectives (None: no other rank,
    or the check is off)."""
    if not dist.is_initialized() or pm.PIPELINE is not None or \
            not pm.compute_config.check_lockstep:
        return None
    mesh = pm.mesh
    dims = tuple(n for n in mesh.names if n not in (DP, PP) and mesh.size(n) > 1)
    if pm.memory.zero:       # ZeRO shards state over the replicas: they gather it together
        dims += tuple(d for d in replica_dims(mesh) if mesh.size(d) > 1 and d not in dims)
    if not dims:
        return None
    group = group_along(dims, pm.PLAN_NGPUS, pm.RUNTIME_NGPUS, pm.PIPE_RANKS, pm.mesh_axes)
    if group is None:
        return None
    if "gloo" in str(dist.get_backend(group)).lower():
        return group
    ranks = dist.get_process_group_ranks(group)      # NCCL: a gloo twin, made once per set
    cache = _CACHE.setdefault(dist.distributed_c10d._get_default_group(), {})
    key = ("lockstep", tuple(sorted(dims)), pm.PLAN_NGPUS, pm.RUNTIME_NGPUS, pm.PIPE_RANKS,
           tuple(pm.mesh_axes))
    if key not in cache:
        mesh_groups = mesh.groups_along(tuple(dims)) if len(dims) < len(mesh.names) else \
            [list(range(dist.get_world_size()))]
        cache[key] = [(r, dist.new_group(r, backend="gloo", timeout=default_timeout()))
                      for r in mesh_groups]
    return next(g for r, g in cache[key] if sorted(r) == sorted(ranks))


def _mode(training: bool, grad: bool) -> str:
    return f"{'training' if training else 'eval'} mode {'with' if grad else 'without'} gradients"


FORWARD, SERVICE = 0, 1        # what a rank is about to do: its forward, or a service call
SERVICES: dict = {}             # name -> fn(pm, *args, leader): collective operations on pm


def service(name: str):
    """Register fn(pm, *args, leader) as an operation one rank may run alone (run_together)."""
    def register(fn):
        SERVICES[name] = fn
        return fn
    return register


def _group(pm):
    group = pm.__dict__.get("_lockstep_group", False)
    if group is False:
        group = pm.__dict__["_lockstep_group"] = lockstep_group(pm)
    return group


def _exchange(group, row: list[int]) -> list[tuple[int, ...]]:
    mine = torch.tensor(row, dtype=torch.int64)
    seen = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(seen, mine, group=group)
    return [tuple(t.tolist()) for t in seen]


def _leader(rows: list[tuple[int, ...]]) -> int | None:
    """The index of the one rank running something the others are not: a service call while
    they wait at a forward, or a forward without gradients while they have them (or in eval
    mode while they train); None when there is no such single rank."""
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


def agree(pm, inputs: list[torch.Tensor]) -> bool:
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
    row = [count, int(pm.training), int(torch.is_grad_enabled()), FORWARD]
    ranks = dist.get_process_group_ranks(group)
    me = ranks.index(dist.get_rank())
    while True:
        rows = _exchange(group, row)
        if len({r[1:] for r in rows}) == 1:
            last = pm.__dict__.pop("_last_leader", None)
            if last is not None:
                _follow_generators(pm, group, last)
            return True
        leader = _leader(rows)
        if leader is None:
            _refuse(ranks, rows)
        box = [[x.detach().cpu() for x in inputs] if leader == me else None]
        dist.broadcast_object_list(box, src=ranks[leader], group=group)
        if rows[leader][3] != SERVICE:
            pm.__dict__["_last_leader"] = ranks[leader]
        if leader == me:
            return False
        if rows[leader][3] == SERVICE:
            name, args = box[0]
            _serving(pm, lambda: SERVICES[name](pm, *args, leader=ranks[leader]))
        else:
            _serve_forward(pm, box[0], rows[leader])


def _follow_generators(pm, group, leader: int) -> None:
    """After one rank ran forwards alone, the ranks of its plan unit take its random
    generators (torch's CPU one and this device's): the unit's ranks draw one stream, and the
    leader's drew for the batches it evaluated, as every rank of the unit would have on one
    device. Other units keep theirs (a data-parallel replica seeds its own)."""
    box = [(torch.get_rng_state(), torch.cuda.get_rng_state(pm.device)
            if pm.device.type == "cuda" else None) if dist.get_rank() == leader else None]
    dist.broadcast_object_list(box, src=leader, group=group)
    if dist.get_rank() != leader and pm.mesh.unit_of(dist.get_rank()) == pm.mesh.unit_of(leader):
        cpu, device = box[0]
        torch.set_rng_state(cpu)
        if device is not None:
            torch.cuda.set_rng_state(device, pm.device)


def run_together(pm, name: str, *args):
    """Run service `name` on this rank, with the other ranks of its group: called by all of
    them, or by this one alone while the others wait at their next forward (rank 0 saving a
    checkpoint in a DDP script). `args` must pickle; the result is the service's."""
    group = _group(pm)
    if group is None or pm.__dict__.get("_serving"):
        return SERVICES[name](pm, *args, leader=None)
    count = pm.__dict__.get("_forward_count", 0)
    rows = _exchange(group, [count, int(pm.training), int(torch.is_grad_enabled()), SERVICE])
    ranks = dist.get_process_group_ranks(group)
    if all(r[3] == SERVICE for r in rows):
        return SERVICES[name](pm, *args, leader=None)
    if _leader(rows) != ranks.index(dist.get_rank()):
        _refuse(ranks, rows)
    dist.broadcast_object_list([(name, args)], src=dist.get_rank(), group=group)
    return _serving(pm, lambda: SERVICES[name](pm, *args, leader=dist.get_rank()))


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
    lines = [f"rank {r}: " + (f"a call of {SERVICE_WORDS}" if q == SERVICE else
                              f"forward #{c} in {_mode(bool(t), bool(g))}")
             for r, (c, t, g, q) in zip(ranks, rows)]
    raise ConfigError(
        "the ranks of a plan unit (or of a ZeRO group) ran different forwards: "
        + "; ".join(lines) + ". Under this plan each forward is computed by all of them "
        "together (its collectives split the model or gather its weights). One rank may "
        "evaluate alone (without gradients, or in eval mode, while the others wait at their "
        "training forward), or gather the full state alone, but not several, nor forwards "
        "in the same modes on some ranks only. Evaluate on every rank and print or log on "
        "rank 0, or on one rank only.")


SERVICE_WORDS = "nncompile.full_state_dict / full_optimizer_state_dict"
