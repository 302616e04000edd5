"""torch.export, as the frontend calls it: with errors translated into TraceError naming the
user's file:line (export), with a run of identical layers replayed from one traced layer
(_export_replaying, layer_replay.py), and functionalized where the program writes in place
(functionalize). Each export leaves the module's tensors as it found them (attributes.py)."""
from __future__ import annotations

import contextlib
import inspect
import io
import re
import sys
import traceback
from typing import Any

import torch
import torch.fx
from torch.export import ExportedProgram
from torch.utils import _pytree as pytree

from .. import compat
from ..errors import TraceError
from . import attributes, layer_replay, user_checkpoint
from .function_watch import WatchFunctions, user_frame_from_text

# Ops that only assert facts about their input: dropped.
_DROPPED = {"_assert_tensor_metadata", "_assert_scalar", "_assert_async", "sym_constrain_range",
            "sym_constrain_range_for_size"}


def _move_to(obj: Any, device: torch.device) -> Any:
    return pytree.tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, obj)


def _mutations(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The nodes that write in place (asserts and detach_ aside)."""
    out = []
    for mod in gm.modules():
        for node in getattr(mod, "graph", torch.fx.Graph()).nodes:
            t = node.target
            if isinstance(t, torch._ops.OpOverload) and t._opname not in _DROPPED \
                    and t._opname != "detach_" and t._schema.is_mutable:
                out.append(node)
    return out


def _mutates(gm: torch.fx.GraphModule) -> bool:
    return bool(_mutations(gm))


def functionalize(ep: ExportedProgram) -> ExportedProgram:
    """In-place ops (`z[:, 1:] = y`, `masked_fill_`) become functional ones (`slice_scatter`,
    `masked_fill`) through torch.export's own functionalization; high-level ops (linear,
    layer_norm, sdpa) are kept. Passes may then convert any value without breaking an alias:
    a collective between a view and its base would otherwise write into a copy."""
    return ep.run_decompositions({}) if _mutates(ep.graph_module) else ep


class _StderrRecord(io.TextIOBase):
    """What was written to sys.stderr, write by write, to pass on later."""

    def __init__(self):
        self.writes: list[str] = []

    def write(self, text: str) -> int:
        self.writes.append(text)
        return len(text)


@contextlib.contextmanager
def without_partial_graph_dump():
    """torch.export prints a failing trace's partial FX graph to stderr before it raises
    (once per wrapper it passes through: tens of lines of aten code). The TraceError that
    follows names the user's source line instead, so the dump is left out; whatever else was
    written to stderr meanwhile (warnings, the forward's own prints) is passed on, in order,
    when the export returns or raises."""
    record = _StderrRecord()
    dump = None
    try:
        with contextlib.redirect_stderr(record):
            yield
    except Exception as e:  # noqa: BLE001 - re-raised
        dump = getattr(e, "partial_fx_graph", None)
        raise
    finally:
        writes, skip_newline = [], False
        for text in record.writes:
            if dump is not None and text == str(dump):
                skip_newline = True
                continue
            if not (skip_newline and text == "\n"):
                writes.append(text)
            skip_newline = False
        if writes:
            sys.stderr.write("".join(writes))


@contextlib.contextmanager
def _var_kwargs_named(module: torch.nn.Module, kwargs: dict, dynamic_shapes: dict | None):
    """With dynamic_shapes: the call's arguments that forward takes through `**kwargs`
    (Hugging Face's num_items_in_batch) named in the signature torch.export reads, for the
    export's duration. torch 2.13 matches dynamic_shapes against forward's signature bound to
    the call (such an argument nested under `kwargs`) and, after tracing, against the call's
    keywords (not nested): no one dict passes both ("Must provide a tree_name when there might
    be a mismatch"). Named, the argument is a top-level key in both. forward itself is called
    as before.

        forward(input_ids, ..., labels, **kwargs)                    as torch.export reads it:
        -> forward(input_ids, ..., labels, *, num_items_in_batch)   dynamic_shapes keys alike
    """
    params = inspect.signature(module.forward).parameters
    extra = [k for k in kwargs if k not in params]
    if not dynamic_shapes or not extra or "forward" in vars(module) or \
            not any(p.kind == p.VAR_KEYWORD for p in params.values()):
        yield
        return
    bound = module.forward

    def forward(*args, **kw):
        return bound(*args, **kw)
    forward.__signature__ = inspect.signature(bound).replace(parameters=[
        p for p in params.values() if p.kind != p.VAR_KEYWORD] + [
        inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY) for k in extra])
    module.__dict__["forward"] = forward
    try:
        yield
    finally:
        del module.__dict__["forward"]


def _meta_args(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    if any(p.is_meta for p in module.parameters()):
        return _move_to(args, torch.device("meta")), _move_to(kwargs, torch.device("meta"))
    return args, kwargs


def _export_replaying(module: torch.nn.Module, args: tuple, kwargs: dict,
                      runs: list[layer_replay.Run]) -> tuple[ExportedProgram, bool] | None:
    """torch.export with the runs' layers replayed (nncompile/frontend/layer_replay.py) and
    functionalized, and whether functionalizing ran (dead code eliminated: the caller checks
    the lowered graph has none, as a full trace would not). None where it fails, or a
    template writes in place: the caller exports without replay."""
    args, kwargs = _meta_args(module, args, kwargs)
    watch = WatchFunctions()
    try:
        with attributes.kept(module), watch, user_checkpoint.traced(), \
                layer_replay.installed(runs), compat.export_leaves_no_hooks(), \
                without_partial_graph_dump():
            ep = torch.export.export(module, args, kwargs, strict=False)
        if watch.found:
            return None
        mutations = _mutations(ep.graph_module)
        if not mutations:
            return ep, False
        if any(layer_replay.in_template(path, runs) for node in mutations
               for path, _ in (node.meta.get("nn_module_stack") or {}).values()):
            return None
        with layer_replay.active(runs):
            return ep.run_decompositions({}), True
    except Exception:  # noqa: BLE001 - the full export reports it
        return None


_STALE_CONSTANT = "fake tensor in the exported program constant"


def _export_once_more_on_stale_constant(module: torch.nn.Module, args: tuple, kwargs: dict,
                                        dynamic_shapes: dict | None) -> ExportedProgram:
    """torch.export (non-strict); once more, after a garbage collection, where torch reports a
    fake tensor among the program's constants. attributes.kept hides what an earlier trace
    left on the module; a tensor an earlier trace (the layer-replay attempt) left elsewhere,
    freed only by the collector, was seen to make the next export fail this way in a rare
    run. A second failure is reported as the first would be."""
    try:
        return torch.export.export(module, args, kwargs, strict=False,
                                   dynamic_shapes=dynamic_shapes)
    except RuntimeError as e:
        if _STALE_CONSTANT not in str(e):
            raise
    import gc
    from ..log import log
    log("torch.export found a fake tensor among the constants; tracing once more")
    gc.collect()
    return torch.export.export(module, args, kwargs, strict=False, dynamic_shapes=dynamic_shapes)


def export(module: torch.nn.Module, args: tuple, kwargs: dict,
           dynamic_shapes: dict | None = None) -> ExportedProgram:
    """torch.export with errors translated into TraceError naming the user's file:line."""
    args, kwargs = _meta_args(module, args, kwargs)
    watch = WatchFunctions()
    try:
        with attributes.kept(module), watch, user_checkpoint.traced(), \
                compat.export_leaves_no_hooks(), without_partial_graph_dump(), \
                _var_kwargs_named(module, kwargs, dynamic_shapes):
            try:
                ep = _export_once_more_on_stale_constant(module, args, kwargs, dynamic_shapes)
            except Exception as e:  # noqa: BLE001 - a guard this torch cannot prove: again
                retry = compat.export_dynamic_options() if dynamic_shapes else {}
                if not retry or "Constraints violated" not in str(e):
                    raise
                ep = torch.export.export(module, args, kwargs, strict=False,
                                         dynamic_shapes=dynamic_shapes, **retry)
    except Exception as e:  # noqa: BLE001 - translated below
        text = str(e) + "\n" + "".join(traceback.format_exception(e))
        if dynamic_shapes and ("Constraints violated" in text or "specializ" in text
                               or "ConstraintViolation" in type(e).__name__):
            detail = "\n".join(str(e).strip().splitlines()[:12])
            raise TraceError(
                f"{type(module).__name__}.forward does not work for every size dynamic_dims "
                f"allows; narrow the ranges (min/max/multiple_of) or drop the dim. "
                f"torch.export says:\n{detail}") from e
        where = user_frame_from_text(text)
        data_dependent = "data-dependent" in text or "GuardOnDataDependent" in type(e).__name__
        at = f" at {where.file}:{where.line}: `{where.code}`" if where else ""
        if data_dependent and "float(self.num_batches_tracked)" in text:
            raise TraceError(
                f"a BatchNorm layer of {type(module).__name__}{at} has momentum=None (a "
                "cumulative average), which divides by num_batches_tracked read as a Python "
                "number, a value nncompile cannot trace; give it a number (momentum=0.1 is "
                "PyTorch's default)") from e
        if data_dependent:
            raise TraceError(
                f"forward branches on a tensor's value{at}. nncompile traces one program for "
                "all inputs, so Python control flow may depend on shapes and constants but not "
                "on tensor data. Rewrite it with torch.where / torch.cond, or compute the "
                "condition outside the module.") from e
        unknown = re.search(r"Found <class '([\w.]+)'> in output", text)
        if unknown:
            cls = unknown.group(1)
            if "Cache" in cls.rsplit(".", 1)[-1]:
                raise TraceError(
                    f"{type(module).__name__}.forward returns a {cls} (a Hugging Face key/value "
                    "cache: the model runs with use_cache=True), which training does not use. "
                    "Pass use_cache=False in the model call (or as a dummy_args value), or set "
                    "model.config.use_cache = False before parallelize.") from e
            raise TraceError(
                f"{type(module).__name__}.forward returns a {cls}, which cannot be flattened "
                "into tensors; return tensors (or dicts/tuples/dataclasses of them), or register "
                "the type with torch.utils._pytree.register_pytree_node") from e
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise TraceError(f"torch.export could not trace {type(module).__name__}.forward{at}: "
                         f"{type(e).__name__}: {first}") from e
    watch.check()
    return functionalize(ep)
