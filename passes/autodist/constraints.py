"""Partition constraints a user pins in `parallel.constraints`.

Each entry selects ops by module path or op name (glob patterns) and limits their strategies:

    {"module": "transformer.h.*.mlp.*",  # or "op": "linear*" (op name, e.g. transformer_h_0_mlp_linear)
     "dims": [-1],        # output dims the op may be split on (None: any)
     "partial": False,    # may it leave partial sums (a split contracted dim)?
     "replicate": True}   # may it run replicated?

An op matched by several entries must satisfy all of them.
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass

from nncompile.errors import ConfigError
from nncompile.ir import Op, Partial, Shard, Strategy

_KEYS = {"module", "op", "dims", "partial", "replicate"}


@dataclass(frozen=True)
class PartitionConstraint:
    module: str | None = None
    op: str | None = None
    dims: tuple[int, ...] | None = None
    partial: bool = True
    replicate: bool = True

    def matches(self, op: Op) -> bool:
        if self.module is not None:
            path = op.module_path
            if not (fnmatch.fnmatchcase(path, self.module)
                    or fnmatch.fnmatchcase(path, self.module + ".*")):
                return False
        if self.op is not None and not (fnmatch.fnmatchcase(op.name, self.op)
                                        or fnmatch.fnmatchcase(op.target_name, self.op)):
            return False
        return True

    def allows(self, s: Strategy, out_rank: int) -> bool:
        if not s.is_split:
            return self.replicate
        if any(isinstance(p, Partial) for p in s.outputs) and not self.partial:
            return False
        split = next((p.dim for p in s.outputs if isinstance(p, Shard)), None)
        if self.dims is not None and split is not None:
            return split in {d % out_rank if out_rank else d for d in self.dims}
        return True


def parse_constraints(raw) -> list[PartitionConstraint]:
    if raw is None:
        return []
    if not isinstance(raw, (list, tuple)):
        raise ConfigError("parallel.constraints must be a list of dicts like "
                          "{'module': 'layers.*.mlp', 'dims': [-1], 'replicate': False}")
    out = []
    for i, entry in enumerate(raw):
        if not isinstance(entry, dict) or not ({"module", "op"} & set(entry)):
            raise ConfigError(f"parallel.constraints[{i}] = {entry!r}: each constraint "
                              "is a dict with 'module' or 'op' (a glob) and any of 'dims', "
                              "'partial', 'replicate'")
        unknown = set(entry) - _KEYS
        if unknown:
            raise ConfigError(f"parallel.constraints[{i}] has unknown keys "
                              f"{sorted(unknown)}; allowed: {sorted(_KEYS)}")
        dims = entry.get("dims")
        out.append(PartitionConstraint(entry.get("module"), entry.get("op"),
                                       None if dims is None else tuple(int(d) for d in dims),
                                       bool(entry.get("partial", True)),
                                       bool(entry.get("replicate", True))))
    return out


def allowed_strategies(op: Op, candidates: list[Strategy],
                       constraints: list[PartitionConstraint]) -> list[Strategy]:
    """The candidates every matching constraint allows (output dims normalised)."""
    mine = [c for c in constraints if c.matches(op)]
    if not mine:
        return candidates
    rank = len(op.outputs[0].meta.shape) if op.outputs and op.outputs[0].is_tensor else 0

    def ok(s: Strategy) -> bool:
        return all(c.allows(s, rank) for c in mine)

    kept = [s for s in candidates if ok(s)]
    if not kept:
        raise ConfigError(f"parallel.constraints leave no strategy for op {op.name} "
                          f"({op.target_name}, module {op.module_path!r}); its strategies are "
                          f"{[s.note for s in candidates]}; relax 'dims' or allow 'replicate'")
    return kept


def constrained(op: Op, constraints: list[PartitionConstraint]) -> bool:
    return any(c.matches(op) for c in constraints)
