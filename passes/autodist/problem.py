"""The decision problem autodist hands to the ILP: choices, their options and their costs.

- A *choice* is one decision: a group of ops (an op plus the ops that follow it: its only
  tensor input is the previous op's output, e.g. a view or an activation after a linear) or a
  free value (a parameter, buffer or constant: where it lives).
- *Identical layers* share choices: ops under `<prefix>.<i>.` (a ModuleList entry) whose
  instances have the same signature (ops, shapes, wiring, pinned constraints) map onto the
  first instance's ops, so the problem's size does not grow with depth. Costs of all
  instances are summed onto the shared choice.
- Costs per option (seconds, bytes): `compute`, `comm` (transitions from fixed inputs and
  inside the group, data-parallel gradient reduction), `memory`; and `pairs[(a, b)][i][j]`:
  the transition cost on edges from choice a's option i to choice b's option j. `syncs` lists backward all-reduces of replicated values read by
  split ops (one per value, however many split readers it has).
- Memory terms outside the choices (set per ZeRO/offload/recompute combination by
  memory_model.py): `fixed_memory` bytes, and `peaks`: (weight, units), adding
  weight x max over units of the unit's bytes (each unit: {choice: bytes per option}).
- Under a pipeline, `groups` weighs each choice's memory per pipeline rank (its share of the
  rank's stages, activations times the micro-batches in flight; pipeline.py): one memory
  limit per rank.
- Recomputed ops save nothing but the outputs their region hands to ops outside it (the next
  region's checkpoint input).
"""
from __future__ import annotations

import collections
from dataclasses import dataclass, field

from nncompile.ir import FREE_KINDS, PARAM, Graph, Op, Placement, Replicate, Shard, Strategy, \
    Value, map_nested
from nncompile.rules import strategies

from ..recompute import recompute_region
from .constraints import PartitionConstraint, allowed_strategies, constrained
from .cost_model import CostModel, nbytes


@dataclass
class Choice:
    name: str
    ops: list[Op]                       # canonical ops (head first); empty for a free value
    value: Value | None = None          # the free value this choice places
    options: list = field(default_factory=list)   # {op: Strategy} or a Placement
    count: int = 1                      # identical-layer instances sharing this choice
    compute: list[float] = field(default_factory=list)   # seconds per option
    comm: list[float] = field(default_factory=list)
    memory: list[float] = field(default_factory=list)    # bytes per option

    def label(self, k: int) -> str:
        if self.value is not None:
            return repr(self.options[k])
        s = self.options[k][self.ops[0]]
        return f"{s.note}: {', '.join(map(repr, s.inputs))} -> {', '.join(map(repr, s.outputs))}"


@dataclass
class Problem:
    choices: list[Choice]
    pairs: dict[tuple[int, int], list[list[float]]]
    syncs: list[tuple[float, list[tuple[int, frozenset]]]]   # (seconds, [(choice, options)])
    choice_of: dict[int, int]           # id(canonical op or free value) -> choice index
    canon: dict[int, Op]                # id(op) -> canonical op
    vcanon: dict[int, Value]            # id(free value) -> canonical free value
    layers: dict[str, int]              # layer prefix -> instances sharing choices
    model: CostModel
    fixed_memory: float = 0.0           # bytes per rank whatever the options
    peaks: list[tuple[float, list[dict[int, list[float]]]]] = field(default_factory=list)
    # memory per pipeline rank (pipeline.py): per rank, a weight per choice; None: one rank
    groups: list[list[float]] | None = None

    def strategy(self, op: Op, ks: list[int]) -> Strategy:
        c = self.canon[id(op)]
        return self.choices[self.choice_of[id(c)]].options[ks[self.choice_of[id(c)]]][c]

    def placement(self, v: Value, ks: list[int]) -> Placement:
        cv, a = _source(self, v)
        return _place(self, cv, a, ks[a] if a is not None else 0)


def _layer_of(op: Op) -> tuple[str, int, str] | None:
    parts = op.module_path.split(".") if op.module_path else []
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:i]), int(part), ".".join(parts[i + 1:])
    return None


