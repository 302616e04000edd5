"""The habits group, second part: what user code does with pm's parameters by name, hook and
value, under each plan, against one device (tests/test_habits.py has the first part).

One loop per plan (threaded simulated ranks, or torchrun for pipelines) runs every habit in
turn on the same pm, and one device runs the same loop; per habit the largest difference is
recorded (`python -m pytest tests/test_habits_store.py -s` prints the table):

  names           [n for n, _ in pm.named_parameters()] against the model's as built (a
                  pipeline rank: its stages' subset, in the same order), and the module's
                  named_parameters() the same names and the very same objects
  decay_by_name   step 0: AdamW over pm.named_parameters() in two groups by name
                  (`n.endswith(".bias")`, "ln_"/"norm" in the name: no decay): the weights
  hf_decay        step 1: AdamW over the groups the HF Trainer's get_decay_parameter_names(pm)
                  makes: the weights
  register_hook   step 2: `p.register_hook(lambda g: g * 0.5)` on pm.parameters(): every
                  gradient read through the module (DTensors in full): relative difference
  grad_item       step 2: `p.grad.norm().item()` for each of pm.parameters(), every rank
  grad_item_rank0 the same read by rank 0 alone (the others go on to the next step)
  plain_sgd       step 2's step: a plain torch.optim.SGD over pm.parameters(): the weights
  opt_in_backward step 3: an SGD per parameter stepped from its post-accumulate-grad hook
                  (torch's optimizer-in-backward recipe), no other step: the weights
  param_item      `p.norm().item()` for each of the module's parameters (pm.module's)

A cell is the difference, or the name of the nncompile error every rank raised (a clear
refusal, listed in REFUSALS): never a silently different number.
"""
from __future__ import annotations

import copy
import json

import pytest
import torch

import models
import nncompile
from conftest import torchrun
from nncompile import ComputeConfig
from nncompile.runtime.program.module import ParallelModule
from nncompile.tools.simulate import run_ranks
from test_habits import _attempt, _full, _loss, _weights, _model as habits_model

HABITS = ("names", "decay_by_name", "hf_decay", "register_hook", "grad_item",
          "grad_item_rank0", "plain_sgd", "opt_in_backward", "param_item")
# weights, names and parameter norms to 1e-5 (absolute); gradients to 1e-4 of their largest
# element (float32 sums in another order); float8's rounding turns that into 1e-5 of a weight
TOLERANCE = {"register_hook": 1e-4, "grad_item": 1e-4, "grad_item_rank0": 1e-4}
FLOAT8_TOLERANCE = 1e-4
# plan -> (model, world, ComputeConfig keywords, policy)
PLANS = {
    "dp": ("gpt", 2, dict(plan_ngpus=1), "dp"),
    "zero1": ("gpt", 2, dict(plan_ngpus=1, use_zero=1), "dp"),
    "zero2": ("gpt", 2, dict(plan_ngpus=1, use_zero=2), "dp"),
    "zero3": ("gpt", 2, dict(plan_ngpus=1, use_zero=3), "dp"),
    "zero3_offload": ("gpt", 2, dict(plan_ngpus=1, use_zero=3, offload_params=True,
                                     offload_optimizer=True), "dp"),
    "tp": ("gpt", 2, dict(plan_ngpus=2), "tp"),
    "tp_sp": ("gpt", 2, dict(plan_ngpus=2), "tp_sp"),
    "tp_dp": ("gpt", 4, dict(plan_ngpus=2), "tp"),
    "tp_zero3": ("gpt", 4, dict(plan_ngpus=2, use_zero=3), "tp"),
    "cp": ("llama", 2, dict(plan_ngpus=2, parallel={"cp": 2}), "tp"),
    "ep": ("mixtral", 2, dict(plan_ngpus=2, parallel={"ep": 2}), "data"),
    "float8_zero3": ("gpt", 4, dict(plan_ngpus=2, use_zero=3,
                                    float8=nncompile.Float8Spec("rowwise", filter="all")), "tp"),
}
PIPELINES = {"pp": (2, 1, 0), "pp_tp": (4, 2, 0),   # plan -> (world, tp degree inside a
             "pp_zero3": (4, 1, 3)}                  # stage, ZeRO stage over 2 replicas)
# (plan, habit) -> the nncompile error every rank raises instead
REFUSALS: dict[tuple[str, str], str] = {}
for _plan in ("zero3", "zero3_offload", "tp", "tp_sp", "tp_dp", "tp_zero3", "ep",
              "float8_zero3", "pp_tp", "pp_zero3"):
    REFUSALS[(_plan, "grad_item")] = REFUSALS[(_plan, "grad_item_rank0")] = "ValueReadError"
    REFUSALS[(_plan, "param_item")] = "ValueReadError"


