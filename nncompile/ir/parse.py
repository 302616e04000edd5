"""Read printed IR back: `parse_graph(print_graph(g))` is a graph equal to `g`.

    g = parse_graph('''
    # nncompile IR: plan_ngpus=2 stages=planned
    def forward(
        x,  # f32[4, 8] S(1)
        *,
        w,  # param 'w' f32[6, 8] S(1)
    ):
        y = aten.linear.default(x, w)  # f32[4, 6] P  [split k]
        z = aten.relu.default(y)  # f32[4, 6] R  [replicate]  wants (R)
        return (z,)
    ''')

The code is read with `ast` (nothing is evaluated: only literals, names and dotted targets are
accepted) and the comments with `tokenize`: the header gives plan_ngpus, stages and
partial-grad parameters; an argument's comment its kind, FQN, meta and placement (and, for a
part of a fused parameter, `part(source, source shape, view, box, groups)`); an op's
comment its outputs' metas and placements, its strategy note and the input placements the
strategy wants (the inputs' own placements when not printed) and, for a linear run in float8,
`float8=<recipe>`; a comment line above an op its
source line (none for collectives and lowering markers). Not printed, so not read back:
module paths, module stacks, recompute marks,
op.attrs, out_spec, trace_info and graph.meta. `graph_diff` compares two graphs structurally.
"""
from __future__ import annotations

import ast
import difflib
import io
import re
import textwrap
import tokenize
from typing import Any

import torch

from ..errors import NNCompileError
from .graph import (CONST, PARAM, STRUCTURAL, Graph, Op, ParamPart, PlanState, SourceInfo, Stage, Strategy,
                    TensorMeta,
                    Value, target_name)
from .placement import Replicate, parse_placement
from .printer import _DTYPES, DEVICE, PLAN_GROUP, Symbol, default_requires_grad, fmt_literal, print_graph


class IRParseError(NNCompileError, ValueError):
    """Text that is not IR as print_graph writes it; the message names the line."""


_DTYPE_OF = {v: k for k, v in _DTYPES.items()}
_STR = r"'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\""
_INPUT = re.compile(rf"^(?:(?P<frozen>frozen )?(?P<kind>input|param|buffer|const|op)"
                    rf"(?: (?P<fqn>{_STR}))? )?(?P<meta>.*)$")
_META = re.compile(r"^(?P<dt>\w+)\[(?P<shape>[-\d, ]*)\](?: of \[(?P<full>[-\d, ]*)\])? "
                   r"(?P<pl>R|P|S\(-?\d+(?:\|\d+)?\))"
                   r"(?P<axes>(?: @\w+=(?:R|P|S\(-?\d+(?:\|\d+)?\)))*)"
                   r"(?: (?P<mark>requires_grad|no_grad))?$")
_SOURCE = re.compile(r"^(?P<file>.+?):(?P<line>\d+)(?:  (?P<code>.*))?$")
_HEADER = re.compile(r"^nncompile IR: plan_ngpus=(?P<n>\d+)(?: axes=(?P<axes>[\w:,]+))?"
                     r"(?: stages=(?P<stages>[\w,]+))?$")
_PARTIAL = "partial_grad_params: "
_CONSTANTS, _FORWARD = "---- constants: evaluated once at load time ----", "---- forward ----"
_STRING_TARGETS = ("comm", "rng") + STRUCTURAL   # runtime functions and lowering markers
_SYMBOLS = {"DEVICE": DEVICE, "PLAN_GROUP": PLAN_GROUP}


def parse_graph(text: str) -> Graph:
    """The Graph that `text` (print_graph's output, with or without local shapes) prints."""
    return _Parser(text).graph()


