"""The pipeline schedule in the IR (passes/pipeline_schedule.py): each pipeline rank's action
order equals the order torch.distributed.pipelining's schedule class of that name runs, its
sends and receives meet, and a rank file declares it (ACTIONS)."""
import json

import pytest
import torch
import torch.distributed as dist
from torch.distributed import pipelining

from nncompile.errors import ConfigError
from nncompile.ir.schedule import Action, parse_actions
from nncompile.passes.pipeline_schedule import compute_order, schedule_actions


def _torch_order(cls_name: str, ranks: int, v: int, m: int) -> dict[int, list[str]]:
    """pipeline_order of torch's multi-stage schedule class (built on a fake process group:
    its order is computed for every rank in the constructor), compute actions only
    (DualPipeV's overlapped pairs included)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=ranks)
    try:
        n = ranks * v
        ids = [0, n - 1] if cls_name in ("ScheduleZBVZeroBubble", "ScheduleDualPipeV") \
            else range(0, n, ranks)
        stages = [pipelining.PipelineStage(torch.nn.Linear(2, 2), s, n, "cpu") for s in ids]
        schedule = getattr(pipelining, cls_name)(stages, n_microbatches=m,
                                                 loss_fn=lambda o, t: o.sum())
        return {p: [str(a) for a in acts if a is not None and
                    a.computation_type.value in ("F", "B", "I", "W", "OVERLAP_F_B")]
                for p, acts in schedule.pipeline_order.items()}
    finally:
        dist.destroy_process_group()


def _ours(name, ranks, v, m):
    return {p: [str(a) for a in acts] for p, acts in compute_order(name, ranks, v, m).items()}


@pytest.mark.parametrize("ranks,v,m", [(2, 1, 4), (2, 2, 2), (2, 2, 4), (2, 2, 8), (4, 2, 8), (4, 2, 4),
                                       (2, 3, 6), (2, 4, 8), (4, 3, 12), (3, 2, 6)])
def test_interleaved_1f1b_is_torchs_order(ranks, v, m):
    assert _ours("interleaved_1f1b", ranks, v, m) == \
        _torch_order("ScheduleInterleaved1F1B", ranks, v, m)


@pytest.mark.parametrize("ranks,v,m", [(2, 1, 4), (4, 1, 8), (2, 3, 4), (2, 3, 6), (4, 4, 8), (2, 4, 2), (4, 3, 4)])
def test_interleaved_zero_bubble_is_torchs_order(ranks, v, m):
    assert _ours("zero_bubble", ranks, v, m) == \
        _torch_order("ScheduleInterleavedZeroBubble", ranks, v, m)


@pytest.mark.parametrize("ranks,m", [(2, 2), (2, 4), (2, 5), (4, 8), (4, 4), (3, 7)])
def test_zbv_is_torchs_order(ranks, m):
    assert _ours("zero_bubble", ranks, 2, m) == _torch_order("ScheduleZBVZeroBubble", ranks, 2, m)


def test_single_stage_schedules_are_the_order_torch_runs(run_ranks, tmp_path):
    """GPipe and 1F1B run their own loops in torch (not an action list): the order each rank
    executed on gloo, recorded per forward and backward, is the IR's."""
    run_ranks("tests/workers/schedule_order.py", 4, str(tmp_path))
    runs = [run for r in range(4) for run in json.loads((tmp_path / f"order{r}.json").read_text())]
    assert len(runs) == 4 * 5 * 2
    names = {"ScheduleGPipe": "gpipe", "Schedule1F1B": "1f1b"}
    for run in runs:
        ours = compute_order(names[run["schedule"]], run["ranks"], 1, run["m"])
        assert [str(a) for a in ours[run["pipe_rank"]]] == run["actions"], run


