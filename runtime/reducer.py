"""Bucketed gradient reduction, like DistributedDataParallel's reducer.

Which group a gradient is summed over follows from the plan: a gradient that is a partial sum
over the plan unit is summed there; every gradient is then averaged over the data-parallel
units (one all-reduce over the world for partial gradients when both apply):

    before backward:  p.grad = (nothing)            every rank: its local gradient g_r
    after backward:   p.grad = scale * sum_{r in G} g_r      scale = 1 / data-parallel size

Gradients are packed in reverse parameter order into buckets of about `bucket_cap_mb`, one
flat all-reduce per bucket. With `async_=True` a bucket is launched as soon as its last
gradient is accumulated, overlapping communication with the rest of backward; otherwise all
buckets are reduced once backward ends. Buckets launch in index order on every rank so the
collectives match. A callback queued on the autograd engine waits for them before
`loss.backward()` returns. Each bucket keeps one flat buffer; after reduction `.grad` is a view
into it (as DDP's gradient_as_bucket_view), so the reduced values are not copied back, and a
gradient accumulated in place into its view is not copied in either. The buffer is reused by
the next backward: clone a `.grad` you want to keep across steps.

`no_sync()` turns reduction off: gradients accumulate locally and the next synced backward
reduces the accumulated sum. Accumulating *without* no_sync also matches DDP: the already
reduced part A is identical across G, so it is pre-scaled by c = 1 / (|G| * scale) just
before the next gradient is added (scale * sum_G(c*A + g_r) = A + scale * sum_G g_r); for
plain data parallelism c is 1.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class Bucket:
    params: list[torch.nn.Parameter]
    group: object
    scale: float
    dtype: torch.dtype
    numel: int = 0
    ready: set = field(default_factory=set)
    work: object = None
    buffer: torch.Tensor | None = None
    launched: bool = False

    def views(self):
        offset = 0
        for p in self.params:
            n = p.numel()
            yield p, self.buffer[offset:offset + n].view_as(p)
            offset += n


class Reducer:
    def __init__(self, params: list[tuple[torch.nn.Parameter, object, int, float]], *,
                 bucket_cap_mb: float = 25.0, async_: bool = False,
                 reduce_dtype: torch.dtype | None = None):
        """params: (parameter, group, group size, scale) in registration order."""
        self.async_ = async_
        self.sync = True
        self.buckets: list[Bucket] = []
        self._where: dict[int, Bucket] = {}
        self._reduced: dict[int, bool] = {}
        self._next = 0
        self._queued = False
        self.overlapped = 0        # buckets the last backward launched before it ended
        self.sink = None           # ZeRO-2: takes each reduced bucket (params, views); the
                                   # bucket's buffer and the .grad are then freed
        cap = bucket_cap_mb * 2 ** 20
        open_: dict[tuple, Bucket] = {}
        for param, group, size, scale in reversed(params):
            dtype = reduce_dtype or param.dtype
            key = (id(group), param.dtype, dtype, scale)
            b = open_.get(key)
            if b is None or b.numel * dtype.itemsize >= cap:
                b = open_[key] = Bucket([], group, scale, dtype)
                self.buckets.append(b)
            b.params.append(param)
            b.numel += param.numel()
            self._where[id(param)] = b
            param.register_post_accumulate_grad_hook(self._on_grad)
            prescale = 1.0 / (size * scale)
            if abs(prescale - 1.0) > 1e-12:
                param.register_hook(self._prescale_hook(param, prescale))

    # ---- hooks ---------------------------------------------------------------------------
    def _prescale_hook(self, param: torch.nn.Parameter, c: float):
        def hook(grad: torch.Tensor):
            if self._reduced.pop(id(param), False) and param.grad is not None:
                with torch.no_grad():
                    param.grad.mul_(c)
            return None
        return hook

    def _on_grad(self, param: torch.nn.Parameter) -> None:
        if not self.sync:
            return
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        b = self._where[id(param)]
        b.ready.add(id(param))
        if self.async_:
            while self._next < len(self.buckets) and \
                    len(self.buckets[self._next].ready) == len(self.buckets[self._next].params):
                self._launch(self.buckets[self._next])
                self._next += 1

    # ---- reduction -----------------------------------------------------------------------
    def _launch(self, b: Bucket) -> None:
        if all(p.grad is None for p in b.params):   # nothing flowed here on any rank of G
            return
        if b.buffer is None:
            b.buffer = torch.empty(b.numel, dtype=b.dtype, device=b.params[0].device)
        for p, view in b.views():
            if p.grad is None:
                view.zero_()
            elif p.grad.data_ptr() != view.data_ptr() or p.grad.dtype != view.dtype:
                view.copy_(p.grad.reshape(view.shape))
        b.work = dist.all_reduce(b.buffer, group=b.group, async_op=True)
        b.launched = True

    def _finish(self) -> None:
        self.overlapped = sum(b.launched for b in self.buckets)
        for b in self.buckets[self._next:]:
            self._launch(b)
        for b in self.buckets:
            if b.launched:
                b.work.wait()
                if b.scale != 1.0:
                    b.buffer.mul_(b.scale)
                if self.sink is not None:
                    params, views = zip(*b.views())
                    self.sink(list(params), list(views))
                    for p in b.params:
                        p.grad = None
                    b.buffer = None
                    b.ready.clear()
                    b.work, b.launched = None, False
                    continue
                for p, view in b.views():
                    if view.dtype == p.dtype:
                        p.grad = view
                    else:
                        p.grad = view.to(p.dtype)
                    self._reduced[id(p)] = True
            b.ready.clear()
            b.work, b.launched = None, False
        self._next = 0
        self._queued = False

    def reduce_now(self) -> None:
        """Reduce every bucket from the current .grad now (after a pipeline schedule ran all
        its backwards with sync off)."""
        self._next = 0
        self._finish()

    def reset(self) -> None:
        """Forget a backward that did not finish (it raised before the final callback)."""
        if self._queued:
            for b in self.buckets:
                if b.work is not None:
                    b.work.wait()
                b.ready.clear()
                b.work, b.launched = None, False
            self._next = 0
            self._queued = False
