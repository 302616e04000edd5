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
    if global_batch % dp_units:
        raise ConfigError(
            f"accumulation_steps: a global batch of {global_batch} does not split over "
            f"{dp_units} data-parallel units; choose a global batch that is a multiple of "
            f"{dp_units}")
    if global_batch % per_step:
        raise ConfigError(
            f"accumulation_steps: a global batch of {global_batch} does not split into "
            f"micro-batches of {micro_batch} on {dp_units} data-parallel units "
            f"({per_step} samples per micro-step); choose a micro-batch that divides "
            f"{global_batch // dp_units} or another global batch")
    return global_batch // per_step


class DataParallelSampler:
    """A batch sampler whose order survives a restart on another number of data-parallel
    units: the global sample order is a function of (seed, epoch) alone, the state is the
    global position in it, and each unit takes its share of every global micro-step.

        sampler = nncompile.DataParallelSampler(len(dataset), micro_batch=4, pm=pm,
                                                global_batch=32, seed=0)
        loader = DataLoader(dataset, batch_sampler=sampler)      # num_workers=0, or torchdata's
                                                                 # StatefulDataLoader
        for _ in range(sampler.accumulation_steps): ...          # micro-batches per step
        nncompile.save_checkpoint(dir, pm, opt, format="dcp", data=sampler)
        nncompile.load_checkpoint(dir, pm, opt, data=sampler)    # any number of units

    A global micro-step takes the next micro_batch * dp_units samples of the epoch's order;
    unit u gets the u-th run of micro_batch of them. So 8 samples per optimizer step split as
    [0:4] [4:8] over 2 units, as [0:2] ... [6:8] over 4 units of micro-batches of 2, and as
    [0:4] then [4:8] in two accumulation steps on one unit: every layout sees the same global
    batches. The order is a torch.randperm seeded with seed + epoch (shuffle=False: 0..n-1).
    When an epoch is used up the next iteration starts the next one (set_epoch, as torch's
    DistributedSampler, also works).

    The last global batch. `global_batch` (samples per optimizer step over all units; default
    micro_batch * dp_units, no accumulation) cuts every epoch into whole global batches, the
    same on every layout that keeps it: with drop_last=True (the default) the samples after
    the last whole global batch are left out of that epoch; with drop_last=False the last
    global batch is filled up with the epoch's first samples, as torch's DistributedSampler
    pads. Give every layout the same global_batch and drop_last: left at its default,
    global_batch follows the layout, and one of another global micro-step would cut the epoch
    elsewhere (load_state_dict refuses a state whose epochs were cut to another length).

    The state (`state_dict()`: seed, epoch, position, and the epoch's cut) counts the samples
    handed out, which is what training consumed when the loader fetches batches as they are
    used (a DataLoader with num_workers=0). A loader with workers fetches ahead: wrap it in
    torchdata's StatefulDataLoader, which saves this sampler's state as of the batches it
    yielded.
    """

    def __init__(self, dataset_or_len, micro_batch: int, *, pm=None, dp_rank: int | None = None,
                 dp_units: int | None = None, global_batch: int | None = None, seed: int = 0,
                 shuffle: bool = True, drop_last: bool = True):
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
        global_batch = micro_batch * dp_units if global_batch is None else global_batch
        self._accumulation = accumulation_steps(global_batch, micro_batch, dp_units)
        self.num_samples, self.micro_batch = n, micro_batch
        self.dp_rank, self.dp_units = dp_rank, dp_units
        self.global_batch, self.drop_last = global_batch, bool(drop_last)
        self.seed, self.shuffle = seed, shuffle
        if self.samples_per_epoch == 0:
            raise ConfigError(
                f"DataParallelSampler: {n} samples are fewer than one global batch "
                f"({global_batch}: micro-batches of {micro_batch} on {dp_units} units, "
                f"{self._accumulation} per step); use a smaller global batch, drop_last=False, "
                "or more data")
        self.epoch, self.position = 0, 0
        self._order: tuple[int, torch.Tensor] | None = None

    @property
    def global_micro_batch(self) -> int:
        return self.micro_batch * self.dp_units

    @property
    def accumulation_steps(self) -> int:
        """Micro-batches each unit runs per optimizer step (global_batch // global micro-step)."""
        return self._accumulation

    @property
    def samples_per_epoch(self) -> int:
        """The samples an epoch hands out: whole global batches (see the class docstring)."""
        return _epoch_samples(self.num_samples, self.global_batch, self.drop_last)

    def order(self, epoch: int) -> torch.Tensor:
        """The samples of `epoch` in global order (the same for every layout): its permutation
        of the dataset, cut or filled up to whole global batches."""
        if self._order is None or self._order[0] != epoch:
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed + epoch)
                perm = torch.randperm(self.num_samples, generator=g)
            else:
                perm = torch.arange(self.num_samples)
            length = self.samples_per_epoch
            perm = perm.repeat(-(-length // self.num_samples))[:length]
            self._order = (epoch, perm)
        return self._order[1]

    def set_epoch(self, epoch: int) -> None:
        """Start `epoch` from its beginning; a no-op for the epoch under way (a resumed one
        continues), as in a loop `for e in range(start, n): sampler.set_epoch(e); ...`."""
        if epoch != self.epoch:
            self.epoch, self.position = epoch, 0

    def __len__(self) -> int:
        """Micro-batches this unit gets in one epoch."""
        return self.samples_per_epoch // self.global_micro_batch

    def __iter__(self):
        step, end = self.global_micro_batch, self.samples_per_epoch
        if self.position + step > end:                  # the epoch was used up
            self.epoch, self.position = self.epoch + 1, 0
        order = self.order(self.epoch)
        while self.position + step <= end:
            start = self.position + self.dp_rank * self.micro_batch
            self.position += step
            yield order[start:start + self.micro_batch].tolist()

    def state_dict(self) -> dict:
        return {"seed": self.seed, "epoch": self.epoch, "position": self.position,
                "num_samples": self.num_samples, "shuffle": self.shuffle,
                "global_batch": self.global_batch, "drop_last": self.drop_last}

    def load_state_dict(self, state: dict) -> None:
        """Continue where `state` stopped, whatever layout saved it; a state of another
        dataset, seed, shuffling or epoch length is refused (it would not continue the same
        order). A state without global_batch (saved by an earlier nncompile) continues at its
        position with this sampler's cut of the epoch."""
        mine = {"seed": self.seed, "num_samples": self.num_samples, "shuffle": self.shuffle}
        other = {k: state.get(k) for k in mine}
        if other != mine:
            raise ConfigError(
                f"DataParallelSampler.load_state_dict: the saved sampler had {other}, this one "
                f"has {mine}; build the sampler with the saved seed and dataset")
        if "global_batch" in state:
            saved = _epoch_samples(self.num_samples, state["global_batch"], state["drop_last"])
            if saved != self.samples_per_epoch:
                raise ConfigError(
                    f"DataParallelSampler.load_state_dict: the saved sampler cut each epoch of "
                    f"{self.num_samples} samples into global batches of {state['global_batch']} "
                    f"(drop_last={state['drop_last']}: {saved} samples an epoch), this one "
                    f"into global batches of {self.global_batch} (drop_last={self.drop_last}: "
                    f"{self.samples_per_epoch}), so the global batches would differ; build it "
                    f"with global_batch={state['global_batch']}, drop_last={state['drop_last']}")
        if state["position"] % self.global_micro_batch:
            raise ConfigError(
                f"DataParallelSampler.load_state_dict: the saved position {state['position']} "
                f"is not a whole number of this job's global micro-steps "
                f"({self.micro_batch} x {self.dp_units} units = {self.global_micro_batch}); "
                "choose a micro_batch whose global micro-step divides the saved global batch")
        self.epoch, self.position = state["epoch"], state["position"]


def _epoch_samples(num_samples: int, global_batch: int, drop_last: bool) -> int:
    """The samples of an epoch cut (drop_last) or filled up to whole global batches."""
    whole, rest = divmod(num_samples, global_batch)
    return (whole + (rest > 0 and not drop_last)) * global_batch
