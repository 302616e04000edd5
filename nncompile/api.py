"""parallelize(): trace, compile and (optionally) load a module as a ParallelModule.

Generation happens once, on rank 0, into `<gen_savedir>/<instance_name>/`; the other ranks
wait for it and load their own `gencode{rank}.py`.
"""
from __future__ import annotations

import contextlib
import copy
import difflib
import gc
import json
import os
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from . import codegen, symbolic
from .frontend import layer_replay
from .arguments import scalars_as_inputs
from .batched import batched_inputs
from .config import ComputeConfig
from .edits import edited_files, file_sha256, keep_edited
from .errors import ConfigError, EditedCodeWarning, NNCompileError, ReuseError
from .fileio import check_writable, staged_dir, write_text
from .fingerprint import compute_fingerprint
from .float8_spec import float8_layers
from .frontend import trace
from .frontend.user_checkpoint import with_recompute
from .ir import Graph, MemoryChoice
from .ir.printer import print_graph_texts
from .log import log as _log
from .pipeline_config import microbatch_dummy
from .tools import activation_memory
from .tools.check import (VerifyReport, check_compiled, compare_parallel, eager_reference,
                          refuse_if_diverges)
from nncompile.runtime.program.loader import load_rank_module
from nncompile.experts import experts_forms
from nncompile.passes import build_pipeline, get_policy, plan_graph, run_pipeline
from nncompile.passes.plan import decide_memory
from nncompile.passes.autodist import report_table as plan_report

REUSE_MODES = ("match", "override", "moo")


def _policy_name(policy: Any) -> str:
    return policy if isinstance(policy, str) else \
        f"{getattr(policy, '__module__', '')}.{getattr(policy, '__qualname__', repr(policy))}"


@dataclass
class Compiled:
    """What compile_module did: 'generated' (with the traced and final graphs) or 'reused'."""
    status: str
    traced: Graph | None = None
    final: Graph | None = None


@contextlib.contextmanager
def _no_full_gc() -> Iterator[None]:
    """No full (oldest-generation) garbage collections while compiling. A compile keeps some
    10^5 new objects alive, which makes Python scan the whole heap (torch and transformers
    included) several times: about a second of a Llama-8B compile. Young collections still
    run; whatever the compile leaves is collected after."""
    t0, t1, t2 = gc.get_threshold()
    gc.set_threshold(t0, t1, 1 << 30)
    try:
        yield
    finally:
        gc.set_threshold(t0, t1, t2)


def compile_module(module: torch.nn.Module, dummy_args: Any, config: ComputeConfig, *,
                   pas_policy: Any, outdir: Path, reuse: str = "match",
                   check: bool = False, dynamic_dims: Any = None) -> Compiled:
    """Compile into `outdir` (or reuse what is there)."""
    with _no_full_gc():
        return _compile_module(module, dummy_args, config, pas_policy=pas_policy,
                               outdir=outdir, reuse=reuse, check=check,
                               dynamic_dims=dynamic_dims)


