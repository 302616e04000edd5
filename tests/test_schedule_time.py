"""Pricing a pipeline step from its action list (passes/schedule_time.py): the simulated
bubble of every schedule's order equals its paper's closed form, a stage that is slower shows
in the step, a send between ranks delays the receiver, and an order that cannot run is a
ConfigError."""
import pytest

from nncompile.errors import ConfigError
from nncompile.ir.schedule import Action
from nncompile.passes.pipeline_schedule import compute_order
from nncompile.passes.schedule_time import step_time, textbook_bubble

CASES = [("gpipe", s, 1, m) for s, m in [(2, 4), (2, 8), (4, 8)]] + \
        [("1f1b", s, 1, m) for s, m in [(2, 8), (3, 5), (4, 8), (4, 16)]] + \
        [("interleaved_1f1b", s, v, m) for s, v, m in [(2, 2, 8), (4, 2, 8), (2, 3, 6)]] + \
        [("zero_bubble", s, v, m) for s, v, m in [(2, 1, 8), (4, 1, 8), (2, 2, 8), (4, 2, 8),
                                                  (4, 2, 16)]] + \
        [("dualpipev", s, 2, m) for s, m in [(2, 4), (2, 8), (3, 6), (4, 8), (4, 16)]]


@pytest.mark.parametrize("schedule,ranks,v,m", CASES)
def test_simulated_bubble_is_the_papers(schedule, ranks, v, m):
    k = ranks * v
    st = step_time(compute_order(schedule, ranks, v, m), [1.0] * k, [2.0] * k)
    assert st.bubble == pytest.approx(textbook_bubble(schedule, ranks, v, m), abs=1e-12)
    assert all(busy == 3 * v * m for busy in st.busy.values())


def test_schedules_rank_as_their_papers_say():
    def bubble(name, v):
        return step_time(compute_order(name, 4, v, 8), [1.0] * 4 * v, [2.0] * 4 * v).bubble
    gpipe, ofob, inter = bubble("gpipe", 1), bubble("1f1b", 1), bubble("interleaved_1f1b", 2)
    zbh1, zbv, dpv = bubble("zero_bubble", 1), bubble("zero_bubble", 2), bubble("dualpipev", 2)
    assert gpipe == ofob > inter > zbh1 > zbv and ofob > dpv


def test_a_slow_stage_and_a_send_lengthen_the_step():
    order = compute_order("1f1b", 2, 1, 4)
    base = step_time(order, [1.0, 1.0], [2.0, 2.0]).time
    assert base == 15.0
    assert step_time(order, [1.0, 2.0], [2.0, 4.0]).time == pytest.approx(4 * 6 + 3)
    # 1F1B's rank 0 waits for each gradient round trip: two sends on its critical path
    # for the first micro-batch, one more per later one (worked by hand: 17)
    assert step_time(order, [1.0, 1.0], [2.0, 2.0], send=0.5).time == pytest.approx(17.0)


def test_an_order_that_cannot_run_is_refused():
    order = {0: [Action(0, "B", 0), Action(0, "F", 0)], 1: [Action(1, "F", 0), Action(1, "B", 0)]}
    with pytest.raises(ConfigError, match="cannot run: every rank waits"):
        step_time(order, [1.0, 1.0], [2.0, 2.0])


def test_peak_inflight_matches_the_1f1b_rule_and_counts_dualpipev():
    from nncompile.passes.pipeline_stages import stage_inflight
    from nncompile.passes.schedule_time import peak_inflight
    order = compute_order("1f1b", 4, 1, 8)
    assert [peak_inflight(order, s) for s in range(4)] == [4, 3, 2, 1]      # S - p
    dpv = compute_order("dualpipev", 2, 2, 8)
    # rank 0 holds stages 0 and 3: 2S - p forwards of stage 0 before its first backward
    assert peak_inflight(dpv, 0) == 4 and peak_inflight(dpv, 3) == 1

    class PP:
        ranks, stages_per_rank, schedule, microbatches = 2, 2, "dualpipev", 8
    assert stage_inflight(PP, 0) == 4.0 and stage_inflight(PP, 3) == 1.0
