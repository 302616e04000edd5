"""The IR: a Graph of Ops over Values.

A Value is a tensor (with TensorMeta) or a non-tensor produced by an op. Graph inputs are the
user's forward arguments, the module's parameters and buffers (keeping their original FQNs) and
constants computed once at load time (see passes/constant_fold.py). Every Op keeps the user's
source line and module path so printed code can point back at the model.
"""
from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator

import torch

from .. import mesh as _mesh      # module import: nncompile.mesh itself imports nncompile.ir
from ..custom_ops import is_custom_op
from .placement import Placement, Replicate, local_shape


@dataclass(frozen=True)
class TensorMeta:
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True)
class SourceInfo:
    file: str
    line: int
    code: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}  {self.code}"


@dataclass(frozen=True)
class ParamPart:
    """A parameter Value that is a piece of one original (fused) parameter: the original viewed
    as `view`, the box `[start, stop)` per view dim, reshaped to the Value's shape.

        part value = source.reshape(view)[box].reshape(value.meta.shape)

    `groups[d]`: the view dims merged into dim d of the Value (in order), so a split of the
    Value's dim d maps onto them (`part_slices`)."""
    source: str                                   # the original parameter's FQN
    source_shape: tuple[int, ...]
    view: tuple[int, ...]
    box: tuple[tuple[int, int], ...]
    groups: tuple[tuple[int, ...], ...]


# Kinds of graph inputs.
USER_INPUT, PARAM, BUFFER, CONST = "input", "param", "buffer", "const"
FREE_KINDS = (PARAM, BUFFER, CONST)     # inputs whose placement a policy chooses


class Value:
    """A tensor or non-tensor flowing along the graph's edges."""

    def __init__(self, name: str, meta: TensorMeta | None, kind: str = "op",
                 fqn: str | None = None, requires_grad: bool = False):
        self.name = name
        self.meta = meta
        self.kind = kind            # 'op' or one of the input kinds above
        self.fqn = fqn              # original module FQN for params and buffers
        self.requires_grad = requires_grad
        self.placement: Placement = Replicate()     # along the plan axis
        # along the mesh's other axes that a plan places (Graph.axes: cp, ep, ...), where
        # not Replicate; "dp" and "pp" are implicit (each unit's own batch; stages)
        self.axes: dict[str, Placement] = {}
        self.producer: Op | None = None
        self.part: ParamPart | None = None    # a piece of a fused parameter (PARAM only)

    @property
    def is_tensor(self) -> bool:
        return self.meta is not None

    def local_shape(self, n: int, axes: dict[str, int] | None = None) -> tuple[int, ...]:
        """One rank's piece: split along the plan axis of n ranks and, where placed along the
        mesh's other axes, along those (`axes`: their sizes, Graph.axes)."""
        shape = local_shape(self.meta.shape, self.placement, n)
        for axis, p in self.axes.items():
            shape = local_shape(shape, p, (axes or {})[axis])
        return shape

    def placement_on(self, axis: str) -> Placement:
        """The placement along mesh axis `axis` ("plan": `placement`)."""
        return self.placement if axis == _mesh.PLAN else self.axes.get(axis, Replicate())

    def placements(self, mesh: "_mesh.Mesh") -> tuple[Placement, ...]:
        """One placement per axis of `mesh`, outermost first (DTensor's `placements`)."""
        return tuple(self.placement_on(a) for a in mesh.names)

    def __repr__(self) -> str:
        return f"%{self.name}"


@dataclass
class Strategy:
    """How one op runs on the plan mesh: what each tensor input must be, what each output is."""
    inputs: tuple[Placement | None, ...]   # one per flattened tensor input (None: any, untouched)
    outputs: tuple[Placement, ...]
    note: str = ""                          # e.g. 'split k' — shown in plan.json and explain()
    local_target: Any = None                # op to call on local shards when it differs
    # what each tensor input must be along the mesh's other axes (Graph.axes), by axis
    axis_inputs: dict[str, tuple[Placement | None, ...]] = field(default_factory=dict)
    axis_local: tuple[str, Any] | None = None  # (axis, op on local pieces along that axis)

    @property
    def is_split(self) -> bool:
        places = [p for p in self.inputs if p is not None] + list(self.outputs)
        return any(not isinstance(p, Replicate) for p in places)


