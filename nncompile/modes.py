"""Train and eval modes: `pm.train()` / `pm.eval()` change what the generated code does as
`model.train()` / `model.eval()` change the model.

The frontend traces the module in training mode and, where the module may depend on its mode,
in eval mode too, then compares the two graphs op by op:

- identical: one program, nothing mode-dependent;
- the same ops, differing only in a mode argument (dropout's `train` flag, attention's
  `dropout_p` chosen by `self.training`): one program whose argument reads the flag,

      before:  h2 = aten.dropout.default(h, 0.3, True)
      after:   h2 = aten.dropout.default(h, 0.3, self.training)
               a = aten.scaled_dot_product_attention.default(q, k, v, None, (0.1 if self.training else 0.0))

- anything else (BatchNorm's batch vs running statistics, an `if self.training:` branch): a
  second program, `forward_eval_impl`, planned in the same pass run with the training
  program's parameter placements (passes/__init__.py, run_pipeline); the runtime runs it when
  the module is in eval mode.

Random ops in eval mode draw nothing, so random numbers drawn in training stay in step with
one device however often the user evaluates in between.
"""
from __future__ import annotations

import inspect
import math
from typing import Any

import torch
from torch.utils import _pytree as pytree

from .ir import Graph, Symbol, Value, fmt_literal
from .rules import draws_random

# schema argument names that carry the mode (op by op: train flag, dropout probability)
_MODE_ARGS = {"train", "training", "dropout_p"}
_RANDOM_P = "p"             # a dropout's probability, where the op also takes a train flag
# ops whose result depends on the mode whatever their arguments (random ones count where they
# draw: rules.draws_random)
_MODE_OPS = {"feature_dropout", "alpha_dropout", "feature_alpha_dropout", "batch_norm",
             "_native_batch_norm_legit", "_native_batch_norm_legit_functional",
             "native_batch_norm", "instance_norm", "rrelu", "rrelu_with_noise",
             "_batch_norm_impl_index", "_batch_norm_with_update"}


class ModeArg(Symbol):
    """A literal that is `train` in training mode and `eval` in eval mode, printed as
    `self.training` or `(train if self.training else eval)`."""

    train: Any
    eval: Any

    def __new__(cls, train: Any, eval: Any) -> "ModeArg":
        if train is True and eval is False:
            text = "self.training"
        elif train is False and eval is True:
            text = "(not self.training)"
        else:
            text = f"({fmt_literal(train)} if self.training else {fmt_literal(eval)})"
        s = super().__new__(cls, text)
        s.train, s.eval = train, eval
        return s

    def __reduce__(self):
        return (ModeArg, (self.train, self.eval))


def resolve(x: Any, training: bool = True) -> Any:
    """A ModeArg's value in one mode (anything else as it is)."""
    return (x.train if training else x.eval) if isinstance(x, ModeArg) else x


def _code_reads(code: Any, name: str) -> bool:
    """Whether a code object (or one nested in it: a lambda, a comprehension) reads the
    attribute or global `name`."""
    return name in code.co_names or any(
        _code_reads(c, name) for c in code.co_consts if inspect.iscode(c))


def _reads_training(cls: type, seen: dict[type, bool]) -> bool:
    """Whether a module class's own methods (those of its classes that are not torch's) read
    `.training`: its forward, or a method forward calls."""
    hit = seen.get(cls)
    if hit is None:
        hit = False
        for c in cls.__mro__:
            module = getattr(c, "__module__", "") or ""
            if c is object or module == "torch" or module.startswith("torch."):
                continue
            for attr in vars(c).values():
                fns = [attr.fget, attr.fset] if isinstance(attr, property) else \
                    [getattr(attr, "__func__", attr)]
                if any(_code_reads(f.__code__, "training") for f in fns
                       if hasattr(f, "__code__")):
                    hit = True
                    break
            if hit:
                break
        seen[cls] = hit
    return hit


def may_depend_on_mode(module: torch.nn.Module, graph: Graph) -> bool:
    """Cheap check whether an eval-mode trace could differ: the training trace has an op with a
    mode argument (dropout, attention dropout, batch norm, a buffer update), or a module class
    of the model (torch's own aside, whose mode shows as such ops) reads `.training`."""
    if graph.trace_info.buffer_updates:
        return True
    if any(getattr(op.target, "_opname", None) in _MODE_OPS or draws_random(op)
           for op in graph.ops):
        return True
    seen: dict[type, bool] = {}
    return any(_reads_training(type(m), seen) for m in module.modules())


