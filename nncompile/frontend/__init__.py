"""Frontend: torch.export (non-strict) → nncompile IR.

`trace(module, dummy_args)` runs the module's forward on fake tensors, keeps high-level aten ops
(linear, layer_norm, scaled_dot_product_attention, ...) and returns a Graph whose params and
buffers keep their original FQNs and whose ops keep the user's `file:line` and module path.
"""
from __future__ import annotations

import inspect
import operator
import re
from typing import Any

import torch
import torch.fx
from torch.export import ExportedProgram
from torch.export.graph_signature import ConstantArgument, InputKind, OutputKind
from torch.utils import _pytree as pytree

from .. import symbolic
from . import layer_replay, module_paths, trace_memo, user_checkpoint
from .data_dependent import refuse_data_dependent
from .exporting import _DROPPED, _export_replaying, export, functionalize  # noqa: F401
from .function_watch import user_frame_from_text
from .layerdrop import static_layerdrop
from ..errors import ConfigError, TraceError
from .. import arguments
from ..ir import BUFFER, PARAM, USER_INPUT, Graph, Op, TensorMeta, TraceInfo, Value

_NON_DIFFERENTIABLE = {"detach", "detach_", "lift_fresh_copy", "zeros_like", "ones_like",
                       "empty_like", "full_like", "arange"}


def normalize_args(module: torch.nn.Module, dummy_args: Any) -> tuple[tuple, dict]:
    """Check dummy_args against forward's signature; return (args, kwargs) for torch.export."""
    sig = inspect.signature(module.forward)
    if isinstance(dummy_args, dict):
        params = sig.parameters
        takes_kwargs = any(p.kind == p.VAR_KEYWORD for p in params.values())
        unknown = [k for k in dummy_args if k not in params]
        if unknown and not takes_kwargs:
            raise ConfigError(
                f"dummy_args has keys {unknown} that {type(module).__name__}.forward does not "
                f"take; forward's arguments are {list(params)}. Pass a dict keyed by those names.")
        return (), dict(dummy_args)
    if isinstance(dummy_args, (tuple, list)):
        try:
            sig.bind(*dummy_args)
        except TypeError as e:
            raise ConfigError(f"dummy_args {type(dummy_args).__name__} of {len(dummy_args)} "
                              f"does not fit {type(module).__name__}.forward{sig}: {e}") from None
        return tuple(dummy_args), {}
    if isinstance(dummy_args, torch.Tensor):
        return (dummy_args,), {}
    raise ConfigError("dummy_args must be a dict of forward's keyword arguments or a tuple of "
                      f"its positional arguments, not {type(dummy_args).__name__}")


def _meta_of(val: Any, sizes: symbolic.SymbolMap | None = None) -> TensorMeta | None:
    if isinstance(val, torch.Tensor):
        if sizes is None:
            return TensorMeta(tuple(int(s) for s in val.shape), val.dtype)
        return TensorMeta(tuple(sizes.sym(s) for s in val.shape), val.dtype)
    return None


def _sanitize(path: str) -> str:
    parts = [p for p in path.split(".") if p]
    out: list[str] = []
    for p in parts:
        if p.isdigit() and out:
            out[-1] += p
        else:
            out.append(re.sub(r"\W", "_", p))
    return "_".join(out)


def _canonical(module: torch.nn.Module) -> dict[int, str]:
    """id(parameter or buffer) -> the FQN it is known by (the first of tied names)."""
    canonical: dict[int, str] = {}
    for name, p in module.named_parameters():
        canonical.setdefault(id(p), name)
    for name, b in module.named_buffers():
        canonical.setdefault(id(b), name)
    return canonical