class Op:
    """One call: `outputs = target(*args, **kwargs)`. args/kwargs nest Values and literals."""

    def __init__(self, target: Any, args: tuple, kwargs: dict, outputs: list[Value],
                 source: SourceInfo | None = None, module_path: str = "",
                 multi_output: bool = False):
        self.target = target
        self.args = args
        self.kwargs = kwargs
        self.outputs = outputs
        self.source = source
        self.module_path = module_path
        self.multi_output = multi_output   # target returns a tuple/list unpacked into outputs
        self.strategy: Strategy | None = None
        self.module_stack: tuple[tuple[str, str], ...] = ()   # (module path, class), outermost first
        self.recompute: RecomputeMark | None = None
        self.stage: int | None = None      # pipeline stage (passes/pipeline_stages.py)
        self.float8: str | None = None     # a linear run in float8: its recipe (passes/float8.py)
        self.attrs: dict[str, Any] = {}    # free for user passes; nncompile reads only
        # 'attention' (passes/fuse_attention.py: what an SDPA op runs, for the plan report)
        for v in outputs:
            v.producer = self

    @property
    def name(self) -> str:
        return self.outputs[0].name if self.outputs else f"op{id(self)}"

    @property
    def target_name(self) -> str:
        return target_name(self.target)

    @property
    def is_structural(self) -> bool:
        """A lowering marker (STRUCTURAL): a stage boundary, a checkpoint region's begin or
        end, a ZeRO-3 gather / prefetch / free."""
        t = self.target
        return isinstance(t, str) and t.partition(".")[0] in STRUCTURAL

    @property
    def is_inplace(self) -> bool:
        """An aten in-place op (`add_`), not a dunder (`__and__`)."""
        name = getattr(self.target, "_opname", "")
        return name.endswith("_") and not name.endswith("__")

    def inputs(self) -> list[Value]:
        """Flattened tensor/value inputs, in argument order (kwargs after args)."""
        out: list[Value] = []
        for x in self.args:
            if type(x) is Value:
                out.append(x)
            elif type(x) not in _ATOMS:
                _values_into((x,), out)
        if self.kwargs:
            _values_into(self.kwargs.values(), out)
        return out

    def tensor_inputs(self) -> list[Value]:
        return [v for v in self.inputs() if v.meta is not None]

    def map_values(self, fn: Callable[[Value], Any]) -> None:
        """Replace every Value v in args/kwargs with fn(v)."""
        self.args = map_nested(self.args, fn)
        self.kwargs = map_nested(self.kwargs, fn)

    def __repr__(self) -> str:
        return f"Op({self.target_name} -> {self.outputs})"


_OVERLOAD_NAMES: dict[Any, str] = {}      # an op overload's name never changes: remembered


def target_name(target: Any) -> str:
    if isinstance(target, str):
        return target
    if isinstance(target, torch._ops.OpOverload):
        name = _OVERLOAD_NAMES.get(target)
        if name is None:
            if is_custom_op(target):                          # nncompile.register_op
                name = f"custom.{target._opname}"
            elif target.namespace == "aten":
                name = f"aten.{target._opname}.{target._overloadname}"
            else:
                name = f"torch.ops.{target.namespace}.{target._opname}.{target._overloadname}"
            _OVERLOAD_NAMES[target] = name
        return name
    if getattr(torch, getattr(target, "__name__", ""), None) is target:
        return f"torch.{target.__name__}"            # e.g. torch.tensor for a small constant
    return getattr(target, "__qualname__", repr(target))


def _values_into(items: Any, out: list) -> None:
    """Append the Values nested in `items` (an iterable of args) to out, in flatten's order."""
    for x in items:
        if isinstance(x, Value):
            out.append(x)
        elif isinstance(x, (list, tuple)):
            _values_into(x, out)
        elif isinstance(x, dict):
            _values_into(x.values(), out)