def _named_args(op) -> dict[str, Any] | None:
    """An aten op's arguments by schema name, defaults filled in (None: no schema)."""
    schema = getattr(op.target, "_schema", None)
    if schema is None:
        return None
    out = {}
    for i, a in enumerate(schema.arguments):
        if i < len(op.args):
            out[a.name] = op.args[i]
        elif a.name in op.kwargs:
            out[a.name] = op.kwargs[a.name]
        elif a.has_default_value():
            out[a.name] = a.default_value
        else:
            out[a.name] = None
    return out


def _same_literal(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def _set_arg(op, name: str, value: Any) -> None:
    schema = op.target._schema
    idx = next(i for i, a in enumerate(schema.arguments) if a.name == name)
    if name in op.kwargs:
        op.kwargs = {**op.kwargs, name: value}
        return
    args = list(op.args)
    while len(args) <= idx:          # an argument the training trace left at its default
        a = schema.arguments[len(args)]
        args.append(a.default_value if a.has_default_value() else None)
    args[idx] = value
    op.args = tuple(args)


# ops that return their input's value (layout aside): one trace may have one where the other
# does not (Hugging Face's attention calls .contiguous() in training mode only)
_IDENTITY = {"contiguous", "alias"}


def _without_identities(ops: list) -> tuple[list, dict[int, Value]]:
    """The ops but value-identity ones, and what each of those returned is (its input)."""
    kept, same = [], {}
    for op in ops:
        if getattr(op.target, "_opname", None) in _IDENTITY and len(op.outputs) == 1 \
                and op.args and isinstance(op.args[0], Value):
            same[id(op.outputs[0])] = same.get(id(op.args[0]), op.args[0])
            continue
        kept.append(op)
    return kept, same


def merge(train: Graph, ev: Graph) -> Graph | None:
    """Compare the two traces. The same ops differing only in mode arguments: mark those in
    `train` (ModeArg) and return None; any other difference: return `ev`, the eval program
    (train is left as it is); identical: None."""
    ops_a, same_a = _without_identities(train.const_ops + train.ops)
    ops_b, same_b = _without_identities(ev.const_ops + ev.ops)
    if len(ops_a) != len(ops_b) or len(train.const_ops) != len(ev.const_ops) \
            or len(train.inputs) != len(ev.inputs) or train.out_spec != ev.out_spec \
            or len(train.outputs) != len(ev.outputs) \
            or [v.fqn for v in train.params] != [v.fqn for v in ev.params] \
            or [v.fqn for v in train.buffers] != [v.fqn for v in ev.buffers] \
            or train.trace_info.buffer_updates != ev.trace_info.buffer_updates:
        return ev
    vmap: dict[int, Value] = {}
    for a, b in zip(train.inputs + train.params + train.buffers,
                    ev.inputs + ev.params + ev.buffers):
        vmap[id(b)] = a

    def same_value(u: Any, w: Any) -> bool:
        return isinstance(u, Value) and isinstance(w, Value) and \
            vmap.get(id(same_b.get(id(w), w))) is same_a.get(id(u), u)

    marks: list[tuple[Any, str, Any, Any]] = []
    for a, b in zip(ops_a, ops_b):
        if a.target is not b.target or len(a.outputs) != len(b.outputs) \
                or any(x.meta != y.meta for x, y in zip(a.outputs, b.outputs)):
            return ev
        for x, y in zip(a.outputs, b.outputs):
            vmap[id(y)] = x
        na, nb = _named_args(a), _named_args(b)
        if na is None:
            pairs = [(None, (a.args, a.kwargs), (b.args, b.kwargs))]
        else:
            pairs = [(k, na[k], nb[k]) for k in na]
        for name, x, y in pairs:
            lx, ly = pytree.tree_flatten(x), pytree.tree_flatten(y)
            if lx[1] != ly[1]:
                return ev
            for u, w in zip(lx[0], ly[0]):
                if isinstance(u, Value) or isinstance(w, Value):
                    if not same_value(u, w):
                        return ev
                elif not _same_literal(u, w):
                    mode_arg = name in _MODE_ARGS or (
                        name == _RANDOM_P and na is not None
                        and ({"train", "training"} & set(na)))
                    if not mode_arg or not isinstance(u, (bool, float, int)) \
                            or not isinstance(w, (bool, float, int)):
                        return ev
                    marks.append((a, name, u, w))
    out_a = pytree.tree_leaves(train.outputs)
    out_b = pytree.tree_leaves(ev.outputs)
    if len(out_a) != len(out_b) or any(
            (isinstance(w, Value) and not same_value(u, w))
            or (not isinstance(w, Value) and not _same_literal(u, w))
            for u, w in zip(out_a, out_b)):
        return ev
    for op, name, u, w in marks:
        _set_arg(op, name, ModeArg(u, w))
    return None


def check_eval_plan(train: Graph, ev: Graph) -> None:
    """The eval program reads the training program's parameter and buffer shards, so a plan
    must place each alike (ConfigError naming the first that differs)."""
    from .errors import ConfigError
    have = {v.fqn: (v.name, v.placement) for v in train.params + train.buffers}
    for v in ev.params + ev.buffers:
        name, place = have.get(v.fqn, (None, None))
        if name is None or name != v.name or place != v.placement:
            raise ConfigError(
                f"the eval-mode program (the model's forward in eval mode differs from training "
                f"mode: BatchNorm, or a branch on self.training) places {v.kind} {v.fqn!r} "
                f"as {v.placement!r} where the training program places it as {place!r}; the two "
                f"programs share one set of shards. Use a policy that places it alike in both "
                f"modes (tp, data, dp), or parallelize a separate model.eval() copy for "
                f"evaluation")
    if [(v.name, v.placement) for v in ev.consts] != [(v.name, v.placement)
                                                      for v in train.consts]:
        raise ConfigError("the eval-mode program folds other constants than the training "
                          "program; parallelize with constant_folding=False, or a separate "
                          "model.eval() copy for evaluation")


def trace_modes(module: torch.nn.Module, dummy_args: Any, dynamic_dims: Any = None) -> Graph:
    """Trace `module` in training mode (its submodules as they are when it is in training
    mode, all of them in training mode when it is not) and, where it may depend on its mode,
    in eval mode. The graph returned is the training program; its `eval_program` the
    eval program where that differs beyond mode arguments. The module's modes are restored."""
    from .frontend import _trace     # each mode traced afresh: merge compares the two
    from .errors import NNCompileError
    from .log import log
    from .frontend import layer_replay
    modes = {m: m.training for m in module.modules()}
    try:
        if not module.training:
            module.train()
        try:
            graph = _trace(module, dummy_args, dynamic_dims)
        except NNCompileError as e:
            if modes[module]:               # compiled for training: the refusal stands
                raise
            graph = _eval_only(module, dummy_args, dynamic_dims, e)
            graph.trace_info.training = False
            return graph
        if may_depend_on_mode(module, graph):
            stats = dict(layer_replay.last)
            module.eval()
            try:
                ev = _trace(module, dummy_args, dynamic_dims)
            except NNCompileError as e:     # said when the module runs in eval mode
                graph.trace_info.eval_error = str(e)
                log(f"the forward could not be traced in eval mode; the parallel module "
                    f"refuses to run in eval mode: {str(e).splitlines()[0]}")
                ev = None
            layer_replay.last.clear()
            layer_replay.last.update(stats)
            ev = ev if ev is None else merge(graph, ev)
            if ev is not None:
                graph.eval_program = ev
    finally:
        for m, mode in modes.items():
            m.training = mode
    graph.trace_info.training = modes[module]
    return graph


def _eval_only(module: torch.nn.Module, dummy_args: Any, dynamic_dims: Any,
               train_error: Exception) -> Graph:
    """A module handed over in eval mode whose training-mode forward cannot be traced (a
    Hugging Face layerdrop > 0 skips layers at random in training): its eval program is the
    only one, and the parallel module refuses training mode with `train_error`.

        before: parallelize(bart.eval(), ...)  -> TraceError (layerdrop=0.1 in training)
        after:  the eval program; pm.train(); pm(...)  -> ConfigError naming the fix
    """
    from .frontend import _trace     # each mode traced afresh: merge compares the two
    from .log import log
    module.eval()
    graph = _trace(module, dummy_args, dynamic_dims)
    graph.trace_info.train_error = str(train_error)
    log(f"the forward could not be traced in training mode; the parallel module runs in eval "
        f"mode only: {str(train_error).splitlines()[0]}")
    return graph