class _Lowering:
    def __init__(self, ep: ExportedProgram, module: torch.nn.Module,
                 runs: list[layer_replay.Run] = (), canonical: dict[int, str] | None = None,
                 dynamic: dict[str, dict[int, symbolic.SizeSpec]] | None = None):
        self.ep = ep
        self.dynamic = dynamic or {}
        self.sizes = symbolic.SymbolMap() if dynamic else None
        self.module = module
        self.env: dict[torch.fx.Node, Any] = {}
        self.names: set[str] = set()
        self.clean: dict[str, str] = {}         # fresh(): base -> its identifier form
        self.suffix: dict[str, int] = {}        # fresh(): base -> the next suffix to try
        self.prefixes: dict[str, str] = {}      # base(): module path -> name prefix
        self.ops: list[Op] = []
        self.canonical = _canonical(module) if canonical is None else canonical
        self.by_fqn: dict[str, Value] = {}      # tied weights: one Value per tensor
        self.runs = {r.id: r for r in runs}
        self.replay_ops = layer_replay.ops() if runs else ()
        self.regions: dict[tuple, layer_replay.Region] = {}
        self.open: layer_replay.Region | None = None
        self.anchored: set[int] = set()         # ids of Values asserts read (has_dead_ops)

    def fresh(self, base: str) -> str:
        clean = self.clean.get(base)
        if clean is None:
            clean = re.sub(r"\W", "_", base).strip("_") or "v"
            if clean[0].isdigit():
                clean = "v" + clean
            self.clean[base] = clean
        base = clean
        name = base
        if name in self.names or name in _RESERVED:
            # the smallest free suffix; those below the last one found are still taken
            i = self.suffix.get(base, 1)
            name = f"{base}_{i}"
            while name in self.names or name in _RESERVED:
                i += 1
                name = f"{base}_{i}"
            self.suffix[base] = i + 1
        self.names.add(name)
        return name

    def canonical_fqn(self, target: str) -> str:
        try:
            obj = self.module.get_parameter(target)
        except AttributeError:
            try:
                obj = self.module.get_buffer(target)
            except AttributeError:
                return target
        return self.canonical.get(id(obj), target)

    def trainable(self, target: str) -> bool:
        """A frozen parameter (requires_grad=False, as LoRA's base weights) stays frozen."""
        try:
            return self.module.get_parameter(target).requires_grad
        except AttributeError:
            return True

    def run(self) -> Graph:
        sig = self.ep.graph_signature
        params, buffers, inputs = [], [], []
        const_literal_ops: list[Op] = []
        by_fqn = self.by_fqn
        placeholders = [n for n in self.ep.graph.nodes if n.op == "placeholder"]
        if self.sizes is not None:
            self._bind_sizes(sig, placeholders)
        for spec, node in zip(sig.input_specs, placeholders):
            meta = _meta_of(node.meta.get("val"), self.sizes)
            if spec.kind == InputKind.PARAMETER:
                fqn = self.canonical_fqn(spec.target)
                v = by_fqn.get(fqn)
                if v is None:
                    v = by_fqn[fqn] = Value(self.fresh(_sanitize(fqn)), meta, PARAM, fqn,
                                            requires_grad=self.trainable(spec.target))
                    params.append(v)
            elif spec.kind == InputKind.BUFFER:
                fqn = self.canonical_fqn(spec.target)
                v = by_fqn.get(fqn)
                if v is None:
                    v = by_fqn[fqn] = Value(self.fresh(_sanitize(fqn)), meta, BUFFER, fqn)
                    buffers.append(v)
            elif spec.kind == InputKind.CONSTANT_TENSOR:
                v = self._lifted_constant(spec.target, const_literal_ops)
            elif spec.kind == InputKind.USER_INPUT and isinstance(spec.arg, ConstantArgument):
                self.env[node] = spec.arg.value    # None/bool/int/float/str: compiled in
                continue
            elif spec.kind == InputKind.USER_INPUT:
                # a dummy input that requires grad (an embedding computed outside the module,
                # a gradient penalty's input): the plan must sum its gradient over the unit
                val = node.meta.get("val")
                v = Value(self.fresh(node.name), meta, USER_INPUT,
                          requires_grad=bool(getattr(val, "requires_grad", False)))
                inputs.append(v)
            else:
                raise TraceError(f"unsupported input kind {spec.kind} for {node.name}")
            self.env[node] = v
        self.ops.extend(const_literal_ops)
        for spec in sig.output_specs:
            if spec.kind not in (OutputKind.USER_OUTPUT, OutputKind.BUFFER_MUTATION):
                what = "an input" if spec.kind == OutputKind.USER_INPUT_MUTATION else \
                    "a parameter" if spec.kind == OutputKind.PARAMETER_MUTATION else "a tensor"
                raise TraceError(
                    f"forward writes in place into {what} ({spec.target!r}, "
                    f"{spec.kind.name}); only buffers may be updated in forward (BatchNorm's "
                    "running statistics): compute a new tensor out of place and return it")
        outputs = self._run_graph(self.ep.graph_module, no_grad=False)
        spec = pytree.treespec_dumps(self.ep.call_spec.out_spec) if self.ep.call_spec.out_spec \
            else ""
        # buffer updates (BatchNorm's running statistics): torch.export returns each buffer's
        # new value; they follow the user's outputs, and trace_info names their buffers
        user, updates, renamed = [], {}, set()
        for out_spec, v in zip(sig.output_specs, outputs):
            if out_spec.kind == OutputKind.BUFFER_MUTATION:
                fqn = self.canonical_fqn(out_spec.target)
                updates[fqn] = v
                if isinstance(v, Value) and v.kind == "op" and id(v) not in renamed:
                    renamed.add(id(v))          # bn1_running_mean_new, not ..._functional_3
                    v.name = self.fresh(_sanitize(fqn) + "_new")
            else:
                user.append(v)
        graph = Graph(inputs, params, buffers, self.ops, user + list(updates.values()),
                      out_spec=spec)
        graph.trace_info.buffer_updates = list(updates)
        return graph

    def _bind_sizes(self, sig, placeholders: list[torch.fx.Node]) -> None:
        """Name torch.export's size symbols after dynamic_dims, with the ranges it proved."""
        ranges = {str(k): v for k, v in self.ep.range_constraints.items()}
        for spec, node in zip(sig.input_specs, placeholders):
            dims = self.dynamic.get(getattr(spec.arg, "name", None)) or \
                self.dynamic.get(node.name)
            if spec.kind != InputKind.USER_INPUT or not dims:
                continue
            for d, size_spec in dims.items():
                size = node.meta["val"].shape[d]
                expr = getattr(getattr(size, "node", None), "expr", None)
                vr = ranges.get(str(expr))
                lo = int(vr.lower) if vr is not None and vr.lower.is_finite else size_spec.min
                hi = int(vr.upper) if vr is not None and vr.upper.is_finite else size_spec.max
                dims[d] = self.sizes.bind(size_spec, size, lo, hi)

    def _lifted_constant(self, target: str, ops: list[Op]) -> Value:
        t = self.ep.constants[target]
        if not isinstance(t, torch.Tensor) or t.numel() > 64:
            raise TraceError(f"forward creates a tensor constant {target!r} of "
                             f"{getattr(t, 'shape', '?')} elements; only small constants "
                             "(≤ 64 elements) are supported yet: register it as a buffer")
        v = Value(self.fresh("const"), TensorMeta(tuple(t.shape), t.dtype))
        ops.append(Op(torch.tensor,
                      (t.tolist(),), {"dtype": t.dtype, "device": torch.device("cpu")}, [v]))
        return v

    def _run_graph(self, gm: torch.fx.GraphModule, no_grad: bool, args: list | None = None):
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        if args is not None:
            for n, a in zip(placeholders, args):
                self.env[n] = a
        for node in gm.graph.nodes:
            if node.op == "placeholder" or node.op == "get_attr":
                continue
            if node.op == "output":
                return pytree.tree_map(self._lookup, tuple(node.args[0]))
            if node.op != "call_function":
                raise TraceError(f"unsupported fx node {node.op} {node.target}")
            self._lower_call(gm, node, no_grad)
        return ()

    def _lookup(self, x: Any) -> Any:
        if isinstance(x, torch.fx.Node):
            return self.env[x]
        return x

    def _lower_call(self, gm: torch.fx.GraphModule, node: torch.fx.Node, no_grad: bool) -> None:
        target = node.target
        val = node.meta.get("val")
        refuse_data_dependent(self.module, node, val)
        if self.sizes is not None and isinstance(val, (torch.SymInt, torch.SymBool,
                                                       torch.SymFloat)):
            # size arithmetic (sym_size, operator.mul, ...) becomes a literal: a Sym size, or
            # the value at the dummy args of what only asserts read
            self.env[node] = self.sizes.sym(val) if isinstance(val, torch.SymInt) else \
                val.node.hint
            return
        if target is operator.getitem:
            self.env[node] = self.env[node.args[0]][node.args[1]]
            return
        if self.sizes is None and getattr(target, "__module__", None) == "_operator" and \
                isinstance(val, (bool, int, float, torch.SymInt, torch.SymBool, torch.SymFloat)):
            # static shapes: size arithmetic and comparisons some torch versions keep as
            # Python operators (torch 2.11: Mixtral's router loss compares sizes) are
            # constants at the traced shapes
            self.env[node] = val.node.hint if isinstance(
                val, (torch.SymInt, torch.SymBool, torch.SymFloat)) else val
            return
        if isinstance(target, torch._ops.HigherOrderOperator):
            self._inline_hop(gm, node, no_grad)
            return
        if not isinstance(target, torch._ops.OpOverload):
            raise TraceError(f"unsupported call {target} at {node.meta.get('stack_trace', '')}")
        if target in self.replay_ops:
            self._replay(node, target, no_grad)
            return
        opname = target._opname
        if opname in _DROPPED:
            self.env[node] = None
            # what an assert reads stays in the graph (dead-code elimination keeps it)
            self.anchored.update(id(v) for v in pytree.tree_leaves(
                pytree.tree_map(self._lookup, (node.args, dict(node.kwargs))))
                if isinstance(v, Value))
            return
        if opname == "detach_":
            target = torch.ops.aten.detach.default
        args = pytree.tree_map(self._lookup, node.args)
        kwargs = pytree.tree_map(self._lookup, dict(node.kwargs))
        if target is torch.ops.aten.copy.default and isinstance(args[1], Value) \
                and args[0].meta.shape == args[1].meta.shape:
            # functionalized `dst.copy_(src)`: aten.copy has no derivative; src (cast to dst's
            # dtype) is the same value and differentiable
            dst, src = args[:2]
            target, args, kwargs = torch.ops.aten._to_copy.default, (src,), \
                {"dtype": dst.meta.dtype}
            self.anchored.add(id(dst))      # read no more, but kept (has_dead_ops)
        ins = [v for v in pytree.tree_leaves((args, kwargs)) if isinstance(v, Value)]
        grad_in = self.grad_in(opname, no_grad, ins)
        module_path = ""
        stack = node.meta.get("nn_module_stack")
        if stack:
            module_path = list(stack.values())[-1][0]
        base = self.base(module_path, opname)

        def make(v: Any) -> Value:
            meta = _meta_of(v, self.sizes)
            rg = grad_in and meta is not None and (meta.dtype.is_floating_point
                                                   or meta.dtype.is_complex)
            return Value(self.fresh(base), meta, requires_grad=rg)

        multi = isinstance(val, (list, tuple))
        outputs = [make(v) for v in val] if multi else [make(val)]
        source = user_frame_from_text(node.meta.get("stack_trace", ""))
        op = Op(target, tuple(args), kwargs, outputs, source, module_path, multi_output=multi)
        if stack:       # (path, class name) from the outermost module in: recompute_modules
            op.module_stack = tuple((path, str(getattr(cls, "__name__", cls))
                                              .rsplit(".", 1)[-1])
                                             for path, cls in stack.values() if path)
        self.ops.append(op)
        if self.open is not None:
            self.open.info.append((opname, no_grad))
        self.env[node] = list(outputs) if multi else outputs[0]

    def _replay(self, node: torch.fx.Node, target: Any, no_grad: bool) -> None:
        """A layer_replay op: a template's probe (where its ops begin and end, its inputs and
        outputs) or a replayed layer, lowered as a copy of its template's ops."""
        values = [self._lookup(a) for a in node.args[0]]
        run, member, last = self.runs[node.args[1]], node.args[2], node.args[3]
        key = (run.id, member)
        self.env[node] = None
        if target is self.replay_ops[0]:
            if last == 0:
                if self.open is not None or key in self.regions:
                    raise layer_replay.NoReplay("nested or repeated template")
                self.open = self.regions[key] = layer_replay.Region(
                    run, run.members[member], len(self.ops), values, no_grad)
            else:
                region = self.open
                if region is None or self.regions.get(key) is not region:
                    raise layer_replay.NoReplay("unbalanced probes")
                region.ops, region.outputs = self.ops[region.start:], values
                self.open = None
            return
        region = self.regions.get((run.id, last))
        if region is None or self.open is not None or region.no_grad != no_grad \
                or region.ops is None:
            raise layer_replay.NoReplay("no template to copy")
        self.env[node] = layer_replay.copy_region(self, region, run.members[member], values)

    def base(self, module_path: str, opname: str) -> str:
        """The name an op's outputs are made from: its module path and op name."""
        prefix = self.prefixes.get(module_path)
        if prefix is None:
            prefix = self.prefixes[module_path] = \
                _sanitize(module_path) + "_" if module_path else ""
        return prefix + opname

    @staticmethod
    def grad_in(opname: str, no_grad: bool, ins: list) -> bool:
        """Whether an op's floating outputs need a gradient."""
        return (not no_grad) and opname not in _NON_DIFFERENTIABLE \
            and any(v.requires_grad for v in ins)

    def _inline_hop(self, gm: torch.fx.GraphModule, node: torch.fx.Node, no_grad: bool) -> None:
        """Inline a region op (a no-grad or autocast block) whose body is a submodule."""
        name = str(node.target)
        if "set_grad_enabled" not in name and "autocast" not in name:
            raise TraceError(f"unsupported higher-order op {name}")
        if "set_grad_enabled" in name:
            no_grad = no_grad or not node.args[0]
        pos = next(i for i, a in enumerate(node.args)
                   if isinstance(a, torch.fx.Node) and a.op == "get_attr")
        submod = getattr(gm, node.args[pos].target)
        out = self._run_graph(submod, no_grad, [self._lookup(a) for a in node.args[pos + 1:]])
        self.env[node] = list(out)


