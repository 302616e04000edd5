"""The schema of a generated rank file: what `gencode{rank}.py` declares, in one place.

Codegen writes each declaration through `declare` and the runtime reads a loaded file through
`read`; both go by `RankFile` below, a typed dataclass whose fields are the upper-case class
attributes of the file's `GenModel`:

    class GenModel(ParallelModule):
        SCHEMA = 2                        # RankFile.schema: this module's SCHEMA_VERSION
        RANK = 0                          # RankFile.rank
        PLAN_NGPUS = 2                    # RankFile.plan_ngpus
        ...

A file declares only what differs from the defaults below for most optional fields (a plan
without a pipeline writes no PIPELINE), so the defaults are what the runtime assumes when a
declaration is absent. `read` refuses a file written for another SCHEMA_VERSION (or before
there was one) with the fix, and a declaration of the wrong type with its name.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from .errors import ConfigError
from .ir import fmt_literal

SCHEMA_VERSION = 2          # bump when a declaration's meaning or form changes


def _decl(default: Any, kind: type | tuple, doc: str):
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d),
                     metadata={"kind": kind, "doc": doc})
    return field(default=default, metadata={"kind": kind, "doc": doc})


NONE = type(None)


@dataclass
class RankFile:
    """Every declaration of a rank file (attribute = field name in upper case)."""
    schema: int = _decl(0, int, "the rank-file schema version the file was written for")
    rank: int = _decl(0, int, "the global rank this file is for")
    fingerprint: str = _decl("", str, "the compile's fingerprint (what reuse compares)")
    policy: str = _decl("", str, "the policy that planned it")
    plan_ngpus: int = _decl(1, int, "tensor-parallel ranks of a plan unit (of one stage "
                                    "under a pipeline)")
    runtime_ngpus: int = _decl(1, int, "the job's ranks")
    inference_only: bool = _decl(False, bool, "compiled for inference only")
    training: bool = _decl(True, bool, "the traced module's mode (the one this module "
                                       "starts in)")
    out_spec: str = _decl("", str, "the forward's output structure (a pytree spec)")
    eval_out_spec: str = _decl("", str, "forward_eval_impl's output structure, where it "
                                        "differs")
    eval_error: str = _decl("", str, "why the forward could not be traced in eval mode")
    train_error: str = _decl("", str, "why it could not be traced in training mode")
    inputs: list = _decl([], list, "name, traced shape, dtype per input")
    sizes: dict = _decl({}, dict, "dynamic_dims: name -> (min, max, multiple)")
    grad_inputs: list = _decl([], list, "inputs traced requiring grad")
    buffer_updates: list = _decl([], list, "buffers forward updates: their new values "
                                           "follow its outputs")
    args: list | None = _decl(None, (list, NONE), "forward's arguments as traced "
                                                  "(nncompile/arguments.py)")
    signature: list = _decl([], list, "forward's positional parameters")
    defaults: dict = _decl({}, dict, "untraced arguments' constant defaults")
    params: list = _decl([], list, "rows.ParamRow: name, FQN, full shape, placement, slices, "
                                   "partial gradient (, part)")
    frozen: list = _decl([], list, "parameters traced with requires_grad=False")
    buffers: list = _decl([], list, "rows.BufferRow: local name, FQN, full shape, placement, "
                                    "slices")
    consts: list = _decl([], list, "rows.ConstRow: local name, full shape, placement, slices")
    param_order: list = _decl([], list, "the original module's parameters(), by FQN")
    state_keys: list = _decl([], list, "the original module's state_dict() keys, canonical "
                                       "FQN")
    memory: dict | None = _decl(None, (dict, NONE), "the ZeRO stage / offload the code was "
                                                    "generated for")
    zero_units: list = _decl([], list, "ZeRO-3 flat parameters (runtime/store/zero.py)")
    microbatches: int = _decl(1, int, "train_step splits the batch into this many")
    batched: list = _decl([], list, "the inputs train_step splits")
    pipe_ranks: int = _decl(1, int, "pipeline ranks per plan unit (runtime/program/pipeline.py)")
    pipeline: dict | None = _decl(None, (dict, NONE), "a pipelined plan's stages and "
                                                      "schedule")
    stages: list = _decl([], list, "this rank's pipeline stages")
    actions: dict = _decl({}, dict, "a pipelined plan's schedule: per pipeline rank, its "
                                    "ordered actions (nncompile/ir/schedule.py)")
    mesh_axes: dict = _decl({}, dict, "mesh axes beyond dp, pp and plan the program uses")
    partial_grad_axes: dict = _decl({}, dict, "per such axis: the gradients summed over it")
    param_axes: dict = _decl({}, dict, "parameters split along such axes too")
    float8: dict | None = _decl(None, (dict, NONE), "float8 linears: torchao's recipe and "
                                                    "how scales are taken (runtime/program/float8.py)")


FIELDS = {f.name.upper(): f for f in dataclasses.fields(RankFile)}


def defaults() -> dict[str, Any]:
    """{ATTRIBUTE: default}: what ParallelModule holds where a file declares nothing."""
    blank = RankFile()
    return {name: getattr(blank, f.name) for name, f in FIELDS.items()}


def declare(name: str, value: Any, comment: str = "", indent: str = "    ") -> str:
    """One declaration line of a rank file, `NAME = literal  # comment`; a name RankFile does
    not define or a value of another type is a bug in codegen (AssertionError)."""
    f = FIELDS.get(name)
    assert f is not None, f"{name} is not a rank-file declaration (nncompile/rank_file.py)"
    assert isinstance(value, f.metadata["kind"]) and not (
        f.metadata["kind"] is int and isinstance(value, bool)), (name, value)
    literal = repr(value) if isinstance(value, (str, dict, list)) or value is None \
        else fmt_literal(value)
    return f"{indent}{name} = {literal}" + (f"  # {comment}" if comment else "") + "\n"


def schema_line() -> str:
    return declare("SCHEMA", SCHEMA_VERSION, "the rank-file schema (nncompile/rank_file.py)")


def read(cls: type, path: str = "") -> RankFile:
    """The declarations of a loaded GenModel class: ConfigError for a file of another
    schema version, or a declaration of the wrong type."""
    where = f" ({path})" if path else ""
    version = cls.__dict__.get("SCHEMA", getattr(cls, "SCHEMA", 0))
    if version != SCHEMA_VERSION:
        made = f"schema version {version}" if version else "before rank-file schemas"
        raise ConfigError(
            f"this rank file{where} was generated by an nncompile of {made}, and this "
            f"nncompile reads version {SCHEMA_VERSION} (nncompile/rank_file.py); regenerate "
            f"it: parallelize(..., reuse='override'), or delete the directory")
    values = {}
    for name, f in FIELDS.items():
        value = getattr(cls, name)
        if not isinstance(value, f.metadata["kind"]):
            raise ConfigError(f"this rank file{where} declares {name} = {value!r}, but "
                              f"{name} ({f.metadata['doc']}) must be of type "
                              f"{_kind_text(f.metadata['kind'])}; regenerate it")
        values[f.name] = value
    return RankFile(**values)


def _kind_text(kind) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join("None" if k is NONE else k.__name__ for k in kinds)
