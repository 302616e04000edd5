"""What every rank must agree on before the plan's numbers mean anything, as DDP assumes.

1. Weights at load (`sync_at_load`, ComputeConfig.init_sync, on by default). A script that
   seeds each rank differently (nanoGPT: `1337 + rank`) builds a different model on each rank;
   each rank would take its shards from its own copy, so data-parallel replicas differ and a
   plan unit assembles a model no device ever had. Like DistributedDataParallel at wrap time,
   the original module's parameters and buffers are broadcast from global rank 0 over the
   job's default group, in place, before any shard is cut (meta tensors are skipped):

       before: rank 0 h.0.mlp_fc.weight = W0, rank 1 = W1   -> shards of W0 and W1 mixed
       after:  every rank's module holds W0                  -> shards of W0

2. Inputs of one plan unit (`check_call`, ComputeConfig.check_inputs, the first 3 calls by
   default). The ranks of a plan unit split one batch between them, so each must be fed the
   same batch; a per-rank data seed (`1337 + rank`, a sampler over all ranks) feeds them
   different ones and trains another model without an error. On the first calls each rank
   all-gathers a fingerprint of its tensor inputs over the unit (per input: numel, count of
   non-finite values, float64 sum, index-weighted sum, sum of absolute values), and an
   InputMismatchError names the ranks that differ. When the generated code draws random
   numbers (dropout: runtime/program/rng.py draws the full tensor's mask on every rank of the unit)
   and the module is in training mode, the generator states must be equal across the unit
   too; they are compared the same way, never synchronized behind the user's back (the fix
   is to seed by the data-parallel unit, `pm.dp_rank`, not by the rank). Later calls issue
   no collective. Plans of one rank per unit have nothing to compare.
"""
from __future__ import annotations

import hashlib
import sys

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from nncompile.errors import InputMismatchError

BUCKET_BYTES = 25 * 2 ** 20      # broadcast tensors in flat buckets of about this size
REL_TOL = 1e-9                   # float inputs: sums may differ by summation order only


# ---- 1. weights at load -----------------------------------------------------------------------
def sync_at_load(pm, module, state: dict[str, torch.Tensor]) -> None:
    """Keep the original module for pm.module, broadcast its parameters and buffers from
    global rank 0 (ComputeConfig.init_sync), and arm the first calls' input check."""
    from ..store.pieces import track
    from ..protocol.lockstep import register
    pm.__dict__["_original_module"] = module        # not a submodule: not in pm's state
    track(pm)                                       # torch's clip_grad_norm_ knows pm's params
    register(pm)                                    # its lockstep group, made by every rank
    cfg = pm.compute_config
    pm._calls_to_check = cfg.check_inputs if (
        dist.is_initialized() and pm.PLAN_NGPUS > 1 and pm.plan_group is not None) else 0
    if cfg.init_sync and module is not None and dist.is_initialized() and \
            dist.get_world_size() > 1:
        broadcast_state(state, pm.device)


def _comm_device(device: torch.device) -> torch.device:
    """Where the default group's collectives run: the module's device, or pm's own device
    when the backend cannot move tensors of that kind (NCCL and CPU tensors)."""
    backend = str(dist.get_backend()).lower()
    if "nccl" in backend and device.type == "cpu":
        return torch.device("cuda", torch.cuda.current_device())
    return device


@torch.no_grad()
def broadcast_state(state: dict[str, torch.Tensor], device: torch.device) -> None:
    """Global rank 0's values of `state`'s tensors, in place on every rank (each tensor once,
    a tied weight included; tensors on meta on any rank are skipped). Every rank calls it."""
    seen, tensors = set(), []
    for t in state.values():
        if isinstance(t, torch.Tensor) and id(t) not in seen:
            seen.add(id(t))
            tensors.append(t)
    if not tensors:
        return
    dev = _comm_device(device)
    real = torch.tensor([0 if t.is_meta else 1 for t in tensors], dtype=torch.int32,
                        device=dev)
    dist.all_reduce(real, op=dist.ReduceOp.MIN)       # the same tensors on every rank
    keep = [t for t, r in zip(tensors, real.tolist()) if r]
    buckets: dict[tuple, list[list[torch.Tensor]]] = {}
    size: dict[tuple, int] = {}             # bytes in each key's open bucket
    for t in keep:
        key = (t.dtype, t.device)
        same = buckets.setdefault(key, [[]])
        if same[-1] and size[key] >= BUCKET_BYTES:
            same.append([])
            size[key] = 0
        same[-1].append(t)
        size[key] = size.get(key, 0) + t.numel() * t.element_size()
    for (dtype, where), groups in buckets.items():
        comm = _comm_device(where)
        for group in groups:
            flat = _flatten_dense_tensors([t.detach().to(comm) for t in group])
            dist.broadcast(flat, src=0)
            for t, new in zip(group, _unflatten_dense_tensors(flat, group)):
                t.detach().copy_(new)
    # no rank goes on (to cut shards, or free the module's storage) before every rank has
    # written: simulated ranks may share one module object
    dist.all_reduce(real[:1], op=dist.ReduceOp.MIN)