def _canonicalize(g: Graph, flags) -> tuple[dict[int, Op], dict[int, Value], dict[str, int]]:
    """Map every op (and free value of a layer) onto the first identical layer instance."""
    instances: dict[tuple[str, int], list[tuple[Op, str, list[Value]]]] = \
        collections.defaultdict(list)
    for op in g.ops:
        where = _layer_of(op)
        if where is not None:
            instances[where[:2]].append((op, where[2], op.inputs()))
    canon = {id(op): op for op in g.ops}
    vcanon = {id(v): v for v in g.params + g.buffers + g.consts}
    first: dict[tuple, list] = {}
    shared: dict[str, int] = collections.Counter()
    for (prefix, idx), ops in instances.items():
        pos = {id(op): i for i, (op, _, _) in enumerate(ops)}
        head = f"{prefix}.{idx}."
        sig = []
        for op, rest, ins in ops:
            wiring = []
            for v in ins:
                if v.producer is not None and id(v.producer) in pos:
                    wiring.append(("op", pos[id(v.producer)], v.producer.outputs.index(v)))
                elif v.kind in FREE_KINDS and v.fqn and v.fqn.startswith(head):
                    wiring.append((v.kind, v.fqn[len(head):]))
                else:
                    wiring.append(("outside",))
            sig.append((op.target_name, rest, wiring, flags(op),
                        [(tuple(v.meta.shape), str(v.meta.dtype), v.requires_grad)
                         for v in ins + op.outputs if v.is_tensor],
                        repr(map_nested((op.args, op.kwargs), lambda v: "%"))))
        key = (prefix, repr(sig))
        if key not in first:
            first[key] = ops
            continue
        base = first[key]
        shared[prefix] += 1
        for (op, _, ins), (c, _, cins) in zip(ops, base):
            canon[id(op)] = c
            for v, cv in zip(ins, cins):
                if v.kind in FREE_KINDS and v.fqn and v.fqn.startswith(head):
                    vcanon[id(v)] = cv
    return canon, vcanon, {p: n + 1 for p, n in shared.items()}


def _follows(op: Op, src: Op | None, choice_of: dict, canon: dict, pinned: bool) -> bool:
    """`op` reads only `src`'s output, in the same layer instance, and nothing pins it."""
    return (src is not None and id(src) in choice_of and canon[id(src)] is src and not pinned
            and (_layer_of(src) or ("", -1))[:2] == (_layer_of(op) or ("", -1))[:2])


