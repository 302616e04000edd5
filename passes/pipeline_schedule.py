"""pipeline_schedule: each pipeline rank's ordered actions for one training step, in the IR.

pipeline_stages chose S pipeline ranks, V stages per rank and M micro-batches; this pass
writes down what every pipeline rank does in a step, in order (nncompile/ir/schedule.py):
forwards, backwards (full, or split into input- and weight-gradient steps), and the sends
and receives between ranks. The runtime executes exactly this list (runtime/program/pipeline.py,
through torch.distributed.pipelining's action-list runtime); it is printed in every rank
file (ACTIONS) and in plan.json, and each schedule of pipeline_config.SCHEDULES is a function
below that yields the order torch's schedule class of that name runs:

    gpipe               every forward, then every backward
    1f1b                S - p forwards of warm-up, then one backward, one forward, ...
    interleaved_1f1b    Megatron's interleaving over V stages per rank, depth first
    zero_bubble         the same with the backward split (I then W, W deferred), V stages in
                        loop placement; with V = 2 the V-shaped ZB-V order
    dualpipev           DeepSeek's DualPipe folded into a V (2 stages per rank): in the
                        steady state each step is one stage's forward overlapped with the
                        other stage's backward (OVERLAP_F_B), so on a GPU each hides the
                        other's communication (MoE all-to-alls)

Before (plan_state.pipeline: S=2, V=1, M=2, "1f1b", no actions):
After  (plan_state.pipeline.actions):
    rank 0:  0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1
    rank 1:  1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1

A stage holding a parameter off the path from its inputs (an embedding of token ids in a
middle stage) runs its backward whole (B) instead of I then W: torch's split backward
computes the weight gradient from what the input gradient's pass saved, which never reaches
such a parameter (`whole_backward_stages`).

The sends and receives are placed by torch's own lowering (the one its schedules use), so a
receive comes after the matching send is posted and no order can deadlock. An order whose
dependencies cannot be met is a ConfigError naming the schedule. Idempotent: yes.
"""
from __future__ import annotations

from dataclasses import replace

from nncompile import compat
from nncompile.errors import ConfigError
from nncompile.ir import PARAM, Graph, Stage
from nncompile.ir.schedule import OVERLAP, Action, PipelineActions

from .contract import contract


def gpipe(ranks: int, m: int) -> dict[int, list[Action]]:
    """Every forward of the micro-batches, then their backwards, in order."""
    return {p: [Action(p, "F", i) for i in range(m)] + [Action(p, "B", i) for i in range(m)]
            for p in range(ranks)}


def one_f_one_b(ranks: int, m: int) -> dict[int, list[Action]]:
    """Rank p runs S - p forwards (warm-up), then alternates backward / forward until every
    forward ran, then the remaining backwards."""
    order = {}
    for p in range(ranks):
        warm = min(m, ranks - p)
        acts = [Action(p, "F", i) for i in range(warm)]
        for i in range(m):
            acts.append(Action(p, "B", i))
            if warm + i < m:
                acts.append(Action(p, "F", warm + i))
        order[p] = acts
    return order


