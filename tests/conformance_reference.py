"""The conformance suite's one-device reference and the comparison with it: tests/conformance.py
says what the reference computes and why, and what is compared at which tolerance."""
from __future__ import annotations

import copy
from pathlib import Path

import torch
import torch.nn as nn

from conformance import (FORMATS, PRETRAINED, SEED, Cell, Loop, _short, build_model,
                         lr_lambda, make_reference_optimizer, micro_batch,
                         one_thread_for_float8, val_batch)


# ---- one device -------------------------------------------------------------------------
_REFS: dict = {}
_AT_CKPT: dict = {}         # (loop, units) -> the reference's state after ckpt_at steps


def run_reference(loop: Loop, units: int, resume_from: dict | None = None,
                  start: int = 0) -> list[dict]:
    """One device: per unit u, u's micro-batches from the step's generator state with u's
    BatchNorm statistics, backward of loss / accum / units; one clip + step. Returns each
    unit's records (weights alike). `resume_from`: a merged checkpoint to start from (every
    unit starts from its BatchNorm statistics)."""
    with one_thread_for_float8(loop):
        return _run_reference(loop, units, resume_from, start)


def _run_reference(loop: Loop, units: int, resume_from: dict | None, start: int) -> list[dict]:
    key = (loop, units)
    if resume_from is None and key in _REFS:
        return _REFS[key]
    model = build_model(loop, reference=True)
    opt = make_reference_optimizer(loop, model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(loop))
    if resume_from is not None:
        if resume_from["optimizer"] is None:     # Hugging Face files: weights, a tie once
            missing, extra = model.load_state_dict(resume_from["model"], strict=False)
            assert not extra and all(k in _tied(model) for k in missing), (missing, extra)
        else:
            model.load_state_dict(resume_from["model"])
            opt.load_state_dict(resume_from["optimizer"])
        sched.load_state_dict(resume_from["extra"]["sched"])
    bufs = [{k: v.clone() for k, v in model.named_buffers()} for _ in range(units)]

    def use(u):
        with torch.no_grad():
            for k, v in model.named_buffers():
                v.copy_(bufs[u][k])

    def keep(u):
        bufs[u] = {k: v.clone() for k, v in model.named_buffers()}

    recs = [{"unit": u, "train": {}, "norm": {}, "val": {}} for u in range(units)]
    for step in range(start, loop.steps):
        for u in range(units):
            use(u)
            torch.manual_seed(SEED + step)
            total = 0.0
            for m in range(loop.accum):
                part = model(**micro_batch(loop, step, m, u)) / loop.accum
                (part / units).backward()
                total += part.item()
            keep(u)
            recs[u]["train"][step] = total
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), loop.clip))
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        for r in recs:
            r["norm"][step] = norm
        if (step + 1) % loop.eval_every == 0:
            model.eval()
            with torch.no_grad():
                for u in range(units):
                    use(u)
                    recs[u]["val"][step] = model(**val_batch(loop, u)).item()
            model.train()
        if resume_from is None and step + 1 == loop.ckpt_at:     # as a merged file holds it
            use(0)
            _AT_CKPT[key] = copy.deepcopy({"model": model.state_dict(),
                                           "optimizer": opt.state_dict(),
                                           "extra": {"step": step + 1,
                                                     "sched": sched.state_dict()}})
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    for u, r in enumerate(recs):
        r["weights"] = weights
        if loop.model == "bn":
            r["buffers"] = {k: v for k, v in bufs[u].items() if v.is_floating_point()}
    if resume_from is None:
        _REFS[key] = recs
    return recs


def resumed_from_first_unit(loop: Loop, units: int) -> list[dict]:
    """The reference's rest of the loop after a resume that gives every unit the first unit's
    BatchNorm statistics (deduped, dcp, merged: docs/concepts.md)."""
    key = (loop, units, "first unit")
    if key not in _REFS:
        run_reference(loop, units)
        snap = _AT_CKPT[(loop, units)]
        _REFS[key] = run_reference(loop, units, snap, snap["extra"]["step"])
    return _REFS[key]


def _tied(model: nn.Module) -> set[str]:
    """State keys whose parameter another key also names."""
    names = dict(model.named_parameters(remove_duplicate=False))
    first = {}
    return {k for k, p in names.items() if first.setdefault(id(p), k) != k}


def pretrained_on_one_device(cell: Cell, workdir: Path) -> list[dict] | dict:
    """The reference's rest of the loop from save_pretrained's files (loaded into the original
    module on one device, as from_pretrained would), with a fresh AdamW and the scheduler's
    state at ckpt_at: per unit, as run_reference. Starting from the very weights the plan
    saved, the fresh optimizer's first update (lr * g / (|g| + eps), amplifying any difference)
    compares loading, not the rounding of the steps before."""
    from safetensors.torch import load_file
    from nncompile.pretrained_layout import find_pretrained
    path = workdir / "ckpt" / PRETRAINED
    try:
        found = find_pretrained(build_model(cell.loop))
        if found is None:
            weights = load_file(path / "model.safetensors")
        else:                           # a Hugging Face model inside: as a user reads it
            prefix, hf = found
            weights = {prefix + k: v for k, v in
                       type(hf).from_pretrained(path).state_dict().items()}
        run_reference(cell.loop, cell.units)
        snap = _AT_CKPT[(cell.loop, cell.units)]
        return run_reference(cell.loop, cell.units,
                             {"model": weights, "optimizer": None, "extra": snap["extra"]},
                             snap["extra"]["step"])
    except Exception as e:                                   # noqa: BLE001 - reported
        return {"error": _short(e)}


