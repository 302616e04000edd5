"""nncompile.verify: run the parallel module and a single-device copy on the same batch and
report the largest errors of the loss and of every gradient.

Run it under torchrun (every rank calls it); each plan unit gets the same dummy batch, so the
data-parallel average equals the single-device gradient.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as pytree

from .config import ComputeConfig
from .frontend import normalize_args


@dataclass
class VerifyReport:
    loss_error: float
    errors: dict[str, tuple[float, float]] = field(default_factory=dict)  # fqn: (abs, rel)
    rtol: float = 1e-5
    atol: float = 1e-6
    loss_ref: float = 0.0                                    # |single-device loss|
    ref_max: dict[str, float] = field(default_factory=dict)  # fqn: max |single-device grad|

    @property
    def ok(self) -> bool:
        return all(a <= self.atol + self.rtol * r for a, r in self._bounds())

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
                 f"(rtol={self.rtol:g}, atol={self.atol:g})",
                 f"  loss       abs err {self.loss_error:.3e}"]
        for fqn, a, r in self.worst(len(self.errors)):
            lines.append(f"  {fqn:<40} max abs err {a:.3e}  max rel err {r:.3e}")
        return "\n".join(lines)


def _scalar_loss(out: Any) -> torch.Tensor:
    leaves = [x for x in pytree.tree_leaves(out) if isinstance(x, torch.Tensor)]
    return leaves[0] if leaves[0].dim() == 0 else leaves[0].float().sum()


def verify(module: torch.nn.Module, dummy_args: Any, compute_config: ComputeConfig,
           pas_policy: Any, *, gen_savedir: str = "./.nncompile", rtol: float = 1e-5,
           atol: float = 1e-6) -> VerifyReport:
    """Compare parallel loss and gradients with a single-device run; return the report."""
    from .api import parallelize

    args, kwargs = normalize_args(module, dummy_args)
    ref = copy.deepcopy(module)
    ref_loss = _scalar_loss(ref(*args, **kwargs))
    ref_loss.backward()
    ref_grads = {name: (p.grad if p.grad is not None else torch.zeros_like(p))
                 for name, p in ref.named_parameters()}
    pm = parallelize(copy.deepcopy(module), dummy_args, compute_config, pas_policy=pas_policy,
                     gen_savedir=gen_savedir, reuse="override",
                     instance_name=f"verify_{type(module).__name__}")
    loss = _scalar_loss(pm(*args, **kwargs))
    loss.backward()
    grads = pm.gather_grads()
    report = VerifyReport(float((loss.detach() - ref_loss.detach()).abs()), rtol=rtol, atol=atol)
    report.loss_ref = float(ref_loss.detach().abs())
    for fqn, g in grads.items():
        want = ref_grads[fqn]
        diff = (g - want).abs()
        report.errors[fqn] = (float(diff.max()), float((diff / want.abs().clamp_min(1e-12)).max()))
        report.ref_max[fqn] = float(want.abs().max())
    return report