def build_problem(g: Graph, model: CostModel, constraints: list[PartitionConstraint],
                  recompute: list[str], narrow=None) -> Problem:
    """`narrow(op, strategies)`: the ones the plan may pick (under context parallelism those
    clear of the op's split along cp: context_parallel.plan_filter)."""
    n = model.n

    def candidates(op: Op) -> list:
        cands = strategies(op, n)
        return narrow(op, cands) if narrow is not None else cands

    def flags(op: Op):
        return (constrained(op, constraints), recompute_region(op, recompute) is not None)

    canon, vcanon, layers = _canonicalize(g, flags)
    count = collections.Counter(id(canon[id(op)]) for op in g.ops)
    vcount = collections.Counter(id(vcanon[id(v)]) for v in g.params + g.buffers + g.consts)
    choices: list[Choice] = []
    choice_of: dict[int, int] = {}

    # ---- op groups: an op joins its producer's group when it only follows it ----
    for op in g.ops:
        if canon[id(op)] is not op:
            continue
        tensors = op.tensor_inputs()
        src = tensors[0].producer if len(tensors) == 1 else None
        if _follows(op, src, choice_of, canon, flags(op)[0]):
            ch = choices[choice_of[id(src)]]
            cands = candidates(op)
            for assign in ch.options:
                have = assign[src].outputs[src.outputs.index(tensors[0])]
                assign[op] = next((s for s in cands if s.inputs[0] == have), cands[-1])
            ch.ops.append(op)
            choice_of[id(op)] = choice_of[id(src)]
            continue
        cands = allowed_strategies(op, candidates(op), constraints)
        choice_of[id(op)] = len(choices)
        choices.append(Choice(op.name, [op], options=[{op: s} for s in cands],
                              count=count[id(op)]))

    # ---- free values: replicated, or sharded the way some reader wants ----
    wanted: dict[int, set] = collections.defaultdict(set)
    read: set[int] = set()
    for op in g.ops:
        if canon[id(op)] is not op:
            continue
        ch = choices[choice_of[id(op)]]
        for i, v in enumerate(op.tensor_inputs()):
            if v.kind in FREE_KINDS:
                read.add(id(vcanon[id(v)]))
                wanted[id(vcanon[id(v)])] |= {a[op].inputs[i] for a in ch.options
                                              if isinstance(a[op].inputs[i], Shard)}
    pinned = g.plan_state.pinned        # the eval program: the training placements
    for v in g.params + g.buffers + g.consts:
        if vcanon[id(v)] is v and id(v) in read:
            opts = [pinned[v.fqn]] if v.fqn in pinned else \
                [Replicate()] + sorted(wanted[id(v)], key=lambda p: p.dim)
            choice_of[id(v)] = len(choices)
            choices.append(Choice(v.fqn or v.name, [], v, opts, count=vcount[id(v)]))

    prob = Problem(choices, {}, [], choice_of, canon, vcanon, layers, model)
    region = {id(op): recompute_region(op, recompute) for op in g.ops}
    recomputed = {i for i, r in region.items() if r}
    handed = {id(v.producer) for op in g.ops for v in op.tensor_inputs()
              if region.get(id(v.producer)) not in (None, region[id(op)])}
    handed |= {id(v.producer) for v in g.outputs
               if isinstance(v, Value) and region.get(id(v.producer))}
    _node_costs(prob, recomputed, handed)
    _edge_costs(g, prob)
    return prob


def _node_costs(prob: Problem, recomputed: set[int], handed: set[int] = frozenset()) -> None:
    """Compute, memory and gradient reduction of each option, summed over instances."""
    model = prob.model
    for ch in prob.choices:
        k_n = len(ch.options)
        ch.compute, ch.comm, ch.memory = [0.0] * k_n, [0.0] * k_n, [0.0] * k_n
        for k, opt in enumerate(ch.options):
            if ch.value is not None:
                v = ch.value
                if v.kind == PARAM:
                    ch.memory[k] = ch.count * model.param_memory(v, opt)
                    ch.comm[k] = ch.count * model.grad_reduce(v, opt)
                    ch.compute[k] = ch.count * model.optimizer_step(v, opt)
                else:
                    ch.memory[k] = ch.count * nbytes(v, opt, model.n)
                continue
            for op in ch.ops:
                s = opt[op]
                t = model.compute(op, s.inputs, s.outputs)
                if id(op) in recomputed:        # forward runs again in backward
                    t += model.compute(op, s.inputs, s.outputs) / 3.0
                    if id(op) in handed:        # kept: the next region's checkpoint input
                        ch.memory[k] += ch.count * model.activation_memory(op, s.outputs)
                else:
                    ch.memory[k] += ch.count * model.activation_memory(op, s.outputs)
                ch.compute[k] += ch.count * t


def _source(prob: Problem, v: Value) -> tuple[Value, int | None]:
    """The canonical form of `v` and the choice that places it (None: fixed replicated)."""
    if v.kind in FREE_KINDS:
        cv = prob.vcanon[id(v)]
        return cv, prob.choice_of.get(id(cv))
    if v.producer is None:
        return v, None
    c = prob.canon[id(v.producer)]
    cv = c.outputs[v.producer.outputs.index(v)]
    return cv, prob.choice_of[id(c)]


def _place(prob: Problem, cv: Value, a: int | None, k: int) -> Placement:
    if a is None:
        return Replicate()
    ch = prob.choices[a]
    if ch.value is not None:
        return ch.options[k]
    return ch.options[k][cv.producer].outputs[cv.producer.outputs.index(cv)]


