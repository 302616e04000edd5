"""The checks behind nncompile.verify (nncompile/api.py): run the parallel program and a
single-device copy on the same batch and report the largest errors of the loss and of every
gradient.

Two ways to run it:
- in one process (no process group): every rank's generated program runs in its own thread
  over PyTorch's threaded process group (nncompile/tools/simulate.py), and the report also
  names the first op whose output or gradient diverges (nncompile/tools/divergence.py);
- under torchrun (every rank calls it): the real job's ranks run it; each plan unit gets the
  same dummy batch, so the data-parallel average equals the single-device gradient.

`ComputeConfig(check=True)` runs the one-process check once after compiling and refuses a plan
that diverges (PlanCheckError).
"""
from __future__ import annotations

import copy
import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ..config import ComputeConfig
from .divergence import Capture, Divergence, first_divergence, reference_run
from ..errors import ConfigError, PlanCheckError
from ..frontend import normalize_args


@dataclass
class VerifyReport:
    loss_error: float
    errors: dict[str, tuple[float, float]] = field(default_factory=dict)  # fqn: (abs, rel)
    rtol: float = 1e-5
    atol: float = 1e-6
    loss_ref: float = 0.0                                    # |single-device loss|
    ref_max: dict[str, float] = field(default_factory=dict)  # fqn: max |single-device grad|
    divergence: Divergence | None = None                     # one-process runs only
    ranks: int = 0                                           # how many ranks ran

    @property
    def ok(self) -> bool:
        return self.divergence is None and \
            all(a <= self.atol + self.rtol * r for a, r in self._bounds())

    @property
    def max_error(self) -> float:
        """The largest error relative to its tensor's scale (max(1, max |reference|))."""
        return max([a / max(1.0, r) for a, r in self._bounds()], default=0.0)

    def _bounds(self):
        """(error, reference magnitude) pairs."""
        yield self.loss_error, self.loss_ref
        for fqn, (a, _) in self.errors.items():
            yield a, self.ref_max[fqn]

    def worst(self, k: int = 5) -> list[tuple[str, float, float]]:
        rows = sorted(((f, a, r) for f, (a, r) in self.errors.items()), key=lambda x: -x[1])
        return rows[:k]

    def __str__(self) -> str:
        lines = [f"nncompile.verify: {'OK' if self.ok else 'MISMATCH'} "
                 f"(rtol={self.rtol:g}, atol={self.atol:g}"
                 + (f", {self.ranks} ranks in one process" if self.ranks else "") + ")",
                 f"  loss       abs err {self.loss_error:.3e}"]
        for fqn, a, r in self.worst(len(self.errors)):
            lines.append(f"  {fqn:<40} max abs err {a:.3e}  max rel err {r:.3e}")
        if self.divergence is not None:
            lines.append("  " + str(self.divergence).replace("\n", "\n  "))
        return "\n".join(lines)


def _scalar_loss(out: Any) -> torch.Tensor:
    leaves = [x for x in pytree.tree_leaves(out) if isinstance(x, torch.Tensor)]
    return leaves[0] if leaves[0].dim() == 0 else leaves[0].float().sum()


def _eager(module: torch.nn.Module, args: tuple, kwargs: dict):
    ref = copy.deepcopy(module)
    loss = _scalar_loss(ref(*args, **kwargs))
    loss.backward()
    grads = {name: (p.grad if p.grad is not None else torch.zeros_like(p))
             for name, p in ref.named_parameters()}
    return loss.detach(), grads


def _report(loss, ref_loss, grads, ref_grads, rtol, atol) -> VerifyReport:
    report = VerifyReport(float((loss.detach() - ref_loss).abs()), rtol=rtol, atol=atol)
    report.loss_ref = float(ref_loss.abs())
    for fqn, g in grads.items():
        if g is None:               # a frozen parameter
            continue
        want = ref_grads[fqn]
        diff = (g - want).abs()
        report.errors[fqn] = (float(diff.max()), float((diff / want.abs().clamp_min(1e-12)).max()))
        report.ref_max[fqn] = float(want.abs().max())
    return report


def eager_reference(module: torch.nn.Module, batch: Any):
    """The single-device run of `module` on `batch`: (args, kwargs, loss, grads)."""
    args, kwargs = normalize_args(module, batch)
    return (args, kwargs) + _eager(module, args, kwargs)


def compare_parallel(pm, reference, rtol: float = 1e-5, atol: float = 1e-6) -> VerifyReport:
    """Run ParallelModule `pm` on `reference`'s batch (every rank calls it) and compare its
    loss and gathered gradients with the single-device ones."""
    args, kwargs, ref_loss, ref_grads = reference
    loss = _scalar_loss(pm(*args, **kwargs))
    loss.backward()
    return _report(loss, ref_loss, pm.gather_grads(), ref_grads, rtol, atol)


def check_compiled(module: torch.nn.Module, batch: Any, config: ComputeConfig, compiled,
                   outdir: Path, rtol: float = 1e-5, atol: float = 1e-6) -> VerifyReport:
    """Run the generated files in `outdir` on `batch` (threads) against eager `module`."""
    from ..runtime.program.loader import load_rank_module
    from ..arguments import tensor_leaves
    from ..runtime.program.rng import rank_generator
    from .simulate import run_ranks

    if any(t.is_meta for t in list(module.parameters()) + list(module.buffers())):
        raise ConfigError("checking a plan needs the model's real weights, but it is on the "
                          "meta device; run nncompile.verify on a small real instance, or "
                          "drop check=True")
    args, kwargs = normalize_args(module, batch)
    seed_state = torch.get_rng_state()      # every run draws dropout masks from this state
    ref_loss, ref_grads = _eager(module, args, kwargs)
    torch.set_rng_state(seed_state)
    ref_cap, _ = reference_run(compiled.traced, module, tensor_leaves(module, args, kwargs),
                               _scalar_loss)

    def rank_fn(rank: int):
        # uncompiled: the check is about the plan, and compiling every simulated rank costs time
        # each rank its own copy: a rank's module takes over (or frees) what it shards
        pm = load_rank_module(outdir, rank, copy.deepcopy(module), None,
                              replace(config, compile=False))
        with Capture(pm.gencode_path) as cap, rank_generator(seed_state):
            out = pm(*args, **kwargs)
        cap.watch_grads()
        loss = _scalar_loss(out)
        loss.backward()
        return loss.detach(), pm.gather_grads(), cap

    results = run_ranks(config.runtime_ngpus, rank_fn)
    loss, grads, _ = results[0]
    report = _report(loss, ref_loss, grads, ref_grads, rtol, atol)
    report.ranks = config.runtime_ngpus
    report.divergence = first_divergence(compiled.final, ref_cap, [c for *_, c in results])
    return report


def refuse_if_diverges(module, dummy_args, config: ComputeConfig, compiled, outdir: Path):
    """ComputeConfig(check=True): run the one-process check; remove the files and raise when
    the plan computes something else than the model."""
    report = check_compiled(module, dummy_args, config, compiled, outdir)
    if not report.ok:
        shutil.rmtree(outdir, ignore_errors=True)
        raise PlanCheckError(f"the plan for {type(module).__name__} (policy "
                             f"{compiled.final.plan_state.policy}) does not compute what the "
                             f"model does; nothing was kept in {outdir}.\n{report}")
    return report
