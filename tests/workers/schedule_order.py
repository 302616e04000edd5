"""torch's single-stage schedules (ScheduleGPipe, Schedule1F1B) run on gloo with tiny stages,
each rank recording the compute actions it executes, written to OUT/order<rank>.json
(tests/test_pipeline_schedule.py compares them with passes/pipeline_schedule.py's order).
Four ranks: one pipeline of 4, and two pipelines of 2 (ranks 0-1 and 2-3)."""
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed import pipelining

dist.init_process_group("gloo")
rank = dist.get_rank()
groups = {4: dist.new_group([0, 1, 2, 3]), 2: [dist.new_group([0, 1]), dist.new_group([2, 3])]}


def record(stage, log):
    forward, backward = stage.forward_one_chunk, stage.backward_one_chunk

    def fwd(mb, *a, **k):
        log.append(f"{stage.stage_index}F{mb}")
        return forward(mb, *a, **k)

    def bwd(mb, *a, **k):
        log.append(f"{stage.stage_index}B{mb}")
        return backward(mb, *a, **k)
    stage.forward_one_chunk, stage.backward_one_chunk = fwd, bwd


runs = []
for ranks, m in ((4, 4), (4, 6), (2, 2), (2, 3), (2, 5)):
    group = groups[4] if ranks == 4 else groups[2][rank // 2]
    p = dist.get_rank(group)
    for name in ("ScheduleGPipe", "Schedule1F1B"):
        torch.manual_seed(0)
        stage = pipelining.PipelineStage(
            torch.nn.Linear(4, 4), p, ranks, "cpu", group=group,
            input_args=(torch.empty(1, 4, device="meta", requires_grad=p > 0),),
            output_args=(torch.empty(1, 4, device="meta", requires_grad=True),))
        log: list[str] = []
        record(stage, log)
        schedule = getattr(pipelining, name)(stage, n_microbatches=m,
                                             loss_fn=lambda out, _t: out.sum())
        x = torch.randn(m, 4)
        if p == 0:
            schedule.step(x)
        elif p == ranks - 1:
            schedule.step(target=x, losses=[])
        else:
            schedule.step()
        runs.append({"schedule": name, "ranks": ranks, "m": m, "pipe_rank": p, "actions": log})
with open(os.path.join(sys.argv[1], f"order{rank}.json"), "w") as f:
    json.dump(runs, f)
dist.destroy_process_group()