def interleaved(ranks: int, v: int, m: int, zero_bubble: bool = False
                ) -> dict[int, list[Action]]:
    """V stages per rank in loop placement (rank p holds p, p + S, ...). Micro-batches go
    through in rounds of M / rounds (rounds = max(1, M // S)): a rank runs a round's forwards
    on its first stage, then on its next, and backwards the other way round. Warm-up is
    (V - 1) rounds plus two forwards per rank to the last (one with zero_bubble), then one
    forward, one backward. With zero_bubble the backward is the input gradient (I) and rank p
    defers its weight gradients (W) by p steps, running the rest at the end."""
    rounds = max(1, m // ranks)
    if m % rounds:
        raise ConfigError(f"the {'zero_bubble' if zero_bubble else 'interleaved_1f1b'} "
                          f"schedule runs the micro-batches in {rounds} rounds of "
                          f"{m // rounds}, so it needs M a multiple of {rounds}; got "
                          f"microbatches={m} on {ranks} pipeline ranks")
    per_round = m // rounds
    total = v * m                      # forwards (and backwards) of a rank
    back = "I" if zero_bubble else "B"
    order = {}
    for p in range(ranks):
        warm = min((v - 1) * per_round + (1 if zero_bubble else 2) * (ranks - 1 - p), total)

        def fwd_stage(k):
            return (k // per_round) % v * ranks + p

        def bwd_stage(k):
            return (v - 1 - (k - warm) // per_round % v) * ranks + p
        nf: dict[int, int] = {}
        nb: dict[int, int] = {}
        nw: dict[int, int] = {}
        backwards: list[int] = []      # the stage of each backward, for its deferred W
        acts: list[Action] = []

        def take(counter, stage):
            counter[stage] = counter.get(stage, 0) + 1
            return counter[stage] - 1
        for k in range(total + warm):
            if k < total:
                s = fwd_stage(k)
                acts.append(Action(s, "F", take(nf, s)))
            if k >= warm:
                s = bwd_stage(k)
                acts.append(Action(s, back, take(nb, s)))
                backwards.append(s)
                if zero_bubble and k - warm >= p:
                    s = backwards[sum(nw.values())]
                    acts.append(Action(s, "W", take(nw, s)))
        while zero_bubble and sum(nw.values()) < len(backwards):
            s = backwards[sum(nw.values())]
            acts.append(Action(s, "W", take(nw, s)))
        order[p] = acts
    return order


def zero_bubble_v(ranks: int, m: int) -> dict[int, list[Action]]:
    """ZB-V: rank p holds stages p and 2S - 1 - p (a V). Warm-up fills the V with forwards
    (2(S - p) - 1 on the first stage, then p pairs, then S - p forward + I + W on the second),
    the steady state runs F/I/W on the first stage then on the second, and the cool-down runs
    the remaining input gradients, then weight gradients. Planned for max(M, 2S - 1)
    micro-batches; those beyond M are dropped."""
    n = max(m, 2 * ranks - 1)
    order = {}
    for p in range(ranks):
        a, b = p, 2 * ranks - 1 - p
        cnt = {(a, "F"): 0, (b, "F"): 0, (a, "I"): 0, (b, "I"): 0, (a, "W"): 0, (b, "W"): 0}
        acts: list[Action] = []

        def run(*steps):               # (stage, kind) pairs, each on its next micro-batch
            for stage, kind in steps:
                acts.append(Action(stage, kind, cnt[stage, kind]))
                cnt[stage, kind] += 1
        for _ in range(2 * (ranks - p) - 1):
            run((a, "F"))
        for _ in range(p):
            run((b, "F"), (a, "F"))
        for _ in range(ranks - p):
            run((b, "F"), (b, "I"), (b, "W"))
        while cnt[b, "F"] < cnt[a, "F"] or cnt[a, "F"] < n:
            if cnt[a, "F"] < n:
                run((a, "F"))
            run((a, "I"), (a, "W"), (b, "F"), (b, "I"), (b, "W"))
        for _ in range(p):
            run((a, "I"), (b, "I"))
        for _ in range(ranks - p):
            run((a, "I"), (a, "W"))
        while cnt[b, "W"] < cnt[b, "I"]:
            run((b, "W"))
        while cnt[a, "W"] < cnt[a, "I"]:
            run((a, "W"))
        order[p] = [x for x in acts if x.microbatch < m]
    return order


def dualpipe_v(ranks: int, m: int) -> dict[int, list[Action]]:
    """DualPipeV: rank p holds stages a = p and b = 2S - 1 - p (a V). Warm-up: 2(S - 1 - p)
    forwards on a, then p + 1 pairs (a, b), then S - 1 - p times b's input gradient, a
    deferred W, b's forward. Main: M - 2S + p + 1 rounds of two overlapped steps (a's
    forward with b's backward, then b's forward with a's backward; the last rank runs its
    first a-forward and b-backward apart). Then S - 1 - p times b's backward with an
    overlapped (b forward, a backward); p + 1 pairs of backwards on b and a, whose second half
    splits into I (W deferred); S - 1 - p (W, a backward); and the deferred Ws. Needs
    M >= 2S."""
    if m < 2 * ranks:
        raise ConfigError(f"the 'dualpipev' schedule needs at least as many micro-batches as "
                          f"stages (2 per pipeline rank): microbatches={m} on {ranks} pipeline "
                          f"ranks; use microbatches >= {2 * ranks}")
    order = {}
    for p in range(ranks):
        a, b = p, 2 * ranks - 1 - p
        fwd = {a: 0, b: 0}
        bwd = {a: 0, b: 0}
        deferred: list[Action] = []         # weight gradients owed, oldest first
        acts: list[Action] = []

        def step(stage: int, kind: str) -> Action:
            counter = fwd if kind == "F" else bwd
            act = Action(stage, kind, counter[stage])
            counter[stage] += 1
            if kind == "I":
                deferred.append(Action(stage, "W", act.microbatch))
            return act

        def run(stage: int, kind: str) -> None:
            acts.append(step(stage, kind))

        def overlap(f_stage: int, b_stage: int) -> None:
            acts.append(Action.overlap(step(f_stage, "F"), step(b_stage, "B")))

        def owed_w() -> None:
            if deferred:
                acts.append(deferred.pop(0))
        for _ in range(2 * (ranks - 1 - p)):
            run(a, "F")
        for _ in range(p + 1):
            run(a, "F")
            run(b, "F")
        for _ in range(ranks - 1 - p):
            run(b, "I")
            owed_w()
            run(b, "F")
        for i in range(m - 2 * ranks + p + 1):
            if i == 0 and p == ranks - 1:       # not overlapped: a smaller bubble
                run(a, "F")
                run(b, "B")
            else:
                overlap(a, b)
            overlap(b, a)
        for _ in range(ranks - 1 - p):
            run(b, "B")
            overlap(b, a)
        split = False
        for i in range(p + 1):
            if i == (p + 1) // 2 and p % 2 == 1:
                split = True
            run(b, "I" if split else "B")
            if i == (p + 1) // 2 and p % 2 == 0:
                split = True
            run(a, "I" if split else "B")
        for _ in range(ranks - 1 - p):
            owed_w()
            run(a, "I" if split else "B")
        for _ in range(p + 1):
            owed_w()
        order[p] = acts
    return order


def compute_order(schedule: str, ranks: int, v: int, m: int) -> dict[int, list[Action]]:
    """Each pipeline rank's compute actions for one step of `schedule`."""
    if schedule == "gpipe":
        return gpipe(ranks, m)
    if schedule == "1f1b":
        return one_f_one_b(ranks, m)
    if schedule == "interleaved_1f1b":
        return interleaved(ranks, v, m)
    if schedule == "zero_bubble":
        return zero_bubble_v(ranks, m) if v == 2 else interleaved(ranks, v, m, True)
    if schedule == "dualpipev":
        return dualpipe_v(ranks, m)
    raise ConfigError(f"no action order for pipeline schedule {schedule!r}")


def schedule_actions(schedule: str, ranks: int, v: int, m: int) -> PipelineActions:
    """The schedule's compute order and, with its sends and receives, what each rank runs."""
    compute = compute_order(schedule, ranks, v, m)
    placed = {a.stage: r for r, acts in compute.items() for x in acts for a in x.steps()}
    try:
        actions = compat.add_send_recv(compute, placed, ranks * v)
    except AssertionError as e:
        raise ConfigError(f"the {schedule!r} order for {ranks} pipeline ranks, {v} stage(s) "
                          f"each and {m} micro-batches has dependencies no send/receive order "
                          f"meets: {e}") from e
    return PipelineActions(schedule, ranks, v, m, compute, actions)


def whole_backward_stages(graph: Graph) -> set[int]:
    """Stages holding a parameter whose gradient does not pass through the stage's inputs:
    one read by an op none of whose inputs depends on an earlier stage's output (an
    embedding of the token ids; Hugging Face BART's decoder embeddings in a middle stage).
    torch's split backward computes the input gradient, then the weight gradient from what
    the input gradient's pass saved, and so misses such a parameter's gradient: these stages
    must run their backward whole (B)."""
    dependent: set[int] = set()
    whole: set[int] = set()
    for op in graph.ops:
        if op.stage is None:
            continue
        ins = op.tensor_inputs()
        if any(id(v) in dependent or (v.producer is not None and v.producer.stage is not None
                                      and v.producer.stage != op.stage and v.requires_grad)
               for v in ins):
            dependent.update(id(v) for v in op.outputs)
        elif any(v.kind == PARAM and v.requires_grad for v in ins):
            whole.add(op.stage)
    return whole


def whole_backwards(acts: PipelineActions, stages: set[int]) -> PipelineActions:
    """`acts` with each split backward of `stages` (I, then W) run as one full backward (B)
    where its I was; the sends and receives placed again."""
    if not stages:
        return acts

    def whole(a: Action) -> Action:
        if a.kind == OVERLAP:
            return Action.overlap(*map(whole, a.parts))
        return Action(a.stage, "B", a.microbatch) if a.kind == "I" and a.stage in stages else a
    compute = {r: [whole(a) for a in line if not (a.kind == "W" and a.stage in stages)]
               for r, line in acts.compute.items()}
    placed = {a.stage: r for r, line in compute.items() for x in line for a in x.steps()}
    return replace(acts, compute=compute, actions=compat.add_send_recv(
        compute, placed, acts.ranks * acts.stages_per_rank))


@contract(requires=(Stage.STAGED,))
def pipeline_schedule(graph: Graph) -> Graph:
    """The pass (see the module docstring)."""
    pp = graph.plan_state.pipeline
    if pp is None or pp.actions is not None:
        return graph
    g = graph.clone()
    acts = schedule_actions(pp.schedule, pp.ranks, pp.stages_per_rank, pp.microbatches)
    g.plan_state.pipeline = replace(pp, actions=whole_backwards(acts,
                                                                whole_backward_stages(g)))
    return g