def _compile_module(module: torch.nn.Module, dummy_args: Any, config: ComputeConfig, *,
                    pas_policy: Any, outdir: Path, reuse: str, check: bool,
                    dynamic_dims: Any = None) -> Compiled:
    policy = get_policy(pas_policy)
    check_writable(outdir.parent)
    start, cpu_start = time.perf_counter(), _cpu()
    _log(f"tracing {type(module).__name__} ...")
    m = config.pipeline.microbatches
    if dynamic_dims and (m > 1 or config.pipeline.enabled):
        raise ConfigError("dynamic_dims cannot be combined with micro-batches or pipeline "
                          "stages yet (their schedules exchange fixed-size activations); "
                          "compile one instance per shape, or drop parallel.pp/microbatches")
    batched = batched_inputs(module, dummy_args, m, config.parallel.batched_inputs)
    leaves = pytree.tree_leaves(dummy_args)
    dummy_args, batch = microbatch_dummy(dummy_args, m, batched)
    graph = trace(module, dummy_args, dynamic_dims, modes=True)   # train and eval: modes.py
    graph.trace_info.inference_only = config.inference_only
    for g in (graph, graph.eval_program):    # the job's ranks: Graph.mesh
        if g is not None:
            g.runtime_ngpus = config.runtime_ngpus
    if m > 1:       # the code runs one micro-batch; train_step splits the batch
        graph.trace_info.microbatches = m
        graph.trace_info.batched = [v.name for v in graph.inputs
                                    if v.meta.shape and v.meta.shape[0] == batch // m]
        split = [b for x, b in zip(leaves, batched or []) if isinstance(x, torch.Tensor)]
        if batched is not None and len(split) == len(graph.inputs):   # the model's say
            graph.trace_info.batched = [v.name for v, b in zip(graph.inputs, split) if b]
    if config.inference_only:
        for v in graph.values():
            v.requires_grad = False
    traced_text, plain_text = print_graph_texts(graph)
    if graph.trace_info.checkpointed:   # modules the model checkpoints: recomputed
        config = with_recompute(config, graph.trace_info.checkpointed)
        note = f"# checkpointed in the model: {graph.trace_info.checkpointed}\n"
        traced_text, plain_text = traced_text + note, plain_text + note
    if graph.trace_info.eval_error:    # eval mode refused at run time
        plain_text += "# not traced in eval mode\n"
    if graph.trace_info.train_error:   # training mode refused at run time
        plain_text += "# not traced in training mode\n"
    if graph.eval_program is not None:  # the forward differs in eval mode: a second program
        texts = print_graph_texts(graph.eval_program)
        traced_text += "\n# ---- eval mode ----\n" + texts[0]
        plain_text += "\n# ---- eval mode ----\n" + texts[1]
    fingerprint, fp_parts = compute_fingerprint(graph, config, pas_policy, plain_text)
    manifest_path = outdir / "manifest.json"
    try:
        old = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        if reuse == "match":
            raise ReuseError(f"the manifest at {manifest_path} is unreadable ({e}); use "
                             "reuse='override' to regenerate the code in "
                             f"{outdir}") from e
        _log(f"the manifest at {manifest_path} is unreadable; regenerating")
        old = {}
    if reuse != "override" and old:
        complete = all((outdir / f"gencode{r}.py").exists() for r in range(config.runtime_ngpus))
        if old.get("fingerprint") == fingerprint and complete:
            edited = edited_files(outdir, old)
            _log(f"reusing generated code in {outdir}"
                 + (f" (edited: {', '.join(edited)})" if edited else ""))
            return Compiled("reused")
        if reuse == "match":
            raise ReuseError(_what_changed(old, config, traced_text, _policy_name(pas_policy),
                                           outdir, fp_parts))
    replayed = layer_replay.last.get("replayed")
    _log(f"traced {graph.trace_info.model}: {len(graph.ops)} ops, {len(graph.params)} params "
         f"({(time.perf_counter() - start):.1f}s"
         + (f"; {replayed} identical layer{'s' if replayed != 1 else ''} copied from a traced "
            "one" if replayed else "") + ")")
    seconds = {"trace": time.perf_counter() - start}
    cpu_traced = _cpu()
    _log(f"running passes (policy {_policy_name(pas_policy)}) ...")
    experts = experts_forms(module) if config.plan_ngpus > 1 else None
    layers = float8_layers(module, config.float8) if config.float8 is not None else None
    passes = build_pipeline(config, policy, experts, layers)
    result = run_pipeline(graph, passes, check=check, config=config)
    seconds["passes"] = sum(ms for _, _, ms in result.history) / 1e3
    cpu_passed = _cpu()
    seconds["ilp"] = (result.graph.plan_state.autodist or {}).get("solve_s", 0.0)
    width = max((len(name) for name, _, _ in result.history[1:]), default=0)
    for name, _, ms in result.history[1:]:
        _log(f"  pass {name:<{width}} {ms:8.1f} ms")   # the times in one column
    final, eval_history = result.graph, result.eval_history   # the eval program: pinned
    planned = plan_graph(result.history)     # before schedule-only passes: what plan.json shows
    symbolic.warn_if_unsplit(final)
    memory = memory_choice(final, config)
    _log(f"writing {config.runtime_ngpus} rank file(s) ...")
    with staged_dir(outdir) as staging:
        for r, text in enumerate(codegen.render_all(
                final, fingerprint, memory=memory if config.code_fields else None)):
            write_text(staging / f"gencode{r}.py", text)
        kept = keep_edited(outdir, old, staging)
        (staging / "graphs").mkdir()
        for fname, text in codegen.graph_dumps(result.history).items():
            write_text(staging / "graphs" / fname, text)
        if eval_history:                    # the eval-mode program's passes (modes.py)
            (staging / "graphs" / "eval").mkdir()
            for fname, text in codegen.graph_dumps(eval_history).items():
                write_text(staging / "graphs" / "eval" / fname, text)
        plan = codegen.plan_json(planned)
        plan["parallel"] = {   # what was asked (the spec's non-defaults) and the mesh it made
            "spec": config.parallel.changed(),
            "mesh": {("tp" if name == "plan" else name): size for name, size in final.mesh.dims}}
        predicted = activation_memory.predict_plan(final)   # saved-tensor bytes per rank
        if predicted is not None:
            plan["memory"] = {**(plan.get("memory") or {}), **predicted}
        write_text(staging / "plan.json", codegen.json_text(plan))
        if plan.get("autodist"):
            write_text(staging / "plan_report.txt", plan_report(plan))
        seconds["codegen"] = time.perf_counter() - start - seconds["trace"] - seconds["passes"]
        seconds["total"] = time.perf_counter() - start
        now = _cpu()        # CPU seconds of this process and its children (the ILP solver)
        seconds["cpu"] = {"trace": cpu_traced - cpu_start, "passes": cpu_passed - cpu_traced,
                          "codegen": now - cpu_passed, "total": now - cpu_start}
        write_text(staging / "manifest.json", codegen.json_text(
            {**codegen.manifest(final, config, fingerprint, traced_text),
             "fingerprint_parts": fp_parts,
             "compile_seconds": seconds,
             "files": {f"gencode{r}.py": file_sha256(staging / f"gencode{r}.py")
                       for r in range(config.runtime_ngpus)}}))
    if kept:
        warnings.warn(f"regenerating {outdir} replaced edited file(s) {', '.join(kept)}; "
                      f"the edited versions are kept in {outdir / 'edited'}",
                      EditedCodeWarning, stacklevel=3)
    if config.check:
        _log(f"checking the plan: {config.runtime_ngpus} rank(s) in one process vs eager ...")
        report = refuse_if_diverges(module, dummy_args, config,
                                    Compiled("generated", graph, planned), outdir)
        _log(f"plan check passed (largest error {report.max_error:.2e} relative to scale)")
    _log(f"generated {config.runtime_ngpus} rank file(s) in {outdir} "
         f"({time.perf_counter() - start:.1f}s total)"
         + ("; why each placement: plan_report.txt, nncompile.explain()"
            if final.plan_state.autodist else ""))
    return Compiled("generated", graph, final)


def _cpu() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def memory_choice(g, config: ComputeConfig) -> MemoryChoice:
    """The plan's ZeRO stage and offload, as the plan pass decided them (passes/plan.py
    decide_memory)."""
    g.plan_state.memory = decide_memory(g, config)
    return g.plan_state.memory


def _code_lines(text: str) -> list[str]:
    """A printed graph without its comment lines (source lines move with unrelated edits)."""
    return [ln for ln in text.splitlines() if not ln.lstrip().startswith("#")]


_PART_CHANGES = {"policy": "the policy's code changed",
                 "device": "the autodist device profile (or load_plan_path file) changed",
                 "custom_ops": "a custom op's register_op annotation changed",
                 "version": "the nncompile version changed"}


def _what_changed(old: dict, config: ComputeConfig, traced_text: str, policy: str,
                  outdir: Path, parts: dict[str, str] | None = None) -> str:
    changes = config.diff(old.get("config", {}))
    if old.get("policy") and old["policy"] not in (policy, policy.rsplit(".", 1)[-1]):
        changes.append(f"pas_policy: {old.get('policy')!r} -> {policy!r}")
    saved, now = _code_lines(old.get("traced_graph", "")), _code_lines(traced_text)
    if saved != now:
        diff = list(difflib.unified_diff(saved, now, "saved", "now", n=0, lineterm=""))[2:12]
        changes.append("the traced graph changed (the model's code, shapes or parameters):\n"
                       + "\n".join("      " + d for d in diff))
    old_parts = old.get("fingerprint_parts") or {}
    changes += [why for key, why in _PART_CHANGES.items()
                if key in old_parts and parts and old_parts[key] != parts.get(key)
                and not (key == "policy" and any(c.startswith("pas_policy") for c in changes))]
    if not changes:
        changes.append("generated files are incomplete or from another nncompile version")
    edited = edited_files(outdir, old)
    kept = (f"\nEdited file(s) {', '.join(edited)} would be replaced; regenerating keeps them "
            f"in {outdir / 'edited'}.") if edited else ""
    return (f"generated code in {outdir} does not match this call (reuse='match'):\n  - "
            + "\n  - ".join(changes)
            + "\nUse reuse='override' to regenerate, reuse='moo' to regenerate only when it "
              "differs, or another instance_name." + kept)


def _check_plan_fits_job(config: ComputeConfig, distributed: bool) -> None:
    """plan_ngpus must divide the job's ranks when runtime_ngpus is left to the world size.
    Raised here, in the user's call, so each rank's traceback is two frames, the rank named."""
    if config.runtime_ngpus is not None:
        return
    world = dist.get_world_size() if distributed else int(os.environ.get("WORLD_SIZE", "1"))
    rank = dist.get_rank() if distributed else int(os.environ.get("RANK", "0"))
    if world % config.plan_ngpus == 0:
        return
    fits = [n for n in range(1, world + 1) if world % n == 0]
    raise ConfigError(f"plan_ngpus={config.plan_ngpus} does not divide this job's {world} "
                      f"ranks (each data-parallel unit is plan_ngpus ranks): use plan_ngpus "
                      f"in {fits}, or launch a multiple of {config.plan_ngpus} ranks (torchrun "
                      f"--nproc_per_node={config.plan_ngpus})" + (f" [rank {rank}]" if rank else ""))


def parallelize(module: torch.nn.Module, dummy_args: Any, compute_config: ComputeConfig, *,
                pas_policy: Any = "autodist", gen_savedir: str | os.PathLike = "./.nncompile",
                reuse: str = "match", instance_name: str | None = None,
                load_module: bool = True, device: Any = None, dynamic_dims: Any = None,
                scalar_inputs: Any = None):
    """Compile `module` for `compute_config` and return this rank's ParallelModule.

    dummy_args: a dict of forward's keyword arguments or a tuple of its positional ones, shaped
    like one plan unit's batch. dynamic_dims: sizes that may vary between calls, e.g.
    {"idx": {0: "batch", 1: "seq"}} (a name, {"name", "min", "max", "multiple_of"} or a
    torch.export.Dim per dim; see nncompile/symbolic.py); the plan is made at the dummy args'
    sizes. scalar_inputs: names of int or float arguments that change per call (a token count
    such as `num_items_in_batch`, a loss scale, a step number), traced as run-time inputs
    instead of constants (nncompile/arguments.py). With load_module=False it only compiles (no
    process group needed) and returns the directory of generated files.
    """
    if not isinstance(module, torch.nn.Module):
        raise ConfigError(f"parallelize needs an nn.Module, got {type(module).__name__}")
    if not isinstance(compute_config, ComputeConfig):
        raise ConfigError("compute_config must be an nncompile.ComputeConfig")
    if reuse not in REUSE_MODES:
        raise ConfigError(f"reuse={reuse!r}; choose one of {REUSE_MODES}")
    get_policy(pas_policy)          # fail early, on every rank, for an unknown policy
    dummy_args = scalars_as_inputs(module, dummy_args, scalar_inputs)
    from nncompile.runtime.store.released import check_not_parallelized
    check_not_parallelized(module)     # before tracing: a clear error, not a TraceError
    distributed = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size() if distributed else 1
    rank = dist.get_rank() if distributed else 0
    if load_module:
        _check_plan_fits_job(compute_config, distributed)
    config = compute_config.resolved(world if load_module else compute_config.plan_ngpus)
    if load_module and config.runtime_ngpus != world:
        raise ConfigError(f"runtime_ngpus={config.runtime_ngpus} but the world size is {world}; "
                          f"launch with torchrun --nproc_per_node={config.runtime_ngpus}, or set "
                          f"runtime_ngpus={world}")
    if instance_name is not None and (
            not isinstance(instance_name, str) or not instance_name
            or instance_name in (".", "..") or instance_name.startswith(".")
            or "/" in instance_name or "\\" in instance_name or os.sep in instance_name
            or (os.altsep and os.altsep in instance_name) or "\0" in instance_name):
        raise ConfigError(f"instance_name={instance_name!r} must be a plain directory name "
                          "under gen_savedir: non-empty, no path separators ('/' or '\\'), "
                          "not '.' or '..' and not starting with '.'; e.g. instance_name="
                          f"{type(module).__name__!r}")
    instance = instance_name or type(module).__name__
    outdir = Path(gen_savedir).absolute() / instance
    error = None
    if rank == 0 or not load_module:
        try:
            compile_module(module, dummy_args, config, pas_policy=pas_policy, outdir=outdir,
                           reuse=reuse, dynamic_dims=dynamic_dims)
        except Exception as e:    # noqa: BLE001 - any error: the other ranks hear of it
            error = e
    if distributed and load_module:
        box = [None if error is None else f"{type(error).__name__}: {error}"]
        dist.broadcast_object_list(box, src=0)
        if error is None and box[0] is not None:
            raise NNCompileError(f"compilation failed on rank 0 (this is rank {rank}, which "
                                 f"waited for its program): {box[0]}")
    if error is not None:
        raise error
    if not load_module:
        return outdir
    from .distribute import require_rank_file, share_generated
    if distributed:
        share_generated(outdir)     # nodes that do not share gen_savedir get rank 0's files
    require_rank_file(outdir, rank)
    return load_rank_module(outdir, rank, module, device, config)


def verify(module: torch.nn.Module, dummy_args: Any, compute_config: ComputeConfig,
           pas_policy: Any, *, gen_savedir: str = "./.nncompile", rtol: float = 1e-5,
           atol: float = 1e-6, inputs: Any = None) -> VerifyReport:
    """Compare parallel loss and gradients with a single-device run; return the report
    (nncompile/tools/check.py). Without a process group every rank runs in this process
    (threads). `inputs` (shaped like dummy_args) is the batch both runs see; by default
    dummy_args itself."""
    batch = dummy_args if inputs is None else inputs
    instance = f"verify_{type(module).__name__}"
    if not (dist.is_available() and dist.is_initialized()):
        config = compute_config.resolved(compute_config.plan_ngpus)
        outdir = Path(gen_savedir).absolute() / instance
        compiled = compile_module(module, dummy_args, config, pas_policy=pas_policy,
                                  outdir=outdir, reuse="override")
        return check_compiled(module, batch, config, compiled, outdir, rtol=rtol, atol=atol)
    reference = eager_reference(module, batch)
    pm = parallelize(copy.deepcopy(module), dummy_args, compute_config, pas_policy=pas_policy,
                     gen_savedir=gen_savedir, reuse="override", instance_name=instance)
    return compare_parallel(pm, reference, rtol, atol)
