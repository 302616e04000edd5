"""Bucketed gradient reduction, like DistributedDataParallel's reducer.

Which group a gradient is summed over follows from the plan: a gradient that is a partial sum
over the plan unit is summed there; every gradient is then averaged over the data-parallel
units (one all-reduce over the world for partial gradients when both apply):

    before backward:  p.grad = (nothing)            every rank: its local gradient g_r
    after backward:   p.grad = scale * sum_{r in G} g_r      scale = 1 / data-parallel size

Gradients are packed in reverse parameter order into buckets of about `bucket_cap_mb`, one
flat all-reduce per bucket (in async mode the first closes at 1 MiB, as DDP's does). Each
bucket is multiplied by `scale` just before its all-reduce (in place; a gradient held outside
the bucket is scaled as it is copied in), as DDP divides by the world size before it, so
nothing is left to do to a bucket once its all-reduce ends.

Gradients land in their buckets once (DDP's gradient_as_bucket_view). Each parameter has a
post-accumulate-grad hook: a fresh `.grad` (the first backward, or any after
`zero_grad(set_to_none=True)`) is copied into the parameter's view of its bucket's flat buffer
and `.grad` becomes that view, so the fresh tensor is freed as soon as it was accumulated and
a gradient never exists twice; a later backward (accumulation, with or without no_sync)
accumulates into the view in place and nothing is copied:

    before:  backward: p.grad = g (fresh, every parameter)  end: bucket <- copy of every g
    now:     backward: p.grad = g -> bucket view <- g, p.grad = view (g freed)   end: nothing

Where gradients are reduced in another dtype (`reduce_dtype`) `.grad` cannot be a view: it
stays a tensor of the parameter's dtype, copied into the bucket when the bucket launches.

When to reduce. With `async_=True` the same hook launches a bucket as soon as its last
gradient is accumulated, overlapping communication with the rest of backward. Otherwise
(sync) the hooks only land gradients: `watch(outputs)`, called on every forward's outputs,
puts one pre-hook on their autograd nodes, and the first backward through them that reaches
a parameter's gradient queues one callback that reduces all buckets once backward ends (a
backward that does not pass through the module's outputs, or `torch.autograd.grad` for inputs
only, reduces nothing). Either way buckets launch in index order on every rank so the
collectives match, and a callback queued on the autograd engine waits for them before
`loss.backward()` returns.

Each bucket keeps one flat buffer; after reduction `.grad` is still a view into it, so the
reduced values are not copied back. The buffer is reused by the next backward: clone a
`.grad` you want to keep across steps.

A gradient no rank of the group computed (a parameter unused in this step) stays None, as in
DDP: each bucket carries one flag per parameter after its gradients, summed with them, and a
rank that lacked a gradient reads the flags (the only case that reads them back).

`no_sync()` turns reduction off: gradients accumulate locally and the next synced backward
reduces the accumulated sum. Accumulating *without* no_sync also matches DDP: the already
reduced part A is identical across G, so it is pre-scaled by c = 1 / (|G| * scale) just
before the next gradient is added (scale * sum_G(c*A + g_r) = A + scale * sum_G g_r); for
plain data parallelism c is 1 and nothing is registered for it; otherwise a tensor hook on
the parameter applies it.

`reduce_now()` reduces every bucket from the current `.grad` at once (a pipeline schedule
runs its backwards under no_sync, then calls it); `reset()` forgets a backward that raised;
`sink` (ZeRO-2) takes each reduced bucket instead of `.grad` (the buffer is then freed, and
allocated again when the next gradient lands); `overlapped` counts the buckets the last
backward launched before it ended (0 in sync mode). With a single bucket there is
nothing to overlap, and async mode runs the sync trigger.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from nncompile import compat
from ..protocol.hang_report import wait_for
from ..store import user_hooks
from ..store.user_hooks import ours

_will_execute = compat.will_engine_execute_node()
FIRST_BUCKET_MB = 1.0


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
    views: list[torch.Tensor] = field(default_factory=list)   # one per param, into buffer
    launched: bool = False

    missing: list[int] | None = None    # params with no local gradient in this backward

    def allocate(self) -> None:
        # one flag per parameter after the gradients: summed, it says whether any rank of
        # the group computed that gradient
        self.buffer = torch.empty(self.numel + len(self.params), dtype=self.dtype,
                                  device=self.params[0].device)
        self.views, offset = [], 0
        for p in self.params:
            n = p.numel()
            self.views.append(self.buffer[offset:offset + n].view_as(p))
            offset += n

    def free(self) -> None:
        self.buffer, self.views = None, []


class Reducer:
    def __init__(self, params: list[tuple[torch.nn.Parameter, object, int, float]], *,
                 bucket_cap_mb: float = 25.0, async_: bool = False,
                 reduce_dtype: torch.dtype | None = None):
        """params: (parameter, group, group size, scale) in registration order."""
        self.async_ = async_
        self.sync = True
        self.buckets: list[Bucket] = []
        self._where: dict[int, Bucket] = {}
        self._prescaled: set[int] = set()        # id(param) of those with c != 1
        self._reduced: set[int] = set()          # of those, the ones whose .grad is reduced
        self._next = 0
        self._queued = False
        self.overlapped = 0        # buckets the last backward launched before it ended
        self.on_finish: list = []  # called once a reduction ended (module_views relinks .grad)
        self.sink = None           # ZeRO-2: takes each reduced bucket (params, views); the
                                   # bucket's buffer and the .grad are then freed
        cap = bucket_cap_mb * 2 ** 20
        # async: the first bucket of each group closes at 1 MiB (as DDP's does), so its
        # all-reduce starts while most of backward is still to run
        first_cap = min(cap, FIRST_BUCKET_MB * 2 ** 20) if async_ else cap
        open_: dict[tuple, Bucket] = {}
        limit: dict[tuple, float] = {}     # the open bucket's size limit, per key
        index: dict[int, int] = {}         # id(param) -> its place in its bucket
        self._acc_nodes = []       # sync: the parameters' AccumulateGrad nodes (kept alive)
        for param, group, size, scale in reversed(params):
            dtype = reduce_dtype or param.dtype
            key = (id(group), param.dtype, dtype, scale)
            b = open_.get(key)
            if b is None or b.numel * dtype.itemsize >= limit[key]:
                limit[key] = first_cap if b is None else cap
                b = open_[key] = Bucket([], group, scale, dtype)
                self.buckets.append(b)
            index[id(param)] = len(b.params)
            b.params.append(param)
            b.numel += param.numel()
            self._where[id(param)] = b
        # one bucket overlaps nothing (it is ready when backward ends): the sync trigger then
        # does the same, and the per-parameter hook only lands the gradient in its bucket
        self.async_ = async_ = async_ and len(self.buckets) > 1
        self._params = [p for p, _, _, _ in params]
        self._deferred: dict[int, torch.nn.Parameter] = {}   # user hooks: runtime/store/user_hooks.py
        for param, group, size, scale in reversed(params):
            b = self._where[id(param)]
            # a gradient of the bucket's dtype lives in its bucket (gradient_as_bucket_view);
            # one reduced in another dtype is copied (and converted) when its bucket launches
            land = self._lander(b, index[id(param)]) if b.dtype == param.dtype else None
            if async_:
                param.register_post_accumulate_grad_hook(ours(
                    self._on_grad if land is None else self._landing_trigger(land)))
            else:
                if land is not None:
                    param.register_post_accumulate_grad_hook(ours(land))
                if _will_execute is not None:
                    with torch.enable_grad():
                        self._acc_nodes.append(param.view_as(param).grad_fn.next_functions[0][0])
            prescale = 1.0 / (size * scale)
            if abs(prescale - 1.0) > 1e-12:
                self._prescaled.add(id(param))
                param.register_hook(self._prescale_hook(param, prescale))

    # ---- triggers ------------------------------------------------------------------------
    def watch(self, outputs) -> None:
        """Sync mode: a backward through any of these forward outputs reduces the gradients
        when it ends (one pre-hook per distinct autograd node; nothing per parameter)."""
        self._deferred = user_hooks.defer(self._params)   # run after the reduction
        if self.async_:
            return
        if isinstance(outputs, torch.Tensor):
            outputs = (outputs,)
        seen: list = []
        for t in outputs:
            node = t.grad_fn if isinstance(t, torch.Tensor) else None
            if node is not None and not any(node is s for s in seen):
                seen.append(node)
                node.register_prehook(self._on_backward)

    def _on_backward(self, grad_outputs):
        if self.sync and not self._queued and (
                _will_execute is None or any(map(_will_execute, self._acc_nodes))):
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        return None

    # ---- gradients land in their buckets ---------------------------------------------------
    @staticmethod
    def _lander(b: Bucket, i: int):
        """The post-accumulate-grad hook of parameter `i` of bucket `b`: a fresh `.grad` is
        copied into its view of the bucket (allocated if the bucket was freed) and `.grad`
        becomes that view, so the fresh tensor dies at once and later backwards accumulate
        into the view in place; a `.grad` that already is the view is left alone."""
        def land(p: torch.nn.Parameter) -> None:
            g = p.grad
            if b.buffer is None:
                b.allocate()
            view = b.views[i]
            if g is view or g.dtype != view.dtype:   # in place already / module cast since
                return
            view.copy_(g.detach() if g.requires_grad else g)    # (create_graph=True)
            p.grad = view
        return land

    def _landing_trigger(self, land):
        """Async mode's hook: land the gradient, then launch the buckets that are ready."""
        on_grad = self._on_grad

        def hook(p: torch.nn.Parameter) -> None:
            land(p)
            on_grad(p)
        return hook

    def _prescale_hook(self, param: torch.nn.Parameter, c: float):
        pid = id(param)

        def hook(grad: torch.Tensor):
            if pid in self._reduced:
                self._reduced.discard(pid)
                if param.grad is not None:
                    with torch.no_grad():
                        param.grad.mul_(c)
            return None
        return hook

    def _on_grad(self, param: torch.nn.Parameter) -> None:
        """Async mode: launch every bucket, in index order, whose gradients are all in."""
        if not self.sync:
            return
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        b = self._where[id(param)]
        b.ready.add(id(param))
        if len(b.ready) == len(b.params):
            buckets = self.buckets
            while self._next < len(buckets) and \
                    len(buckets[self._next].ready) == len(buckets[self._next].params):
                self._launch(buckets[self._next])
                self._next += 1

    # ---- reduction -----------------------------------------------------------------------
    def _launch(self, b: Bucket) -> None:
        grads = [p.grad for p in b.params]
        if b.buffer is None:
            b.allocate()
        flags = b.buffer[b.numel:]
        flags.fill_(1)
        b.missing = [i for i, g in enumerate(grads) if g is None] or None
        s = b.scale
        for i, (g, view) in enumerate(zip(grads, b.views)):
            if g is None:
                view.zero_()
                flags[i] = 0
            elif g is view or (g.data_ptr() == view.data_ptr() and g.dtype == view.dtype
                               and g.stride() == view.stride()):
                if s != 1.0:                    # accumulated in place: scale it there
                    view.mul_(s)
            elif s != 1.0 and g.dtype == view.dtype:
                torch.mul(g, s, out=view)       # copy and scale in one pass
            else:
                view.copy_(g)
                if s != 1.0:
                    view.mul_(s)
        b.work = dist.all_reduce(b.buffer, group=b.group, async_op=True)
        b.launched = True

    def _finish(self) -> None:
        self.overlapped = sum(b.launched for b in self.buckets)
        for b in self.buckets[self._next:]:
            self._launch(b)
        for b in self.buckets:
            if b.launched:
                wait_for(b.work, b.group)       # (where the hang watch sees it)
                # a gradient no rank of the group computed stays None, as in DDP (an optimizer
                # then skips the parameter instead of stepping it with zeros)
                used = list(range(len(b.params)))
                if b.missing:                   # read the flags only where one is missing
                    counts = b.buffer[b.numel:].tolist()
                    used = [i for i in used if i not in b.missing or counts[i] > 0]
                if self.sink is not None:
                    self.sink([b.params[i] for i in used], [b.views[i] for i in used])
                    for p in b.params:
                        p.grad = None
                    b.free()
                else:
                    for i in used:
                        p, view = b.params[i], b.views[i]
                        p.grad = view if view.dtype == p.dtype else view.to(p.dtype)
                    if self._prescaled:
                        self._reduced.update(id(b.params[i]) for i in used
                                             if id(b.params[i]) in self._prescaled)
                b.missing = None
            b.ready.clear()
            b.work, b.launched = None, False
        self._next = 0
        self._queued = False
        for fn in self.on_finish:
            fn()
        if self._deferred:
            user_hooks.run(self._deferred)

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