# ---- 2. inputs of one plan unit ---------------------------------------------------------------
def _fingerprint(x: torch.Tensor) -> list[float]:
    """numel, non-finite count, sum, index-weighted sum, absolute sum (float64)."""
    v = x.detach().reshape(-1).to(torch.float64)
    finite = torch.isfinite(v)
    v = torch.where(finite, v, torch.zeros((), dtype=v.dtype, device=v.device))
    w = torch.arange(1, v.numel() + 1, dtype=torch.float64, device=v.device)
    return [float(v.numel()), float((~finite).sum()), float(v.sum()), float((v * w).sum()),
            float(v.abs().sum())]


def _rng_fingerprint(device: torch.device) -> float:
    """A 48-bit hash of the generator the generated code's random ops draw from."""
    from . import rng
    g = getattr(rng._thread, "generator", None)
    if g is not None and device.type == "cpu":
        state = g.get_state()
    elif device.type == "cuda":
        state = torch.cuda.get_rng_state(device)
    else:
        state = torch.get_rng_state()
    digest = hashlib.blake2b(state.cpu().numpy().tobytes(), digest_size=6).digest()
    return float(int.from_bytes(digest, "little"))


def _draws_random(pm) -> bool:
    """The generated code calls runtime/program/rng.py (it imports it only then)."""
    mod = sys.modules.get(type(pm).__module__)
    return mod is not None and getattr(mod, "rng", None) is not None


def _differs(a: torch.Tensor, b: torch.Tensor, exact: bool) -> bool:
    """Fingerprints [numel, nonfinite, sum, weighted, abs] of one input on two ranks."""
    if a[0] != b[0] or a[1] != b[1]:
        return True
    if exact:
        return not torch.equal(a, b)
    scale = max(float(a[4]), float(b[4]), 1e-300)
    return abs(float(a[2] - b[2])) > REL_TOL * scale or \
        abs(float(a[3] - b[3])) > REL_TOL * scale * float(a[0])


def check_call(pm, inputs: list[torch.Tensor]) -> None:
    """On the first ComputeConfig.check_inputs calls: the ranks of this plan unit hold the same
    inputs (and, when the plan draws random numbers in training, the same generator state).
    A collective over the plan unit; raises InputMismatchError on every rank of the unit."""
    pm._calls_to_check -= 1
    names = [name for name, _, _ in pm.INPUTS]
    rows = [_fingerprint(x) if isinstance(x, torch.Tensor) else [0.0] * 5 for x in inputs]
    check_rng = pm.training and _draws_random(pm)
    flat = [v for row in rows for v in row] + [_rng_fingerprint(pm.device) if check_rng else 0.]
    dev = _comm_device(pm.device)
    mine = torch.tensor(flat, dtype=torch.float64, device=dev)
    n = dist.get_world_size(pm.plan_group)
    parts = [torch.empty_like(mine) for _ in range(n)]
    dist.all_gather(parts, mine, group=pm.plan_group)
    ranks = dist.get_process_group_ranks(pm.plan_group)
    parts = [p.cpu().view(-1) for p in parts]
    first = parts[0]
    for i, (name, x) in enumerate(zip(names, inputs)):
        exact = not (isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex()))
        bad = [r for r, p in zip(ranks[1:], parts[1:])
               if _differs(first[5 * i:5 * i + 5], p[5 * i:5 * i + 5], exact)]
        if bad:
            raise InputMismatchError(
                f"input {name!r} differs across the ranks of one plan unit: ranks {bad} were "
                f"fed another {name!r} than rank {ranks[0]} (the unit's ranks {ranks} split "
                f"one batch between them, so each must get the same batch; otherwise the "
                f"plan trains another model). Feed every rank of a unit the same batch: seed "
                f"or offset the data by the data-parallel unit, rank // plan_ngpus = "
                f"pm.dp_rank (of pm.dp_size units), not by the rank, e.g. "
                f"DistributedSampler(ds, num_replicas=pm.dp_size, rank=pm.dp_rank). "
                f"ComputeConfig(check_inputs=0) turns this check off")
    if check_rng:
        bad = [r for r, p in zip(ranks[1:], parts[1:]) if p[-1] != first[-1]]
        if bad:
            raise InputMismatchError(
                f"the random generator of ranks {bad} differs from rank {ranks[0]}'s, but "
                f"this plan draws random numbers (dropout) and every rank of a plan unit must "
                f"draw the same ones (each draws the full tensor's mask and keeps its slice); "
                f"seed every rank of a unit alike: torch.manual_seed(seed + rank // "
                f"plan_ngpus), i.e. seed + pm.dp_rank, not seed + rank. "
                f"ComputeConfig(check_inputs=0) turns this check off")
