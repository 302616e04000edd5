"""Data for a job that changes its number of data-parallel units: the batch arithmetic, and a
sampler whose global order a checkpoint carries across layouts (DataParallelSampler).

    accumulation_steps(global_batch=32, micro_batch=4, dp_units=4)   # -> 2
    accumulation_steps(global_batch=32, micro_batch=4, dp_units=2)   # -> 4, after a resume
                                                                      #    on half the ranks
"""
from __future__ import annotations

import torch

from nncompile.errors import ConfigError


def accumulation_steps(global_batch: int, micro_batch: int, dp_units: int) -> int:
    """The gradient-accumulation steps that keep `global_batch` samples per optimizer step when
    each of `dp_units` data-parallel units (world size // plan_ngpus) runs micro-batches of
    `micro_batch` samples; a ConfigError when they do not divide it."""
    for name, v in (("global_batch", global_batch), ("micro_batch", micro_batch),
                    ("dp_units", dp_units)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ConfigError(f"accumulation_steps: {name}={v!r} must be a positive integer")
    per_step = micro_batch * dp_units
    if global_batch % per_step:
        raise ConfigError(
            f"accumulation_steps: a global batch of {global_batch} does not split into "
            f"micro-batches of {micro_batch} on {dp_units} data-parallel units "
            f"({per_step} samples per micro-step); choose a micro-batch that divides "
            f"{global_batch // dp_units if global_batch % dp_units == 0 else 'it'} or "
            f"another global batch")
    return global_batch // per_step


class DataParallelSampler:
    """A batch sampler whose order survives a restart on another number of data-parallel
    units: the global sample order is a function of (seed, epoch) alone, the state is the
    global position in it, and each unit takes its share of every global micro-step.

        sampler = nncompile.DataParallelSampler(len(dataset), micro_batch=4, pm=pm, seed=0)
        loader = DataLoader(dataset, batch_sampler=sampler)      # num_workers=0, or torchdata's
                                                                 # StatefulDataLoader
        nncompile.save_checkpoint(dir, pm, opt, format="dcp", data=sampler)
        nncompile.load_checkpoint(dir, pm, opt, data=sampler)    # any number of units

    A global micro-step takes the next micro_batch * dp_units samples of the epoch's order;
    unit u gets the u-th run of micro_batch of them. So 8 samples per optimizer step split as
    [0:4] [4:8] over 2 units, as [0:2] ... [6:8] over 4 units of micro-batches of 2, and as
    [0:4] then [4:8] in two accumulation steps on one unit: every layout sees the same global
    batches. The order is a torch.randperm seeded with seed + epoch (shuffle=False: 0..n-1);
    an incomplete last global micro-step is dropped. When an epoch is used up the next
    iteration starts the next one (set_epoch, as torch's DistributedSampler, also works).

    The state (`state_dict()`: seed, epoch, position) counts the samples handed out, which
    is what training consumed when the loader fetches batches as they are used (a DataLoader
    with num_workers=0). A loader with workers fetches ahead: wrap it in torchdata's
    StatefulDataLoader, which saves this sampler's state as of the batches it yielded.
    """

    def __init__(self, dataset_or_len, micro_batch: int, *, pm=None, dp_rank: int | None = None,
                 dp_units: int | None = None, seed: int = 0, shuffle: bool = True):
        n = dataset_or_len if isinstance(dataset_or_len, int) else len(dataset_or_len)
        if pm is not None:
            if dp_rank is not None or dp_units is not None:
                raise ConfigError("DataParallelSampler: pass pm or dp_rank and dp_units, "
                                  "not both")
            dp_rank, dp_units = pm.dp_rank, pm.dp_size
        dp_rank = 0 if dp_rank is None else dp_rank
        dp_units = 1 if dp_units is None else dp_units
        for name, v in (("micro_batch", micro_batch), ("dp_units", dp_units)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"DataParallelSampler: {name}={v!r} must be a positive "
                                  "integer")
        if not 0 <= dp_rank < dp_units:
            raise ConfigError(f"DataParallelSampler: dp_rank={dp_rank} is not a unit of "
                              f"0..{dp_units - 1}")
        if n < micro_batch * dp_units:
            raise ConfigError(
                f"DataParallelSampler: {n} samples are fewer than one global micro-step "
                f"({micro_batch} samples on each of {dp_units} units); use a smaller "
                "micro_batch or more data")
        self.num_samples, self.micro_batch = n, micro_batch
        self.dp_rank, self.dp_units = dp_rank, dp_units
        self.seed, self.shuffle = seed, shuffle
        self.epoch, self.position = 0, 0
        self._order: tuple[int, torch.Tensor] | None = None

    @property
    def global_micro_batch(self) -> int:
        return self.micro_batch * self.dp_units

    def order(self, epoch: int) -> torch.Tensor:
        """The global sample order of `epoch` (the same for every layout)."""
        if self._order is None or self._order[0] != epoch:
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed + epoch)
                perm = torch.randperm(self.num_samples, generator=g)
            else:
                perm = torch.arange(self.num_samples)
            self._order = (epoch, perm)
        return self._order[1]

    def set_epoch(self, epoch: int) -> None:
        """Start `epoch` from its beginning; a no-op for the epoch under way (a resumed one
        continues), as in a loop `for e in range(start, n): sampler.set_epoch(e); ...`."""
        if epoch != self.epoch:
            self.epoch, self.position = epoch, 0

    def __len__(self) -> int:
        """Micro-batches this unit gets in one epoch."""
        return self.num_samples // self.global_micro_batch

    def __iter__(self):
        step = self.global_micro_batch
        if self.position + step > self.num_samples:     # the epoch was used up
            self.epoch, self.position = self.epoch + 1, 0
        order = self.order(self.epoch)
        while self.position + step <= self.num_samples:
            start = self.position + self.dp_rank * self.micro_batch
            self.position += step
            yield order[start:start + self.micro_batch].tolist()

    def state_dict(self) -> dict:
        return {"seed": self.seed, "epoch": self.epoch, "position": self.position,
                "num_samples": self.num_samples, "shuffle": self.shuffle}

    def load_state_dict(self, state: dict) -> None:
        """Continue where `state` stopped, whatever layout saved it; a state of another
        dataset, seed or shuffling is refused (it would not continue the same order)."""
        mine = {"seed": self.seed, "num_samples": self.num_samples, "shuffle": self.shuffle}
        other = {k: state.get(k) for k in mine}
        if other != mine:
            raise ConfigError(
                f"DataParallelSampler.load_state_dict: the saved sampler had {other}, this one "
                f"has {mine}; build the sampler with the saved seed and dataset")
        if state["position"] % self.global_micro_batch:
            raise ConfigError(
                f"DataParallelSampler.load_state_dict: the saved position {state['position']} "
                f"is not a whole number of this job's global micro-steps "
                f"({self.micro_batch} x {self.dp_units} units = {self.global_micro_batch}); "
                "choose a micro_batch whose global micro-step divides the saved global batch")
        self.epoch, self.position = state["epoch"], state["position"]