def merged_on_one_device(cell: Cell, workdir: Path) -> dict:
    """The merged checkpoint resumed by the original module and a plain AdamW (one device,
    per unit as run_reference); unit 0's records."""
    try:
        merged = torch.load(workdir / "ckpt" / "merged.pt", weights_only=True)
        return run_reference(cell.loop, cell.units, merged, merged["extra"]["step"])[0]
    except Exception as e:                                   # noqa: BLE001 - reported
        return {"error": _short(e)}


# ---- comparing ----------------------------------------------------------------------------
class Mismatch(AssertionError):
    """A recorded value differs from one device's; `row` is the cell's matrix row."""

    def __init__(self, message: str, row: dict):
        super().__init__(message)
        self.row = row


FEATURES = ("train", "norm", "val", "weights", "buffers",
            *(f"resume:{f}" for f in (*FORMATS, PRETRAINED)), "merged->1dev")


def _checks(rec: dict, ref: dict):
    """(what, kind, got, want) in the order they happened."""
    for step in sorted(ref["train"]):
        yield f"step {step} train loss", "train", rec["train"].get(step), ref["train"][step]
        yield f"step {step} grad norm", "norm", rec["norm"].get(step), ref["norm"][step]
        if step in ref["val"]:
            yield f"step {step} validation loss", "val", rec["val"].get(step), ref["val"][step]
    for kind in ("weights", "buffers"):
        for name, want in ref.get(kind, {}).items():
            yield f"final {kind[:-1]} {name}", kind, rec.get(kind, {}).get(name), want


def compare(cell: Cell, records: list[dict], merged: dict | None = None,
            pretrained: list[dict] | dict | None = None) -> dict:
    """Every rank's records against its unit's one-device reference. Returns the matrix row
    (feature -> max abs error, or what raised); raises Mismatch naming the first value out of
    tolerance (phase, step, what, unit, rank), the uninterrupted run before the resumes."""
    refs = run_reference(cell.loop, cell.units)
    ckpt = cell.loop.ckpt_at
    phases = [""] + [f"resume:{f}" for f in cell.loop.formats] + \
        (["merged->1dev"] if merged is not None else [])
    row: dict = {}
    first = None
    # with BatchNorm across units only a sharded checkpoint keeps every unit's statistics
    first_unit = cell.loop.model == "bn" and cell.units > 1
    for phase in phases:
        for rec in records:
            ref = refs[rec["unit"]]
            if first_unit and phase and phase != "resume:sharded":
                ref = resumed_from_first_unit(cell.loop, cell.units)[rec["unit"]]
            if phase == f"resume:{PRETRAINED}":
                if "error" in pretrained:
                    row[phase] = pretrained["error"]
                    first = first or f"{cell.name} {phase}: {pretrained['error']}"
                    continue
                ref = pretrained[rec["unit"]]
            want = ref if not phase else {
                **ref, **{k: {s: v for s, v in ref[k].items() if s >= ckpt}
                          for k in ("train", "norm", "val")}}
            if phase == "merged->1dev":            # one device, from unit 0's point of view
                if rec["rank"] != 0:
                    continue
                got = merged
            else:
                got = rec[phase] if phase else rec
            if "error" in got:
                row[phase] = got["error"]
                first = first or f"{cell.name} {phase}: {got['error']}"
                continue
            where = f"{phase + ': ' if phase else ''}unit {rec['unit']} rank {rec['rank']}"
            for what, kind, g, w in _checks(got, want):
                col = phase or kind
                if isinstance(row.get(col), str):
                    continue
                if g is None:
                    row[col] = f"missing {what}"
                    first = first or f"{cell.name} {where}: {what} missing"
                    continue
                g, w = (torch.as_tensor(t, dtype=torch.float64) for t in (g, w))
                err = (g - w).abs()
                row[col] = max(row.get(col, 0.0), float(err.max()) if err.numel() else 0.0)
                scale = cell.weight_rtol * w.abs().max() if kind in ("weights", "buffers") \
                    else cell.rtol * w.abs()
                bad = err > cell.atol + scale
                if bool(bad.any()):
                    oot = row.setdefault("out of tolerance", [])
                    if col not in oot:
                        oot.append(col)
                    first = first or _describe(cell, where, what, g, w, bad)
    if first is not None:
        row["first mismatch"] = first
        raise Mismatch(first + "\n" + format_row(cell.name, row), row)
    return row


def _describe(cell, where, what, g, w, bad) -> str:
    if g.dim() == 0:
        return (f"{cell.name} {where}: {what}: got {float(g):.6f}, one device {float(w):.6f} "
                f"(|err| {abs(float(g - w)):.2e} > atol {cell.atol:g} + rtol {cell.rtol:g})")
    i = int((g - w).abs().argmax())
    idx = tuple(int(x) for x in torch.unravel_index(torch.tensor(i), g.shape))
    return (f"{cell.name} {where}: {what}: {int(bad.sum())} of {g.numel()} elements differ, "
            f"max |err| {float((g - w).abs().max()):.2e} at {idx} (got {float(g[idx]):.6f}, "
            f"one device {float(w[idx]):.6f}; bound atol {cell.atol:g} + {cell.weight_rtol:g} "
            f"* max|w| {float(w.abs().max()):.3g})")


def _cell_text(row: dict, f: str) -> str:
    v = row.get(f)
    if v is None:
        return "-"
    if isinstance(v, str):
        return "ERR"
    return f"{v:.0e}" + ("!" if f in row.get("out of tolerance", ()) else "")


def format_row(name: str, row: dict) -> str:
    return f"{name}: " + "  ".join(f"{f}={_cell_text(row, f)}" for f in FEATURES)


if __name__ == "__main__":
    from conformance_run import main
    main()
