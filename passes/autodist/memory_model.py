"""Training state per rank under a ZeRO stage and offload, and the time they add.

Per rank, with P / F the bytes of this rank's local (plan-sharded) trainable / frozen
parameters, e = P / itemsize their elements, s the optimizer state bytes per element
(`optimizer_state_bytes`, Adam 8) and Z = dp_size x C // zero_ngroups the ZeRO group (C the
context-parallel ranks, which hold the same parameters: nncompile.mesh.replica_dims):

    stage  parameters    gradients  optimizer state     transient (communication buffers)
    0      P + F         P          s e                 -
    1      P + F         P          s e / Z + P / Z     -
    2      P + F         P / Z      s e / Z + P / Z     one full gradient bucket
    3      (P + F) / Z   P / Z      s e / Z             2 x the largest unit's P + F

P / Z is the copy of the owned shard that stages 1 and 2 step (stage 3 steps the shard itself;
with offload_optimizer alone, a host copy of it). A ZeRO-3 unit is a block of a ModuleList
(`h.3`), else the module owning the parameter; the forward holds a gathered unit and the
prefetched next one, backward a re-gathered unit and its full gradient. The gradient bucket
is min(reducer_bucket_cap_mb MiB, the full trainable bytes). `offload_optimizer` moves the
optimizer state (and the shard copy) to host memory, `offload_params` (stage 3) the parameter
and gradient shards: host bytes are not device bytes.

Time per step, per parameter of local bytes B (the cost model's alpha-beta collectives):

    stage 0    all_reduce(B) over the data-parallel ranks              (CostModel.grad_reduce)
    stage 1    all_reduce(B) + all_gather(B) over Z                    (updated shards back)
    stage 2    reduce_scatter(B) over Z + all_gather(B) over Z
    stage 3    reduce_scatter(B) + 2 all_gather(B) over Z              (forward and backward)
               frozen parameters: 2 all_gather(B)
               a weight gathered in float8 (passes/float8.py zero3_gather): B / itemsize

With zero_ngroups > 1 a reduce_scatter adds an all_reduce of B / Z across the groups. Host
copies take bytes / `DeviceProfile.host_bytes_per_s`: offload_optimizer copies the gradient
shard to the host and the updated shard back (2 B / Z; stage 0: Z = 1); offload_params copies
each unit's shard to the device before both gathers and the gradient shard to the host
(2 B / Z + B / Z). Recompute (problem.py) drops a module's saved activations but the ones it
hands on, and runs its forward again in backward.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from nncompile.ir import PARAM, Graph, MemoryChoice, Placement, Value

from .cost_model import CostModel, nbytes
from .ilp import memory_by_rank, memory_of
from .problem import Choice, Problem

UNIT_COPIES = 2.0           # ZeRO-3 transient: two gathered units (or a unit and its gradient)


@dataclass
class StateBytes:
    """One parameter's training state on one rank, by where it lives (bytes)."""
    parameters: float = 0.0
    gradients: float = 0.0
    optimizer_state: float = 0.0
    host: float = 0.0

    @property
    def device(self) -> float:
        return self.parameters + self.gradients + self.optimizer_state


def unit_of(fqn: str) -> str:
    """The ZeRO-3 unit of a parameter, as the generated code gathers them: its ModuleList
    block (`h.3`), else the module owning it (`lm_head`), else `root`."""
    parts = fqn.split(".")[:-1]
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:i + 1])
    return ".".join(parts) or "root"