_RESERVED = {"self", "torch", "aten", "comm", "DEVICE", "PLAN_GROUP", "forward", "return",
             "input", "type", "len", "list", "dict", "id", "sum", "max", "min", "abs", "pow",
             "slice", "format", "print", "range", "super", "object", "float", "int", "bool"}


def trace(module: torch.nn.Module, dummy_args: Any, dynamic_dims: Any = None,
          modes: bool = False) -> Graph:
    """Trace `module.forward` on `dummy_args` into an IR Graph (the module is not modified).
    dynamic_dims: sizes that vary between calls (nncompile/symbolic.py). modes: trace the
    training and eval modes (nncompile/modes.py, what parallelize does); False: the module's
    current mode only. A model traced before in this process on equal args is not traced
    again (trace_memo.py)."""
    memo_key = trace_memo.key(module, dummy_args, dynamic_dims, modes)
    kept = trace_memo.get(memo_key)
    if kept is not None:
        graph, notes = kept
        layer_replay.last.clear()
        layer_replay.last.update(notes)
        return graph
    if modes:
        from ..modes import trace_modes
        graph = trace_modes(module, dummy_args, dynamic_dims)
    else:
        graph = _trace(module, dummy_args, dynamic_dims)
    trace_memo.put(memo_key, graph, layer_replay.last)
    return graph


