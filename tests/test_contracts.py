"""Pass contracts: run_pipeline checks each pass's `requires` before it runs and its
`produces` after, naming the pass and the stage."""
import pytest

import models
from nncompile import ComputeConfig
from nncompile.frontend import trace
from nncompile.ir import Stage
from nncompile.passes import (PassError, Plan, Recompute, build_pipeline, contract, dce,
                              get_policy, insert_comm, localize, run_pipeline)


def _graph():
    return trace(models.build("mlp"), models.batch("mlp", 0))


def test_full_pipeline_establishes_every_stage():
    cfg = ComputeConfig(2, parallel={"recompute_modules": ["Linear"]})
    result = run_pipeline(_graph(), build_pipeline(cfg, get_policy("tp")), check=True)
    # no pipeline, no ZeRO-3 asked for
    assert result.graph.stages == set(Stage) - {Stage.STAGED, Stage.SPLIT, Stage.ZERO3_LOWERED}
    stages = {name: g.stages for name, g, _ in result.history}
    assert Stage.PLANNED in stages["plan"] and Stage.COMM_INSERTED not in stages["plan"]
    assert stages["trace"] == frozenset()


@pytest.mark.parametrize("passes,name,missing", [
    ([localize], "localize", "COMM_INSERTED"),
    ([dce, insert_comm], "insert_comm", "PLANNED"),
    ([Recompute(["Linear"])], "recompute", "COMM_INSERTED"),
])
def test_unmet_requirement_names_the_pass_and_the_stage(passes, name, missing):
    with pytest.raises(PassError, match=rf"pass '{name}' requires {missing} \(.*\), which no "
                                        r"pass before it produced \(ran: \[.*\]\)"):
        run_pipeline(_graph(), passes)


def test_a_pass_that_does_not_produce_what_it_declares_is_named():
    @contract(produces=(Stage.PLANNED,))
    def fake_plan(graph):
        return graph.clone()
    with pytest.raises(PassError, match=r"pass 'fake_plan' declares it produces PLANNED"):
        run_pipeline(_graph(), [fake_plan])


def test_user_pass_without_a_contract_runs_anywhere():
    seen = []

    def count_ops(graph):
        seen.append(len(graph.ops))
        return graph
    cfg = ComputeConfig(2)
    run_pipeline(_graph(), [dce, count_ops, Plan(get_policy("tp")), insert_comm, count_ops],
                 config=cfg)
    assert len(seen) == 2 and seen[1] > seen[0]        # collectives were inserted