class _Parser:
    def __init__(self, text: str):
        self.text = text = textwrap.dedent(text)
        self.env: dict[str, Value] = {}
        self.comments: dict[int, tuple[str, bool]] = {}   # line -> (text, whole line)
        lines = text.splitlines()
        try:
            for tok in tokenize.generate_tokens(io.StringIO(text).readline):
                if tok.type == tokenize.COMMENT:
                    row, col = tok.start
                    whole = not lines[row - 1][:col].strip()
                    self.comments[row] = (tok.string[1:].strip(), whole)
            self.tree = ast.parse(text)
        except (SyntaxError, tokenize.TokenError) as e:
            raise IRParseError(f"printed IR is not valid Python: {e}") from e

    def fail(self, line: int, msg: str):
        src = self.text.splitlines()[line - 1].strip() if line else ""
        raise IRParseError(f"line {line}: {msg}\n    {src}")

    def graph(self) -> Graph:
        fns = [s for s in self.tree.body if isinstance(s, ast.FunctionDef)]
        if len(fns) != 1 or fns[0].name != "forward":
            raise IRParseError("printed IR defines exactly one function, `forward`")
        fn = fns[0]
        n, stages, partial = self.header(fn.lineno)
        inputs = [self.input(a) for a in fn.args.args]
        kw = [self.input(a) for a in fn.args.kwonlyargs]
        params = [v for v in kw if v.kind == PARAM]
        buffers = [v for v in kw if v.kind != PARAM]
        sections: dict[str, list[Op]] = {"const": [], "forward": []}
        section, prev, outputs, source = "forward", fn.lineno + 1, None, None
        for stmt in fn.body:
            for row in range(prev, stmt.lineno):        # comment lines above this statement
                text, whole = self.comments.get(row, ("", False))
                if not whole:
                    continue
                if text in (_CONSTANTS, _FORWARD):
                    section, source = ("const" if text == _CONSTANTS else "forward"), None
                elif (m := _SOURCE.match(text)) is not None:
                    source = SourceInfo(m["file"], int(m["line"]), m["code"] or "")
            prev = stmt.end_lineno + 1
            if isinstance(stmt, ast.Return):
                if not isinstance(stmt.value, ast.Tuple):
                    self.fail(stmt.lineno, "forward returns a tuple")
                outputs = list(self.literal(stmt.value, stmt.lineno))
            else:
                sections[section].append(self.op(stmt, source, n, stages))
        if outputs is None:
            self.fail(fn.end_lineno, "forward has no return")
        g = Graph(inputs, params, buffers, sections["forward"], outputs, sections["const"],
                  plan_ngpus=n, stages=stages, axes=self.axes)
        g.plan_state = PlanState(partial_grad_params=partial)
        used = {id(v) for op in g.ops for v in op.inputs()} | {id(v) for v in outputs}
        for op in g.const_ops:                  # as constant_fold and dce mark them
            for v in op.outputs:
                v.kind = CONST if id(v) in used else v.kind
        return g

    def header(self, def_line: int) -> tuple[int, frozenset, list[str]]:
        n, stages, partial = 1, frozenset(), []
        self.axes: dict[str, int] = {}
        for row in range(1, def_line):
            text = self.comments.get(row, ("", False))[0]
            if text.startswith(_PARTIAL):
                partial = [p.strip() for p in text[len(_PARTIAL):].split(",") if p.strip()]
            elif (m := _HEADER.match(text)) is not None:
                n = int(m["n"])
                for item in (m["axes"] or "").split(","):
                    if item:
                        axis, _, size = item.partition(":")
                        self.axes[axis] = int(size)
                try:
                    stages = frozenset(Stage[s.upper()] for s in (m["stages"] or "").split(",")
                                       if s)
                except KeyError as e:
                    self.fail(row, f"unknown stage {e.args[0].lower()!r}")
        return n, stages, partial

    # ---- values ----
    def meta(self, text: str, line: int) -> tuple[TensorMeta | None, Any, str | None, dict]:
        """(meta, plan placement, requires_grad mark, placements on other axes)."""
        if not text:
            return None, Replicate(), None, {}
        m = _META.match(text)
        if m is None:
            self.fail(line, f"cannot read tensor meta {text!r} (e.g. 'f32[4, 8] S(1)')")
        dtype = _DTYPE_OF.get(m["dt"]) or getattr(torch, m["dt"], None)
        if not isinstance(dtype, torch.dtype):
            self.fail(line, f"unknown dtype {m['dt']!r}")
        shape = m["full"] if m["full"] is not None else m["shape"]
        dims = tuple(int(s) for s in shape.split(",") if s.strip())
        axes = dict(a.split("=", 1) for a in m["axes"].split(" @")[1:])
        return TensorMeta(dims, dtype), parse_placement(m["pl"]), m["mark"], \
            {a: parse_placement(p) for a, p in axes.items()}

    def part(self, text: str, line: int) -> tuple[ParamPart | None, str]:
        """`part(source, source_shape, view, box, groups) <meta>` -> (ParamPart, meta text)."""
        if not text.startswith("part("):
            return None, text
        depth, quote = 0, None
        for i, c in enumerate(text):
            if quote:
                quote = None if c == quote and text[i - 1] != "\\" else quote
            elif c in "'\"":
                quote = c
            elif c == "(":
                depth += 1
            elif c == ")":
                depth -= 1
                if depth == 0:
                    break
        try:
            fields = ast.literal_eval(text[4:i + 1])
            return ParamPart(*fields), text[i + 1:].strip()
        except (ValueError, SyntaxError, TypeError):
            self.fail(line, f"cannot read parameter part {text[:i + 1]!r} (e.g. \"part('w', "
                            "(6, 4), (3, 2, 4), ((0, 1), (0, 2), (0, 4)), ((0, 1), (2,)))\")")

    def define(self, v: Value, line: int) -> Value:
        if v.name in self.env or v.name in _SYMBOLS:
            self.fail(line, f"name {v.name!r} defined twice")
        self.env[v.name] = v
        return v

    def input(self, arg: ast.arg) -> Value:
        text = self.comments.get(arg.lineno, ("", False))[0]
        m = _INPUT.match(text)
        kind = m["kind"] or "input"
        fqn = ast.literal_eval(m["fqn"]) if m["fqn"] else None
        part, rest = self.part(m["meta"], arg.lineno)
        meta, placement, mark, axes = self.meta(rest, arg.lineno)
        rg = not m["frozen"] if kind == PARAM else mark == "requires_grad"
        v = Value(arg.arg, meta, kind, fqn, requires_grad=rg)
        v.placement, v.part, v.axes = placement, part, axes
        return self.define(v, arg.lineno)

    # ---- ops ----
    def op(self, stmt: ast.stmt, source: SourceInfo | None, n: int, stages) -> Op:
        line = stmt.lineno
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
            lhs, call = stmt.targets[0], stmt.value
        elif isinstance(stmt, ast.Expr):
            lhs, call = None, stmt.value
        else:
            self.fail(line, "expected `outputs = target(args)`")
        if not isinstance(call, ast.Call) or any(k.arg is None for k in call.keywords):
            self.fail(line, "expected a call with plain arguments")
        target = self.target(call.func, line)
        args = tuple(self.literal(a, line) for a in call.args)
        kwargs = {k.arg: self.literal(k.value, line) for k in call.keywords}
        multi = isinstance(lhs, ast.Tuple)
        names = [e for e in lhs.elts] if multi else [lhs] if lhs is not None else []
        if not all(isinstance(e, ast.Name) for e in names):
            self.fail(line, "outputs must be plain names")
        comment = self.comments.get(stmt.end_lineno, ("", True))
        text = "" if comment[1] else comment[0]
        text, _, float8 = text.partition("  float8=")
        metas, note, wants = self.op_comment(text, line)
        if metas and len(metas) != len(names):
            self.fail(line, f"{len(names)} outputs but {len(metas)} metas")
        outs = [Value(e.id, None) for e in names]
        op = Op(target, args, kwargs, outs, source, multi_output=multi)
        op.float8 = float8 or None
        for v, text in zip(outs, metas or [""] * len(outs)):
            v.meta, v.placement, mark, v.axes = self.meta(text, line)
            v.requires_grad = default_requires_grad(v) if mark is None \
                else mark == "requires_grad"
        if note is not None:
            tensors = op.tensor_inputs()
            ins = tuple(v.placement for v in tensors) if wants is None else wants
            if len(ins) != len(tensors):
                self.fail(line, f"wants {len(ins)} placements for {len(tensors)} inputs")
            op.strategy = Strategy(ins, tuple(v.placement for v in outs), note)
            op.strategy.local_target = self.local_target(op, n, stages)
        if isinstance(target, str) and op.strategy is not None \
                and target == f"comm.{op.strategy.note}":
            op.source = None                 # inserted collectives have no user line
        if op.is_structural:
            op.source = None                 # nor do lowering markers
        for v in outs:
            self.define(v, line)
        return op

    def op_comment(self, text: str, line: int):
        """'f32[4] S(0); i64[4] R  [note]  wants (R, S(0))' -> (metas, note, wants)."""
        wants = note = None
        if "  wants (" in text and text.endswith(")"):
            text, w = text.rsplit("  wants (", 1)
            try:
                wants = tuple(None if p.strip() == "*" else parse_placement(p)
                              for p in w[:-1].split(", ") if p.strip())
            except ValueError as e:
                self.fail(line, str(e))
        if text.endswith("]"):
            at = text.find("  [")                  # metas hold no double space
            if at >= 0:
                text, note = text[:at], text[at + 3:-1]
            elif text.startswith("["):             # an op without tensor outputs
                text, note = "", text[1:-1]
        metas = [m.strip() for m in text.split("; ")] if text.strip() else []
        return metas, note, wants

    def local_target(self, op: Op, n: int, stages) -> Any:
        """A strategy's local implementation, from the rule table (not printed): a localized
        op already calls it; otherwise the rule that offers this strategy names it."""
        if Stage.LOCALIZED in stages:
            s, t = op.strategy, op.target
            return t if isinstance(t, str) and t.startswith("comm.") and t != f"comm.{s.note}" \
                else None
        if n < 2 or isinstance(op.target, str):
            return None
        from ..rules import strategies          # the rules import the IR package
        key = (op.strategy.inputs, op.strategy.outputs)
        try:
            offered = strategies(op, n)
        except Exception:                       # a hand-written op no rule can read
            return None
        return next((s.local_target for s in offered if (s.inputs, s.outputs) == key), None)

    def target(self, node: ast.expr, line: int) -> Any:
        parts = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if not isinstance(node, ast.Name):
            self.fail(line, "an op's target is a dotted name")
        parts = [node.id] + parts[::-1]
        name = ".".join(parts)
        try:
            if parts[0] in _STRING_TARGETS:
                return name
            if parts[0] == "aten" and len(parts) == 3:
                return getattr(getattr(torch.ops.aten, parts[1]), parts[2])
            if parts[:2] == ["torch", "ops"] and len(parts) == 5:
                return getattr(getattr(getattr(torch.ops, parts[2]), parts[3]), parts[4])
            if parts[0] == "custom" and len(parts) == 2:
                from ..custom_ops import NAMESPACE
                return getattr(getattr(torch.ops, NAMESPACE), parts[1]).default
            if parts[0] == "torch" and len(parts) == 2 and callable(getattr(torch, parts[1])):
                return getattr(torch, parts[1])
        except (AttributeError, RuntimeError):
            pass
        self.fail(line, f"unknown op target {name!r}")

    def literal(self, node: ast.expr, line: int) -> Any:
        if isinstance(node, ast.Constant) and not isinstance(node.value, (bytes, complex)):
            return node.value
        if isinstance(node, ast.Name):
            if node.id in self.env:
                return self.env[node.id]
            if node.id in _SYMBOLS:
                return _SYMBOLS[node.id]
            if re.fullmatch(r"[A-Z][A-Z0-9]*_GROUP", node.id):    # a mesh axis's group
                return Symbol(node.id)
            self.fail(line, f"{node.id!r} is used before it is defined")
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) \
                and isinstance(node.operand, ast.Constant) \
                and type(node.operand.value) in (int, float):
            return -node.operand.value
        if isinstance(node, ast.List):
            return [self.literal(e, line) for e in node.elts]
        if isinstance(node, ast.Tuple):
            return tuple(self.literal(e, line) for e in node.elts)
        if isinstance(node, ast.Dict) and all(isinstance(k, ast.Constant) for k in node.keys):
            return {k.value: self.literal(v, line) for k, v in zip(node.keys, node.values)}
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id == "float" and len(node.args) == 1 and not node.keywords \
                and isinstance(node.args[0], ast.Constant) \
                and node.args[0].value in ("inf", "-inf", "nan"):
            return float(node.args[0].value)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id == "complex" and len(node.args) == 2 and not node.keywords:
            parts = [self.literal(a, line) for a in node.args]
            if all(type(p) in (int, float) for p in parts):
                return complex(*parts)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and node.value.id == "torch":
            x = getattr(torch, node.attr, None)
            if isinstance(x, (torch.dtype, torch.layout, torch.memory_format)):
                return x
        self.fail(line, f"not an IR literal: {ast.unparse(node)}")