def _model(kind: str):
    if kind == "gpt":
        def batch_of(step):                  # every target counted: a replica's mean loss
            b = models.batch("gpt", step, batch_size=4, seq=16)   # weighs as one device's
            b["targets"].clamp_(min=0)
            return b
        return models.build("gpt"), batch_of
    model, batch_of, _ = habits_model(kind)
    return model, batch_of


def _no_decay(name: str) -> bool:
    return name.endswith(".bias") or "ln_" in name or "norm" in name


def _step(model, batch, micro: int) -> None:
    """One step's forward and backward of the global `batch` (a data-parallel replica: its
    share; a pipelined pm: train_step over its micro-batches; one device accumulates the same
    micro-batches)."""
    if isinstance(model, ParallelModule) and model.dp_size > 1:
        batch = {k: v.chunk(model.dp_size)[model.dp_rank] for k, v in batch.items()}
    if isinstance(model, ParallelModule) and model.PIPELINE is not None:
        model.train_step(**batch)
        return
    for mb in zip(*(v.chunk(micro) for v in batch.values())):
        (_loss(model(**dict(zip(batch, mb)))) / micro).backward()


def store_loop(model, module, batch_of, rank: int, micro: int = 1) -> dict:
    """Every habit on `model` (pm, or the one-device model) and the module it was built
    from, in turn, on the same parameters."""
    from transformers import Trainer
    mine, theirs = list(model.named_parameters()), list(module.named_parameters())
    same = [(n, id(p)) for n, p in mine] == [(n, id(p)) for n, p in theirs]
    out: dict = {"names": [n for n, _ in mine] if same else
                 f"pm.parameters() are not the module's: {[n for n, _ in theirs][:3]}..."}
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [{"params": [p for n, p in named if not _no_decay(n)], "weight_decay": 0.1},
              {"params": [p for n, p in named if _no_decay(n)], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=1e-2, eps=1e-4)
    _step(model, batch_of(0), micro)
    opt.step()
    out["decay_by_name"] = _weights(model)

    decay = _attempt(lambda: Trainer.get_decay_parameter_names(None, model))
    if isinstance(decay, str):
        out["hf_decay"] = decay
    else:
        hf_groups = [{"params": [p for n, p in named if n in decay], "weight_decay": 0.1},
                     {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]
        opt = torch.optim.AdamW(hf_groups, lr=1e-2, eps=1e-4)
        opt.zero_grad()
        _step(model, batch_of(1), micro)
        opt.step()
        out["hf_decay"] = _weights(model)

    params = [p for _, p in named]
    sgd = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    sgd.zero_grad()
    handles = [p.register_hook(lambda g: g * 0.5) for p in params]
    _step(model, batch_of(2), micro)
    for h in handles:
        h.remove()
    out["register_hook"] = {n: _full(p.grad).clone() for n, p in module.named_parameters()
                            if p.grad is not None}
    out["grad_item"] = _attempt(lambda: {n: p.grad.norm().item() for n, p in named})
    out["grad_item_rank0"] = _attempt(lambda: {n: p.grad.norm().item() for n, p in named}) \
        if rank == 0 else None
    sgd.step()
    out["plain_sgd"] = _weights(model)

    sgd.zero_grad(set_to_none=True)
    inner = {p: torch.optim.SGD([p], lr=0.1) for p in params}
    name_of = {id(p): n for n, p in named}
    calls = []

    def step_in_backward(p):
        calls.append(name_of[id(p)])
        inner[p].step()
        inner[p].zero_grad(set_to_none=True)
    handles = [p.register_post_accumulate_grad_hook(step_in_backward) for p in params]
    _step(model, batch_of(3), micro)
    for h in handles:
        h.remove()
    out["opt_in_backward"] = _weights(model)
    out["opt_in_backward_calls"] = sorted(calls)      # each parameter's hook once
    out["param_item"] = _attempt(lambda: {n: p.norm().item()
                                          for n, p in module.named_parameters()})
    return out


def _difference(habit: str, got, want) -> float | str:
    if isinstance(got, str):
        return got
    if habit == "names":
        return 0.0 if got == want else f"names differ: {got[:3]}..."
    if habit in ("grad_item", "grad_item_rank0", "param_item"):
        if set(got) != set(want):
            return f"values of {sorted(set(want) ^ set(got))[:3]} missing"
        if habit == "param_item":
            return max(abs(got[n] - want[n]) for n in want)
        return max(abs(got[n] - want[n]) / max(abs(want[n]), 1e-6) for n in want)
    if habit == "register_hook":
        if set(got) != set(want):
            return "gradients missing"
        return max(float((got[n] - want[n]).abs().max() / want[n].abs().max().clamp_min(1e-6))
                   for n in want)
    return max(float((got[k] - want[k]).abs().max()) for k in want)       # weights


def run_plan(plan: str, workdir) -> dict[str, float | str]:
    kind, world, kw, policy = PLANS[plan]
    base, batch_of = _model(kind)
    ref = copy.deepcopy(base)
    threads = torch.get_num_threads()
    if kw.get("float8") is not None:     # one device runs torchao's float8 on the same layers
        from torchao.float8 import convert_to_float8_training
        from nncompile.runtime.program.float8 import recipe_config
        convert_to_float8_training(ref, config=recipe_config(kw["float8"].recipe, emulate=True),
                                   module_filter_fn=nncompile.float8_module_filter(kw["float8"]))
        torch.set_num_threads(1)         # (tests/conformance.py one_thread_for_float8)
    try:
        return _run_plan(plan, ref, base, batch_of, workdir)
    finally:
        torch.set_num_threads(threads)


def _run_plan(plan: str, ref, base, batch_of, workdir) -> dict[str, float | str]:
    kind, world, kw, policy = PLANS[plan]
    want = store_loop(ref, ref, batch_of, rank=0)

    dummy = {k: v.chunk(world // kw["plan_ngpus"])[0] for k, v in batch_of(0).items()}

    def rank_fn(rank):
        module = copy.deepcopy(base)
        pm = nncompile.parallelize(module, dummy, ComputeConfig(runtime_ngpus=world, **kw),
                                   pas_policy=policy, gen_savedir=workdir,
                                   instance_name=f"store_{plan}")
        return store_loop(pm, module, batch_of, rank)
    return table_row(run_ranks(world, rank_fn), want)


def table_row(results: list[dict], want: dict) -> dict[str, float | str]:
    """Per habit, the largest difference over the ranks (or what a rank raised instead)."""
    row: dict[str, float | str] = {}
    for habit in HABITS:
        diffs = [_difference(habit, got[habit], want[habit]) for got in results
                 if got[habit] is not None]
        words = [d for d in diffs if isinstance(d, str)]
        row[habit] = words[0] if words else max(diffs, default=0.0)   # (rank 0 alone reads)
    wrong = [got["opt_in_backward_calls"] for got in results
             if got["opt_in_backward_calls"] != want["opt_in_backward_calls"]]
    if wrong and not isinstance(row["opt_in_backward"], str):
        row["opt_in_backward"] = f"hooks ran {len(wrong[0])} times for " \
                                 f"{len(want['opt_in_backward_calls'])} parameters"
    return row


def run_pipeline(plan: str, workdir) -> dict[str, float | str]:
    world, tp, zero = PIPELINES[plan]
    out = torchrun("tests/workers/habits_store_pipeline.py", world, "--savedir", str(workdir),
                   "--tp", str(tp), "--zero", str(zero))
    line = next(ln for ln in out.splitlines() if ln.startswith("HABITS "))
    return json.loads(line[len("HABITS "):])


def format_table(rows: dict[str, dict]) -> str:
    lines = ["| plan | " + " | ".join(HABITS) + " |", "|---" * (len(HABITS) + 1) + "|"]
    for plan, row in rows.items():
        cells = [v if isinstance(v, str) else f"{v:.1e}" for v in (row[h] for h in HABITS)]
        lines.append(f"| {plan} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


@pytest.mark.parametrize("plan", [*PLANS, *PIPELINES])
def test_store_habits_equal_one_device(plan, tmp_path):
    row = run_pipeline(plan, tmp_path) if plan in PIPELINES else run_plan(plan, tmp_path)
    print("\n" + format_table({plan: row}))
    wrong = []
    for habit in HABITS:
        got, refusal = row[habit], REFUSALS.get((plan, habit))
        if refusal is not None:
            ok = got == refusal
        else:
            limit = FLOAT8_TOLERANCE if "float8" in plan else TOLERANCE.get(habit, 1e-5)
            ok = not isinstance(got, str) and got <= limit
        if not ok:
            wrong.append(f"{habit}: {got!r}" + (f" (listed: {refusal})" if refusal else ""))
    assert not wrong, "\n" + format_table({plan: row}) + "\n" + "\n".join(wrong)