def _edge_costs(g: Graph, prob: Problem) -> None:
    """Transitions on every edge (summed per pair of choices) and gradient syncs."""
    model, choices = prob.model, prob.choices
    edges: dict[tuple, int] = collections.Counter()
    ends: dict[tuple, tuple] = {}
    actual: dict[int, set] = collections.defaultdict(set)   # canonical value -> actual values
    for op in g.ops:
        c = prob.canon[id(op)]
        for i, v in enumerate(op.tensor_inputs()):
            cv, a = _source(prob, v)
            key = (id(cv), id(c), i)
            edges[key] += 1
            ends[key] = (cv, a, c)
            actual[id(cv)].add(id(v))
    readers: dict[int, set] = collections.defaultdict(set)
    synced: dict[int, Value] = {}
    for key, reps in edges.items():
        cv, a, c = ends[key]
        i = key[2]
        b = prob.choice_of[id(c)]
        cb = choices[b]
        rows = range(len(choices[a].options)) if a is not None else [0]
        table = [[reps * (model.transition(cv, _place(prob, cv, a, ka), opt[c].inputs[i],
                                           cv.requires_grad)[0]
                          + model.gathered_sync(cv, _place(prob, cv, a, ka), opt[c].inputs[i],
                                                opt[c].is_split))
                  for opt in cb.options] for ka in rows]
        if a is None:
            for kb, t in enumerate(table[0]):
                cb.comm[kb] += t
        elif a == b:
            for k in range(len(cb.options)):
                cb.comm[k] += table[k][k]
        else:
            acc = prob.pairs.setdefault((a, b), [[0.0] * len(cb.options) for _ in rows])
            for ka, row in enumerate(table):
                for kb, t in enumerate(row):
                    acc[ka][kb] += t
        # a replicated value read by a split op: its gradient is summed over the unit
        sync = frozenset(kb for kb, opt in enumerate(cb.options)
                         if isinstance(opt[c].inputs[i], Replicate) and opt[c].is_split)
        if sync and cv.requires_grad and model.training and model.n > 1:
            readers[id(cv)].add((b, sync))
            synced[id(cv)] = cv
    for vid, rs in readers.items():
        cv = synced[vid]
        prob.syncs.append((model.grad_sync(cv) * len(actual[vid]), sorted(rs, key=repr)))
    # a buffer's new value (BatchNorm's running statistics, the last outputs) is written back
    # into the buffer's shard: converted to the buffer's placement
    nupd = len(g.trace_info.buffer_updates)
    buffers = {v.fqn: v for v in g.buffers}
    for fqn, v in zip(g.trace_info.buffer_updates, g.outputs[len(g.outputs) - nupd:]):
        if not (isinstance(v, Value) and v.is_tensor):
            continue
        cv, a = _source(prob, v)
        bv, b = _source(prob, buffers[fqn])
        if a is None and b is None:
            continue
        rows = range(len(choices[a].options)) if a is not None else [0]
        cols = range(len(choices[b].options)) if b is not None else [0]
        table = [[model.transition(cv, _place(prob, cv, a, ka), _place(prob, bv, b, kb),
                                   False)[0] for kb in cols] for ka in rows]
        if a is None or b is None or a == b:
            owner = choices[b if a is None else a]
            for k in range(len(owner.options)):
                owner.comm[k] += table[0][k] if a is None else \
                    table[k][0] if b is None else table[k][k]
        else:
            acc = prob.pairs.setdefault((a, b), [[0.0] * len(cols) for _ in rows])
            for ka, row in enumerate(table):
                for kb, t in enumerate(row):
                    acc[ka][kb] += t
    # outputs are returned replicated
    for v in g.outputs[:len(g.outputs) - nupd]:
        if isinstance(v, Value) and v.is_tensor:
            cv, a = _source(prob, v)
            if a is not None:
                for k in range(len(choices[a].options)):
                    choices[a].comm[k] += model.transition(cv, _place(prob, cv, a, k),
                                                           Replicate(), False)[0]