def flatten(obj: Any) -> Iterator[Any]:
    if isinstance(obj, (list, tuple)):
        for x in obj:
            yield from flatten(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from flatten(x)
    else:
        yield obj


_ATOMS = frozenset({int, float, bool, str, type(None), torch.dtype, torch.device})


def map_nested(obj: Any, fn: Callable[[Value], Any]) -> Any:
    t = type(obj)
    if t is Value:
        return fn(obj)
    if t in _ATOMS:
        return obj
    if t is tuple:
        return tuple([map_nested(x, fn) for x in obj])
    if t is list:
        return [map_nested(x, fn) for x in obj]
    if isinstance(obj, Value):
        return fn(obj)
    if isinstance(obj, list):
        return [map_nested(x, fn) for x in obj]
    if isinstance(obj, tuple):
        return tuple([map_nested(x, fn) for x in obj])
    if isinstance(obj, dict):
        return {k: map_nested(x, fn) for k, x in obj.items()}
    return obj


class Stage(enum.Enum):
    """What the passes so far established about a graph: the pass contracts. A pass declares
    the stages it `requires` and `produces`; run_pipeline checks both."""
    FOLDED = "constants folded into load-time ops"
    PLANNED = "every op has a strategy and every value a placement"
    COMM_INSERTED = "every placement change is an explicit collective"
    RECOMPUTE_MARKED = "ops of recomputed modules are marked with their region"
    LOCALIZED = "ops run on one rank's shards (local sizes, local implementations)"
    STAGED = "every op of the forward belongs to a pipeline stage"
    # lowering: what codegen used to add as text is in the IR (structural ops, below)
    SPLIT = "the forward is cut into stage programs: pipeline.stage / pipeline.send ops"
    ZERO3_LOWERED = "ZeRO-3 parameter gathers, prefetches and frees are zero.* ops"
    RECOMPUTE_LOWERED = "checkpoint regions are checkpoint.begin / checkpoint.end ops"


# Structural ops: string targets in these namespaces mark where the program gathers ZeRO-3
# parameters, where a checkpoint region or a pipeline stage begins and ends. They compute no
# tensor (no outputs); the lowering passes add them, the renderer (codegen) prints them.
STRUCTURAL = ("pipeline", "checkpoint", "zero")


@dataclass(frozen=True)
class RecomputeMark:
    """The recompute region an op belongs to: its module instance and a running number."""
    module_path: str
    region: int


@dataclass
class TraceInfo:
    """What the frontend learned about the module: for codegen, checkpoints and calls."""
    model: str = "?"                                   # module.class of the traced model
    input_names: list[str] = field(default_factory=list)
    args: list[tuple] = field(default_factory=list)    # forward's arguments as traced
    signature: list[str] = field(default_factory=list)  # forward's positional parameters
    defaults: dict[str, Any] = field(default_factory=dict)  # untraced arguments' defaults
    param_order: list[str] = field(default_factory=list)    # module.parameters() by FQN
    state_keys: list[tuple[str, str]] = field(default_factory=list)  # (key, canonical FQN)
    inference_only: bool = False
    training: bool = True          # the module's mode when traced (the generated module starts in it)
    # buffers forward updates (BatchNorm's running statistics), by FQN: their new values are
    # the graph's last outputs, in this order (the runtime writes them back in training mode)
    buffer_updates: list[str] = field(default_factory=list)
    microbatches: int = 1          # the batch was traced split into this many (train_step)
    batched: list[str] = field(default_factory=list)   # inputs split into micro-batches
    sizes: dict[str, tuple] = field(default_factory=dict)   # dynamic: s_name -> (min, max, mult)
    # module paths in ops' module_stack that are not the module's FQN (a module called from
    # two places, weights shared: torch.export names each call by its access path) -> FQN
    module_aliases: dict[str, str] = field(default_factory=dict)
    # modules the model checkpoints itself (torch.utils.checkpoint): recomputed by the plan
    checkpointed: list[str] = field(default_factory=list)
    eval_error: str | None = None     # eval mode could not be traced: refused at run time
    train_error: str | None = None    # training mode could not be traced (eval-only module)


@dataclass
class MemoryChoice:
    """How a plan stores its training state (ComputeConfig's values, or autodist's choice for
    "auto"): the ZeRO stage, whether optimizer state / ZeRO-3 parameter shards live in host
    memory, and the modules recomputed in backward."""
    zero: int = 0
    offload_optimizer: bool = False
    offload_params: bool = False
    recompute: tuple[str, ...] = ()


@dataclass
class PipelinePlan:
    """The pipeline cut (passes/pipeline_stages.py): S pipeline ranks of `tp` tensor-parallel
    ranks, `nstages` = S * V stages, each a run of whole layers."""
    ranks: int                     # S
    stages_per_rank: int           # V
    schedule: str
    microbatches: int
    tp: int
    layers: list[list[str]]        # per stage: the layers (module paths) it runs
    predicted_ms: list[float]      # per stage: the cost model's forward+backward time
    memory_bytes: list[float] = field(default_factory=list)   # per stage, in-flight included
    chosen_by: str = "layer cost"  # what chose the cuts (and S, under "auto")
    actions: Any = None            # ir.schedule.PipelineActions (passes/pipeline_schedule.py)

    @property
    def nstages(self) -> int:
        return self.ranks * self.stages_per_rank


@dataclass
class PlanState:
    """What the plan passes decided, for the passes after them and for codegen."""
    policy: str = "?"
    memory: MemoryChoice | None = None     # None: ComputeConfig's explicit values
    autodist: dict | None = None           # autodist's explanation data (plan_report)
    partial_grad_params: list[str] = field(default_factory=list)   # summed by the runtime
    # per mesh axis beyond plan (Graph.axes): the parameters whose gradients the runtime sums
    # over it (every use reads them whole there while running on pieces)
    axis_partial_grad: dict[str, list[str]] = field(default_factory=dict)
    # mesh axes whose splits are in the zigzag order (context parallelism's load balance:
    # rank r holds chunks r and 2C-1-r of 2C); their chunk/gather collectives say zigzag=True
    zigzag_axes: tuple[str, ...] = ()
    recompute_regions: int = 0
    pipeline: PipelinePlan | None = None
    # ZeRO-3's flat parameters (passes/lower_zero3.py), per pipeline rank (0 without a
    # pipeline): [(flat attribute, unit path, local parameter names)] in order of first use
    zero_units: dict[int, list[tuple[str, str, tuple[str, ...]]]] | None = None
    # the eval program's parameters and buffers, placed as the training program placed them
    # (they read its shards: nncompile/modes.py); a policy keeps them, autodist's ILP fixes them
    pinned: dict[str, Placement] = field(default_factory=dict)
    # what the plan left out of what the configuration asked for (passes/dropped.py)
    dropped: tuple[dict, ...] = ()
    # autodist's pipeline candidates and why (passes/pipeline_stages.py), for plan.json
    pipeline_search: dict | None = None
    eval_differs: bool = False        # pipelined: the eval forward differs, pm.eval() refused
    # the mesh the planner (passes/planner.py) hands the policy: its tensor ranks, and the
    # experts' split: 1, the tensor ranks (each MoE layer dispatches on them) or an ep axis's
    # size (graph.axes); None outside a compile (a policy called on a traced graph: the
    # config's plan_ngpus and parallel.ep; passes/contract.py tensor_ranks, experts_split)
    tensor_ranks: int | None = None
    experts: int | str | None = None
    # float8 (passes/float8.py): {"recipe", "scales", "layers": {FQN: "float8" or why not},
    # "zero3_gather": {weight FQN: "float8" or why high precision}}
    float8: dict | None = None
    # ZeRO-3 units' weights gathered in float8 (passes/float8.py zero3_float8_gathers):
    # {local parameter name: the mesh axes the plan splits it along}
    zero_float8: dict[str, list[str]] | None = None


@dataclass
class Graph:
    """A traced forward. `inputs` are the user's arguments in call order; `outputs` are the
    flattened return values (Values or literals), rebuilt with `out_spec` (a pytree spec string)."""
    inputs: list[Value]
    params: list[Value]
    buffers: list[Value]
    ops: list[Op]
    outputs: list[Any]
    const_ops: list[Op] = field(default_factory=list)   # evaluated once at load time
    out_spec: str = ""
    plan_ngpus: int = 1
    meta: dict[str, Any] = field(default_factory=dict)   # free for user passes; unread here
    stages: frozenset = frozenset()                      # Stage members established so far
    trace_info: TraceInfo = field(default_factory=TraceInfo)
    plan_state: PlanState = field(default_factory=PlanState)
    runtime_ngpus: int | None = None    # the job's ranks (None: one plan unit); see `mesh`
    # mesh axes beyond dp, pp and plan that the plan places values on ({"cp": 2}), outermost
    # first; each its own process group (`<AXIS>_GROUP` in the generated code)
    axes: dict[str, int] = field(default_factory=dict)
    # the eval-mode program, where the forward differs in eval mode beyond mode flags
    # (nncompile/modes.py): traced beside this one, planned after it with its placements
    eval_program: "Graph | None" = None
    # a pipeline stage's graph (passes/split_stages.py): the inputs it sends on unchanged
    relayed: list = field(default_factory=list)
    # what the compile was asked for: the user's ComputeConfig (its ParallelSpec in
    # config.parallel), set once before the passes and never rewritten; passes read it here
    # (counts keep the meaning the config documents: plan_ngpus is a plan unit's ranks, while
    # this graph's own plan_ngpus and axes are the mesh the plan is made on)
    config: Any = None

    @property
    def mesh(self) -> "_mesh.Mesh":
        """The job's device mesh ("dp", ["pp",] "plan"), made from plan_ngpus (under a
        pipeline: the pipeline's ranks of pp.tp tensor-parallel ranks) and runtime_ngpus; the
        1-unit mesh of the plan until the compile sets runtime_ngpus. Derived, so it follows
        the passes that change the plan size or cut the pipeline."""
        return self.mesh_over(self.runtime_ngpus)

    def mesh_over(self, runtime_ngpus: int | None) -> "_mesh.Mesh":
        """This graph's mesh for a job of `runtime_ngpus` ranks (None: one plan unit)."""
        pp = self.plan_state.pipeline
        extra = 1
        for size in self.axes.values():
            extra *= size
        # a stage's pp.tp ranks are its axes' (cp) times its plan's
        tp, pipe = (pp.tp // extra, pp.ranks) if pp is not None else (self.plan_ngpus, 1)
        return _mesh.Mesh.of(tp, runtime_ngpus or tp * pipe * extra, pipe, self.axes)

    @property
    def consts(self) -> list[Value]:
        """Constant values the forward reads (outputs of const_ops marked CONST)."""
        return [v for op in self.const_ops for v in op.outputs if v.kind == CONST]

    def all_inputs(self) -> list[Value]:
        """User inputs, parameters and buffers (constants are produced by const_ops)."""
        return self.inputs + self.params + self.buffers

    def values(self) -> Iterator[Value]:
        yield from self.all_inputs()
        for op in self.const_ops:
            yield from op.outputs
        for op in self.ops:
            yield from op.outputs

    def users(self) -> dict[Value, list[Op]]:
        out: dict[Value, list[Op]] = {v: [] for v in self.values()}
        for op in itertools.chain(self.const_ops, self.ops):
            for v in op.inputs():
                out.setdefault(v, []).append(op)
        return out

    def fresh_name(self, base: str) -> str:
        taken = getattr(self, "_taken", None)
        if taken is None:
            taken = self._taken = {v.name for v in self.values()}
        name, i = base, 1
        while name in taken:
            name = f"{base}_{i}"
            i += 1
        taken.add(name)
        return name

    def clone(self) -> "Graph":
        """A deep copy of the structure (targets and literals are shared)."""
        vmap: dict[Value, Value] = {}

        def cv(v: Value) -> Value:
            nv = vmap.get(v)
            if nv is None:
                nv = vmap[v] = Value(v.name, v.meta, v.kind, v.fqn, v.requires_grad)
                nv.placement, nv.part = v.placement, v.part
                if v.axes:
                    nv.axes = dict(v.axes)
            return nv

        def cop(op: Op) -> Op:
            new = Op(op.target, map_nested(op.args, cv), map_nested(op.kwargs, cv),
                     [cv(v) for v in op.outputs], op.source, op.module_path, op.multi_output)
            s = op.strategy
            new.strategy = None if s is None else Strategy(
                s.inputs, s.outputs, s.note, s.local_target, dict(s.axis_inputs),
                s.axis_local) \
                if type(s) is Strategy else replace(s)
            new.attrs = dict(op.attrs)
            new.module_stack, new.recompute = op.module_stack, op.recompute
            new.stage = op.stage
            new.float8 = op.float8
            return new

        ins = [cv(v) for v in self.inputs]
        params = [cv(v) for v in self.params]
        bufs = [cv(v) for v in self.buffers]
        const_ops = [cop(op) for op in self.const_ops]
        ops = [cop(op) for op in self.ops]
        outs = map_nested(list(self.outputs), cv)
        return Graph(ins, params, bufs, ops, outs, const_ops, self.out_spec,
                     self.plan_ngpus, dict(self.meta), self.stages, replace(self.trace_info),
                     replace(self.plan_state,
                             partial_grad_params=list(self.plan_state.partial_grad_params)),
                     self.runtime_ngpus, dict(self.axes), self.eval_program,
                     list(self.relayed), self.config)