def _trace(module: torch.nn.Module, dummy_args: Any, dynamic_dims: Any) -> Graph:
    args, kwargs = normalize_args(module, dummy_args)
    user_checkpoint.start()
    arguments.register_dataclasses((args, kwargs))
    positional, defaults = arguments.literal_defaults(module.forward)
    items = arguments.entries(positional, args, kwargs)
    arguments.check_constants(items)
    dynamic = symbolic.parse_dynamic_dims(
        dynamic_dims, [k for k, v in items if isinstance(v, torch.Tensor)])
    shapes = symbolic.export_dims(dynamic, items) if dynamic else None
    # every input its own tensor: the same tensor passed twice (labels=input_ids) or two views
    # of one storage would be traced as one input, and code would read one where the other
    # belongs
    args, kwargs = pytree.tree_map(
        lambda x: x.clone() if isinstance(x, torch.Tensor) else x, (args, kwargs))
    canonical = _canonical(module)
    graph = None
    runs = [] if dynamic else layer_replay.find_runs(module, canonical)
    layer_replay.last.clear()
    with static_layerdrop(module):
        replayed = _export_replaying(module, args, kwargs, runs) if runs else None
    if replayed is not None:
        ep, functionalized = replayed
        try:
            lowering = _Lowering(ep, module, runs, canonical)
            graph = lowering.run()
            if functionalized and layer_replay.has_dead_ops(graph, lowering.anchored):
                raise layer_replay.NoReplay("dead code a full trace would not have")
            layer_replay.last.update(replayed=sum(r.replayed for r in runs))
        except Exception as e:  # noqa: BLE001 - NoReplay, or what the full trace reports
            graph = None
            layer_replay.last.update(fallback=f"{type(e).__name__}: {e}")
    elif runs:
        layer_replay.last.update(fallback="export with replay failed or a template writes "
                                          "in place")
    if graph is None:
        with static_layerdrop(module):
            ep = export(module, args, kwargs, shapes)
        lowering = _Lowering(ep, module, canonical=canonical, dynamic=dynamic)
        graph = lowering.run()
    for op in graph.ops:
        if getattr(op.target, "_schema", None) is not None and op.target._schema.is_mutable:
            where = f" at {op.source.file}:{op.source.line}" if op.source else ""
            raise TraceError(f"{op.target_name}{where} writes into a tensor in place and could "
                             "not be made functional; rewrite it out of place (x = x.add(y)) or "
                             "wrap it in nncompile.register_op")
    # what the original module's state_dict() and parameters() look like, so checkpoints can
    # be merged back into a state dict that module (and its optimizer) loads
    canonical = {}
    for name, t in list(module.named_parameters()) + list(module.named_buffers()):
        canonical.setdefault(id(t), name)
    input_names = [v.name for v in graph.inputs]
    graph.trace_info = TraceInfo(
        model=f"{type(module).__module__}.{type(module).__qualname__}",
        input_names=input_names, args=arguments.record(items, input_names),
        signature=positional,
        buffer_updates=graph.trace_info.buffer_updates,
        defaults={k: v for k, v in defaults.items() if k not in dict(items)},
        param_order=[name for name, _ in module.named_parameters()],
        state_keys=[(key, canonical.get(id(t), key))
                    for key, t in module.state_dict(keep_vars=True).items()])
    if dynamic:
        graph.trace_info.sizes = {s.var: (s.min, s.max, s.multiple_of)
                                  for s in lowering.sizes.specs.values()}
    graph.trace_info.module_aliases = module_paths.aliases(module, graph)
    checkpointed = user_checkpoint.checkpointed_modules(module)
    for run in runs:            # layers copied from a traced one are checkpointed as it is
        paths = [m.path for m in run.members]
        if any(p in checkpointed for p in paths):
            checkpointed += [p for p in paths if p not in checkpointed]
    if checkpointed:        # torch.utils.checkpoint in the model: recomputed by the plan
        graph.trace_info.checkpointed = checkpointed
    return graph