def test_sends_meet_receives_and_every_rank_runs_each_step_once():
    for name, ranks, v, m in [("gpipe", 4, 1, 4), ("1f1b", 4, 1, 6), ("interleaved_1f1b", 2, 2, 4),
                              ("zero_bubble", 2, 2, 4), ("zero_bubble", 2, 3, 6),
                              ("dualpipev", 2, 2, 4), ("dualpipev", 3, 2, 9)]:
        acts = schedule_actions(name, ranks, v, m)
        every = [a for r in acts.actions.values() for a in r]
        placed = acts.stage_rank()
        for a in every:        # a send on one rank, its receive on the neighbour's
            if a.kind in ("SEND_F", "SEND_B"):
                peer = a.stage + (1 if a.kind == "SEND_F" else -1)
                assert Action(peer, "RECV" + a.kind[4:], a.microbatch) in \
                    acts.actions[placed[peer]], (name, a)
        for r, line in acts.compute.items():
            steps = [x for a in line for x in a.steps()]      # overlapped pairs: both parts
            assert len(steps) == len(set(steps)), (name, r)
            for s in {a.stage for a in steps}:
                mine = [a for a in steps if a.stage == s]
                # each micro-batch: one forward, and one full backward or its two halves
                assert sorted(a.microbatch for a in mine if a.kind == "F") == list(range(m))
                full = {a.microbatch for a in mine if a.kind == "B"}
                halves = [a.microbatch for a in mine if a.kind == "I"]
                assert sorted(halves) == sorted(a.microbatch for a in mine if a.kind == "W")
                assert sorted(full | set(halves)) == list(range(m)) and not full & set(halves)
                assert (name == "zero_bubble") <= (not full), (name, s)
        # the rank file's form parses back to the same lists
        table = {p: acts.text(p) for p in range(ranks)}
        assert parse_actions(table) == acts.actions


def test_bad_orders_are_config_errors():
    with pytest.raises(ConfigError, match="multiple of 2"):
        schedule_actions("interleaved_1f1b", 2, 2, 5)
    with pytest.raises(ValueError, match="not a pipeline action"):
        Action.parse("0X1")


@pytest.mark.parametrize("ranks,m", [(2, 4), (2, 5), (2, 8), (3, 6), (4, 8), (4, 11)])
def test_dualpipev_is_torchs_order(ranks, m):
    ours = _ours("dualpipev", ranks, 2, m)
    assert ours == _torch_order("ScheduleDualPipeV", ranks, 2, m)
    assert any("OVERLAP_F_B" in a for a in ours[0])       # the steady state overlaps


def test_dualpipev_actions_print_and_parse_back():
    acts = schedule_actions("dualpipev", 2, 2, 8)
    for p in range(2):
        line = acts.text(p)
        assert "(0F" in line or "(1F" in line or "(2F" in line or "(3F" in line
        assert " ".join(map(str, parse_actions({p: line})[p])) == line
        # every (stage, kind, micro-batch) step runs once, overlapped or not
        steps = [str(x) for a in acts.compute[p] for x in a.steps()]
        assert len(steps) == len(set(steps)) == 2 * 8 * 2 + sum(
            x.kind == "I" for a in acts.compute[p] for x in a.steps())
    with pytest.raises(ValueError, match="a forward then a backward"):
        Action.parse("(0B1;1F0)OVERLAP_F_B")


def test_dualpipev_needs_two_micro_batches_per_stage():
    with pytest.raises(ConfigError, match="microbatches >= 4"):
        compute_order("dualpipev", 2, 2, 3)


@pytest.mark.parametrize("schedule,v", [("dualpipev", 2), ("zero_bubble", 2), ("zero_bubble", 1)])
def test_a_stage_with_parameters_off_its_inputs_path_runs_its_backward_whole(schedule, v):
    """Hugging Face BART in 2 x V stages: the stage that embeds the decoder tokens (shared
    embedding, decoder positions, layernorm_embedding) reads them off the path from the
    encoder output it receives. torch's split backward (I, then W) misses those gradients
    (measured under DualPipeV, pp 2 x dp 2: the shared weight's gradient norm 0.401 against
    one device's 0.417, the loss 4e-5 off after one step), so that stage runs B; a stage
    whose parameters all sit on its inputs' path keeps its I/W split."""
    import models
    from nncompile import ComputeConfig
    from nncompile.frontend import trace
    from nncompile.ir import PARAM
    from nncompile.passes import build_pipeline, get_policy, run_pipeline
    from nncompile.passes.pipeline_schedule import whole_backward_stages
    torch.manual_seed(0)
    model, batch = models.build("hf_bart"), models.batch("hf_bart", 0)
    cfg = ComputeConfig(2, 2, parallel={"pp": 2, "schedule": schedule, "microbatches": 4,
                                        "stages_per_rank": v})
    g = run_pipeline(trace(model, batch), build_pipeline(cfg, get_policy("tp"))).graph
    embeds = {op.stage for op in g.ops for x in op.tensor_inputs()
              if x.kind == PARAM and "decoder.embed_positions" in (x.fqn or "")}
    assert len(embeds) == 1 and embeds <= whole_backward_stages(g)
    steps = [x for line in g.plan_state.pipeline.actions.compute.values() for a in line
             for x in a.steps()]
    (stage,) = embeds
    assert not any(a.kind in "IW" and a.stage == stage for a in steps)
    assert sum(a.kind == "B" and a.stage == stage for a in steps) == 4
    assert any(a.kind == "I" for a in steps)      # the other stages keep the split