@dataclass
class MemoryModel:
    model: CostModel
    zero_group: int = 1             # Z: ranks one ZeRO shard group spans
    zero_ngroups: int = 1
    bucket_cap: float = 25 * 2 ** 20   # bytes of one gradient bucket (reducer_bucket_cap_mb)
    # weights ZeRO-3 gathers in float8, one byte per element (passes/float8.py zero3_gather)
    float8_gathered: frozenset = frozenset()

    @classmethod
    def of(cls, model: CostModel, config, graph: Graph | None = None) -> "MemoryModel":
        f8 = (graph.plan_state.float8 or {}) if graph is not None else {}
        return cls(model, max(1, config.dp_size * model.context // config.zero_ngroups),
                   config.zero_ngroups,
                   float(config.reducer_bucket_cap_mb) * 2 ** 20,
                   frozenset(fqn for fqn, how in f8.get("zero3_gather", {}).items()
                             if how == "float8"))

    def gathered_bytes(self, v: Value, b: float) -> float:
        """What a ZeRO-3 gather of `v` (`b` bytes in its dtype) moves: 1 byte per element
        where it is gathered in float8."""
        return b / v.meta.dtype.itemsize if v.fqn in self.float8_gathered else b

    def _z(self, choice: MemoryChoice) -> int:
        return self.zero_group if choice.zero else 1

    def state(self, v: Value, placement: Placement, choice: MemoryChoice) -> StateBytes:
        """Where parameter `v`'s state lives under `placement` and `choice`."""
        local = nbytes(v, placement, self.model.n) * self.model.param_share(v)
        z = self._z(choice)
        if not (self.model.training and v.requires_grad):       # frozen: the values only
            p = local / z if choice.zero == 3 else local
            return StateBytes(host=p) if choice.zero == 3 and choice.offload_params \
                else StateBytes(parameters=p)
        e = local / v.meta.dtype.itemsize
        s = self.model.optimizer_state_bytes
        if choice.zero == 0:
            out = StateBytes(local, local, e * s)
        elif choice.zero == 1:
            out = StateBytes(local, local, (e * s + local) / z)
        elif choice.zero == 2:
            out = StateBytes(local, local / z, (e * s + local) / z)
        else:
            out = StateBytes(local / z, local / z, e * s / z)
        if choice.offload_optimizer:
            out.host, out.optimizer_state = out.host + out.optimizer_state, 0.0
            if choice.zero == 3 and not choice.offload_params:
                out.host += local / z                       # the host copy it steps
        if choice.zero == 3 and choice.offload_params:
            out.host += out.parameters + out.gradients
            out.parameters = out.gradients = 0.0
        return out

    def param_time(self, v: Value, placement: Placement, choice: MemoryChoice) -> float:
        """Seconds per step of `v`'s gradient reduction, ZeRO gathers and host copies."""
        m = self.model
        if not m.training:
            return 0.0
        b = nbytes(v, placement, m.n)
        z = self._z(choice)
        span = z * m.n
        gather = m.collective("all_gather", b, group=z, span=span)
        if choice.zero == 3:
            gather = m.collective("all_gather", self.gathered_bytes(v, b), group=z, span=span)
        trainable = v.requires_grad
        t = 0.0
        if trainable:
            if choice.zero <= 1:
                t += m.grad_reduce(v, placement)
            else:
                t += m.collective("reduce_scatter", b, group=z, span=span)
                if self.zero_ngroups > 1:
                    t += m.collective("all_reduce", b / z, group=self.zero_ngroups,
                                      span=m.dp * m.context * m.n)
            if choice.zero in (1, 2):
                t += gather
        if choice.zero == 3:
            t += 2 * gather
        offload_params = choice.zero == 3 and choice.offload_params
        host = 0.0
        if trainable and (choice.offload_optimizer or offload_params):
            host += b / z                                   # gradient shard to the host
        if offload_params:
            host += 2 * b / z                               # shard to the device, twice
        elif trainable and choice.offload_optimizer:
            host += b / z                                   # updated shard back
        return t + host / m.profile.host_bytes_per_s

    def optimizer_time(self, v: Value, placement: Placement, choice: MemoryChoice) -> float:
        """Seconds of the optimizer step on this rank's share of `v`: its 1/Z shard under
        ZeRO 1-3, nothing with optimizer offload (the host's step is not timed)."""
        if choice.offload_optimizer:
            return 0.0
        return self.model.optimizer_step(v, placement, self._z(choice))

    def bucket_bytes(self, g: Graph) -> float:
        """Stage 2's transient full gradient bucket."""
        if not self.model.training:
            return 0.0
        full = sum(nbytes(v) for v in g.params if v.requires_grad)
        return min(self.bucket_cap, full)

    def units(self, g: Graph, prob: Problem) -> list[dict[int, list[float]]]:
        """ZeRO-3 units as {choice: local bytes per option}, one per distinct unit."""
        per: dict[str, dict[int, list[float]]] = {}
        for v in g.params:
            cv = prob.vcanon[id(v)]
            c = prob.choice_of.get(id(cv))
            if c is None or not v.fqn:
                continue
            row = [self.gathered_bytes(v, nbytes(cv, opt, self.model.n))
                   for opt in prob.choices[c].options]
            unit = per.setdefault(unit_of(v.fqn), {})
            unit[c] = [a + b for a, b in zip(unit[c], row)] if c in unit else row
        distinct = {repr(sorted(u.items())): u for u in per.values()}
        return list(distinct.values())

    def derive(self, g: Graph, prob: Problem, choice: MemoryChoice) -> Problem:
        """`prob` with its parameters' memory and time under `choice` (the same problem for
        stage 0 without offload: the cost model's own terms)."""
        if (choice.zero == 0 and not choice.offload_optimizer) or not self.model.training:
            return prob
        choices: list[Choice] = []
        for ch in prob.choices:
            v = ch.value
            if v is None or v.kind != PARAM:
                choices.append(ch)
                continue
            memory, comm, compute = list(ch.memory), list(ch.comm), list(ch.compute)
            for k, opt in enumerate(ch.options):
                memory[k] = ch.count * self.state(v, opt, choice).device
                comm[k] += ch.count * (self.param_time(v, opt, choice)
                                       - self.model.grad_reduce(v, opt))
                compute[k] += ch.count * (self.optimizer_time(v, opt, choice)
                                          - self.model.optimizer_step(v, opt))
            choices.append(dataclasses.replace(ch, memory=memory, comm=comm, compute=compute))
        fixed = self.bucket_bytes(g) if choice.zero == 2 else 0.0
        peaks = [(UNIT_COPIES, self.units(g, prob))] if choice.zero == 3 else []
        return dataclasses.replace(prob, choices=choices, fixed_memory=fixed, peaks=peaks)

    def breakdown(self, prob: Problem, choice: MemoryChoice, picks: list[int]) -> dict:
        """Bytes per rank by kind for a plan of `prob` (derived for `choice`), and host bytes
        (under a pipeline: of the fullest pipeline rank)."""
        out = dict.fromkeys(("parameters", "gradients", "optimizer_state", "activations"), 0.0)
        host = 0.0
        ranks = memory_by_rank(prob, picks)     # under a pipeline: the fullest rank's bytes
        w = prob.groups[ranks.index(max(ranks))] if prob.groups else [1.0] * len(picks)
        for c, (ch, k) in enumerate(zip(prob.choices, picks)):
            if ch.value is None:
                out["activations"] += w[c] * ch.memory[k]
            elif ch.value.kind == PARAM:
                st = self.state(ch.value, ch.options[k], choice)
                out["parameters"] += w[c] * ch.count * st.parameters
                out["gradients"] += w[c] * ch.count * st.gradients
                out["optimizer_state"] += w[c] * ch.count * st.optimizer_state
                host += w[c] * ch.count * st.host
            else:                           # buffers and constants
                out["parameters"] += w[c] * ch.memory[k]
        inside = sum(w[c] * ch.memory[k] for c, (ch, k) in enumerate(zip(prob.choices, picks)))
        out["communication_buffers"] = max(0.0, memory_of(prob, picks) - inside)
        table = {key: int(round(val)) for key, val in out.items()}
        table["total"] = sum(table.values())
        return {"per_rank_bytes": table, "host_bytes": int(round(host))}


def leanest_picks(prob: Problem) -> list[int]:
    """The plan of `prob` needing the least memory: every term grows with a choice's own
    bytes (a unit's bytes with its parameters' local sizes), so each choice's leanest option
    is the plan's, peaks included."""
    picks = []
    for ch in prob.choices:
        if ch.value is not None:
            sizes = [nbytes(ch.value, opt, prob.model.n) for opt in ch.options]
            picks.append(min(range(len(ch.options)), key=lambda k: (ch.memory[k], sizes[k])))
        else:
            picks.append(min(range(len(ch.options)), key=lambda k: ch.memory[k]))
    return picks
