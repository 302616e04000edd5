"""The pipeline schedule as data: each pipeline rank's ordered actions.

An action is one step a pipeline rank takes, written as torch.distributed.pipelining writes it
(stage, kind, micro-batch):

    1F0        stage 1's forward of micro-batch 0
    1B0        its full backward
    1I0 / 1W0  the backward split in two: the input gradient (sent on at once), then the
               weight gradient (zero-bubble schedules run it later, in a bubble)
    (0F3;3B1)OVERLAP_F_B
               one step made of a forward and a backward of other micro-batches (DualPipeV),
               which a GPU overlaps (their communication hides behind the other's compute);
               torch's runtime runs its parts in order
    1SEND_F0   send stage 1's output of micro-batch 0 to stage 2's rank
    2RECV_F0   receive it there
    2SEND_B0   send the gradient of stage 2's input back; 1RECV_B0 receives it

`PipelineActions.compute` is the schedule proper (what runs, in which order, on which
pipeline rank); `PipelineActions.actions` adds the sends and receives between ranks, which is
what a rank executes (runtime/program/pipeline.py hands it to torch's action-list runtime). Both are
made by passes/pipeline_schedule.py and printed in every rank file (ACTIONS).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

COMPUTE = ("F", "B", "I", "W")
COMMS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
OVERLAP = "OVERLAP_F_B"
_ACTION = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|B|I|W)(\d+)$")
_OVERLAP = re.compile(r"^\(([^()]*)\)OVERLAP_F_B$")


@dataclass(frozen=True)
class Action:
    stage: int
    kind: str            # one of COMPUTE + COMMS, or OVERLAP (then stage = microbatch = -1)
    microbatch: int
    parts: tuple["Action", ...] = ()     # OVERLAP: its forward and its backward, in order

    def __str__(self) -> str:
        if self.kind == OVERLAP:
            return f"({';'.join(map(str, self.parts))}){OVERLAP}"
        return f"{self.stage}{self.kind}{self.microbatch}"

    @staticmethod
    def overlap(forward: "Action", backward: "Action") -> "Action":
        """One step of a forward and a backward (of other micro-batches) run together."""
        return Action(-1, OVERLAP, -1, (forward, backward))

    def steps(self) -> tuple["Action", ...]:
        """The compute steps this action runs: its parts, or itself."""
        return self.parts if self.kind == OVERLAP else (self,)

    @staticmethod
    def parse(text: str) -> "Action":
        m = _OVERLAP.match(text)
        if m is not None:
            parts = tuple(Action.parse(t) for t in m.group(1).split(";"))
            if [p.kind for p in parts] not in (["F", "B"], ["F", "I"]):
                raise ValueError(f"{text!r}: an overlapped step is a forward then a backward, "
                                 "e.g. '(0F3;3B1)OVERLAP_F_B'")
            return Action(-1, OVERLAP, -1, parts)
        m = _ACTION.match(text)
        if m is None:
            raise ValueError(f"{text!r} is not a pipeline action (stage, kind, micro-batch: "
                             "'1F0', '0I3', '2SEND_F1', '(0F3;3B1)OVERLAP_F_B', ...)")
        return Action(int(m.group(1)), m.group(2), int(m.group(3)))


@dataclass
class PipelineActions:
    """One step's schedule: per pipeline rank, its compute actions in order, and the same
    with the sends and receives that connect the ranks."""
    schedule: str                       # the schedule's name (pipeline_config.SCHEDULES)
    ranks: int                          # S
    stages_per_rank: int                # V
    microbatches: int                   # M
    compute: dict[int, list[Action]] = field(default_factory=dict)
    actions: dict[int, list[Action]] = field(default_factory=dict)

    def text(self, pipe_rank: int, comms: bool = True) -> str:
        """A rank's actions as one line, e.g. '0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 ...'."""
        return " ".join(map(str, (self.actions if comms else self.compute)[pipe_rank]))

    def stage_rank(self) -> dict[int, int]:
        """stage index -> the pipeline rank that runs it."""
        return {a.stage: r for r, acts in self.compute.items() for x in acts for a in x.steps()}


def parse_actions(table: dict) -> dict[int, list[Action]]:
    """A rank file's ACTIONS ({pipe rank: 'action action ...'}) as Action lists."""
    return {int(r): [Action.parse(a) for a in line.split()] for r, line in table.items()}