# ---- structural equality ----
def _value_row(v: Value) -> tuple:
    meta = None if v.meta is None else (tuple(v.meta.shape), v.meta.dtype)
    return (v.name, v.kind, v.fqn, meta, v.placement, v.requires_grad, v.part,
            tuple(sorted(v.axes.items())))


def _strategy_row(s: Strategy | None) -> Any:
    if s is None:
        return None
    local = s.local_target if isinstance(s.local_target, (str, type(None))) \
        else fmt_target(s.local_target)
    return (s.inputs, s.outputs, s.note, local)


def fmt_target(t: Any) -> str:
    return ("str:" if isinstance(t, str) else "") + target_name(t)


def _op_rows(op: Op) -> dict[str, Any]:
    return {"target": fmt_target(op.target), "args": fmt_literal(op.args),
            "kwargs": fmt_literal(op.kwargs), "outputs": [_value_row(v) for v in op.outputs],
            "multi_output": op.multi_output, "strategy": _strategy_row(op.strategy),
            "source": op.source}


def graph_diff(a: Graph, b: Graph) -> list[str]:
    """Differences between two graphs in what printed IR carries (names, kinds, FQNs, metas,
    placements, gradients, targets, arguments, strategies, sources, outputs, stages)."""
    out = []

    def cmp(where: str, x: Any, y: Any) -> None:
        if x != y:
            out.append(f"{where}:\n    a: {x!r}\n    b: {y!r}")

    cmp("plan_ngpus", a.plan_ngpus, b.plan_ngpus)
    cmp("stages", sorted(s.name for s in a.stages), sorted(s.name for s in b.stages))
    cmp("axes", a.axes, b.axes)
    cmp("partial_grad_params", list(a.plan_state.partial_grad_params),
        list(b.plan_state.partial_grad_params))
    for part in ("inputs", "params", "buffers"):
        cmp(part, [_value_row(v) for v in getattr(a, part)],
            [_value_row(v) for v in getattr(b, part)])
    for part in ("const_ops", "ops"):
        xs, ys = getattr(a, part), getattr(b, part)
        if len(xs) != len(ys):                  # the printed diff shows where
            out.append(f"{part}: {len(xs)} ops in a, {len(ys)} in b")
            continue
        for i, (x, y) in enumerate(zip(xs, ys)):
            rx, ry = _op_rows(x), _op_rows(y)
            for k in rx:
                cmp(f"{part}[{i}] ({x.name}) {k}", rx[k], ry[k])
    cmp("outputs", fmt_literal(tuple(a.outputs)), fmt_literal(tuple(b.outputs)))
    return out


def graphs_equal(a: Graph, b: Graph) -> bool:
    return not graph_diff(a, b)


def assert_graph_equal(a: Graph, b: Graph) -> None:
    """Raise AssertionError listing the differences and a diff of the printed graphs."""
    diffs = graph_diff(a, b)
    if not diffs:
        return

    def show(g: Graph) -> list[str]:
        return print_graph(g, g.plan_ngpus if Stage.LOCALIZED in g.stages else None).splitlines()
    text = "\n".join(difflib.unified_diff(show(a), show(b), "a", "b", lineterm=""))
    raise AssertionError(f"graphs differ in {len(diffs)} place(s):\n" + "\n".join(diffs[:20])
                         + "\nprinted:\n" + (text or "(the printed forms are the same)"))
