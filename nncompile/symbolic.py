"""Dynamic dims: input sizes that vary between calls, carried through the IR as sympy sizes.

    parallelize(model, {"idx": ids, "targets": tgt}, config,
                dynamic_dims={"idx": {0: "batch", 1: "seq"}, "targets": {0: "batch", 1: "seq"}})

traces with torch.export's symbolic sizes (one `torch.export.Dim` per name; the same name on
two inputs is one size). Each size in the IR is a `Sym`: an int, its value at the dummy args
(what planning and the cost model use: autodist plans for that representative size), with a
sympy expression over the named sizes (what divisibility checks and generated code use).

    before (static):   v = aten.view.default(x, [4, 16, 4, 8])
    after (dynamic):   v = aten.reshape.default(x, [s_batch, s_seq, 2, 8])   (heads split)
                       v = aten.reshape.default(x, [s_batch // 2, s_seq, 4, 8])  (batch split)

A split needs its dim divisible by the plan size for every allowed value: `Sym % n` is 0 only
when it provably is (`{"name": "batch", "multiple_of": 2}` makes batch a multiple of 2). The
allowed ranges come from the user (`min`, `max`, `multiple_of`) narrowed by what torch.export
proved (sizes 0 and 1 are specialized, so ranges start at 2); generated code checks every call
against them (SIZES in gencode{rank}.py)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import sympy
import torch
from sympy.printing.str import StrPrinter

from .errors import ConfigError, InputMismatchError

INT_MAX = 2 ** 31 - 1


@dataclass(frozen=True)
class SizeSpec:
    """One named dynamic size: its range and the multiple it must be."""
    name: str
    min: int = 2
    max: int = INT_MAX
    multiple_of: int = 1

    @property
    def var(self) -> str:
        """Its name in generated code."""
        return f"s_{self.name}"

    @property
    def symbol(self) -> sympy.Symbol:
        """The integer symbol sizes are expressions of: the size itself, or size / multiple."""
        name = self.var if self.multiple_of == 1 else f"k_{self.name}_{self.multiple_of}"
        _SPECS.setdefault(name, self)
        return sympy.Symbol(name, integer=True, positive=True)

    def allows(self, size: int) -> bool:
        return self.min <= size <= self.max and size % self.multiple_of == 0

    def describe(self) -> str:
        hi = "any" if self.max >= INT_MAX else str(self.max)
        mult = f", a multiple of {self.multiple_of}" if self.multiple_of > 1 else ""
        return f"{self.var} in [{self.min}, {hi}]{mult}"


# by symbol name, the size each integer symbol stands for: k_batch_2 is s_batch / 2
_SPECS: dict[str, SizeSpec] = {}


class Sym(int):
    """A size that depends on dynamic dims: an int (its value at the dummy args) with a sympy
    expression. Arithmetic gives plain ints except `//` (a local shard's size stays symbolic)
    and `%`, which is 0 only if the expression is divisible for every allowed value."""

    def __new__(cls, hint: int, expr: sympy.Expr):
        self = super().__new__(cls, int(hint))
        self.expr = sympy.sympify(expr)
        return self

    def __getnewargs__(self):
        return int(self), self.expr

    def __floordiv__(self, n: Any):
        if type(n) is int and n > 0:
            return Sym(int(self) // n, sympy.floor(self.expr / n))
        return int(self) // n

    def __mod__(self, n: Any):
        if type(n) is int and n > 0:
            return 0 if divides(self.expr, n) else (int(self) % n or n)
        return int(self) % n

    def code(self) -> str:
        """The expression in generated code, over the s_<name> variables."""
        return to_code(self.expr)

    def __str__(self) -> str:
        return self.code()


def divides(expr: sympy.Expr, n: int) -> bool:
    """n divides expr for every integer value of its symbols (sufficient test: every
    coefficient of the polynomial divisible)."""
    expr = sympy.expand(expr)
    if expr.is_Integer:
        return int(expr) % n == 0
    try:
        poly = sympy.Poly(expr, *sorted(expr.free_symbols, key=str))
    except sympy.PolynomialError:
        return False
    return all(c.is_Integer and int(c) % n == 0 for c in poly.coeffs())


class _CodePrinter(StrPrinter):
    """Python for size expressions: floor(a/b) as a // b, no rationals."""

    def _print_floor(self, e):
        num, den = sympy.fraction(sympy.together(e.args[0]))
        return f"{self._wrap(num)} // {self._wrap(den)}"

    def _print_Rational(self, e):
        return f"{e.p} // {e.q}"

    def _wrap(self, e) -> str:
        text = self._print(e)
        return text if e.is_Atom or e.is_Function else f"({text})"


def to_code(expr: sympy.Expr) -> str:
    """Python source for `expr`, in terms of the s_<name> sizes of the inputs."""
    subs = {sympy.Symbol(k, integer=True, positive=True):
            sympy.Symbol(s.var, integer=True, positive=True) / s.multiple_of
            for k, s in _SPECS.items() if s.multiple_of > 1}
    e = sympy.sympify(expr).xreplace(subs) if subs else sympy.sympify(expr)
    num, den = sympy.fraction(sympy.together(e))
    printer = _CodePrinter()
    if den == 1:
        return printer.doprint(num)
    return f"{printer._wrap(num)} // {printer._wrap(den)}"


def keep_symbols(shape: tuple, like: tuple) -> tuple:
    """`shape` (ints, say from a run on the meta device) with each dim that equals `like`'s
    at the same position taken from `like`: a pass that builds a new op from an old one
    keeps the old one's dynamic sizes (Syms) instead of their traced values.

        keep_symbols((2, 16, 32), (Sym(2, s_batch), Sym(16, s_seq), 48))
            -> (s_batch, s_seq, 32)
    """
    if len(shape) != len(like):
        return tuple(shape)
    return tuple(b if isinstance(b, Sym) and int(b) == a else a for a, b in zip(shape, like))


def literal_code(x: Any) -> str | None:
    return x.code() if isinstance(x, Sym) else None


# ---- user specs -> torch.export ------------------------------------------------------------
def parse_dynamic_dims(dynamic_dims: Any, names: list[str]) -> dict[str, dict[int, SizeSpec]]:
    """{input: {dim: SizeSpec}} from the user's dynamic_dims: a name ("batch"), a dict with
    name/min/max/multiple_of, or a torch.export.Dim."""
    if dynamic_dims is None:
        return {}
    if not isinstance(dynamic_dims, dict):
        raise ConfigError(f"dynamic_dims must be a dict {{input name: {{dim: size name}}}}, "
                          f"e.g. {{'idx': {{0: 'batch', 1: 'seq'}}}}; got {dynamic_dims!r}")
    out: dict[str, dict[int, SizeSpec]] = {}
    seen: dict[str, SizeSpec] = {}
    for arg, dims in dynamic_dims.items():
        if arg not in names:
            raise ConfigError(f"dynamic_dims names input {arg!r}, which forward does not take "
                              f"as a tensor argument; its tensor arguments are {names}")
        if not isinstance(dims, dict):
            raise ConfigError(f"dynamic_dims[{arg!r}] must map dims to size names, e.g. "
                              f"{{0: 'batch'}}; got {dims!r}")
        out[arg] = {}
        for dim, spec in dims.items():
            spec = _spec(arg, dim, spec)
            if spec.name in seen and seen[spec.name] != spec:
                raise ConfigError(f"size {spec.name!r} is given two ranges: "
                                  f"{seen[spec.name].describe()} and {spec.describe()}")
            seen[spec.name] = spec
            out[arg][int(dim)] = spec
    return out


def _spec(arg: str, dim: Any, spec: Any) -> SizeSpec:
    if not isinstance(dim, int) or isinstance(dim, bool) or dim < 0:
        raise ConfigError(f"dynamic_dims[{arg!r}] keys are dims (ints >= 0); got {dim!r}")
    if isinstance(spec, str):
        spec = {"name": spec}
    elif isinstance(spec, torch.export.Dim) or type(spec).__name__ in ("Dim", "_Dim"):
        spec = {"name": spec.__name__, "min": getattr(spec, "min", 2),
                "max": getattr(spec, "max", INT_MAX)}
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) \
            or not spec["name"].isidentifier():
        raise ConfigError(f"dynamic_dims[{arg!r}][{dim}] must be a size name (an identifier) "
                          f"or {{'name': ..., 'min': ..., 'max': ..., 'multiple_of': ...}}; "
                          f"got {spec!r}")
    unknown = set(spec) - {"name", "min", "max", "multiple_of"}
    if unknown:
        raise ConfigError(f"dynamic_dims[{arg!r}][{dim}]: unknown keys {sorted(unknown)}; "
                          "use name, min, max, multiple_of")
    m = int(spec.get("multiple_of", 1))
    lo = max(int(spec.get("min", 2)), 2)
    hi = min(int(spec.get("max", INT_MAX)), INT_MAX)
    if m < 1 or lo > hi:
        raise ConfigError(f"dynamic_dims[{arg!r}][{dim}]: empty range {spec!r}")
    lo = -(-lo // m) * m
    return SizeSpec(spec["name"], lo, hi - hi % m, m)


def export_dims(specs: dict[str, dict[int, SizeSpec]], args: list[tuple[str, Any]]):
    """torch.export's dynamic_shapes for the bound arguments, by name (those forward takes
    through `**kwargs` too: frontend/exporting.py names them in forward's signature): one Dim
    per size name (a derived m * Dim for multiples)."""
    dims: dict[str, Any] = {}
    for spec in {s.name: s for d in specs.values() for s in d.values()}.values():
        m = spec.multiple_of
        if m == 1:
            dims[spec.name] = torch.export.Dim(spec.name, min=spec.min, max=spec.max)
        else:
            base = torch.export.Dim(f"{spec.name}_over_{m}", min=max(spec.min // m, 1),
                                    max=spec.max // m)
            dims[spec.name] = m * base
    out = {}
    for name, value in args:
        if name in specs:
            shape = getattr(value, "shape", None)
            if shape is None:
                raise ConfigError(f"dynamic_dims names {name!r}, which is not a tensor")
            for dim, spec in specs[name].items():
                if dim >= len(shape):
                    raise ConfigError(f"dynamic_dims[{name!r}] names dim {dim}, but {name} "
                                      f"has {len(shape)} dims")
                if not spec.allows(int(shape[dim])):
                    raise ConfigError(f"the dummy {name}'s dim {dim} is {shape[dim]}, outside "
                                      f"its own range {spec.describe()}")
            out[name] = {dim: dims[spec.name] for dim, spec in specs[name].items()}
        else:
            out[name] = None
    return out


class SymbolMap:
    """torch.export's size symbols (s13, 2*s62) -> expressions over the named sizes."""

    def __init__(self):
        self.subs: dict[sympy.Symbol, sympy.Expr] = {}
        self.specs: dict[str, SizeSpec] = {}

    def bind(self, spec: SizeSpec, size: Any, lo: int, hi: int) -> SizeSpec:
        """The input dim of size `size` (a SymInt) is `spec`; narrow its range to [lo, hi]."""
        expr = size.node.expr if isinstance(size, torch.SymInt) else None
        if expr is None:
            raise ConfigError(f"torch.export made size {spec.name!r} static ({int(size)}): the "
                              "forward only works at that size (it may compare it with a "
                              "constant); drop it from dynamic_dims")
        m = spec.multiple_of
        sym = expr if m == 1 else expr / m
        if not isinstance(sym, sympy.Symbol):
            raise ConfigError(f"torch.export traced size {spec.name!r} as {expr}; name it "
                              "consistently in dynamic_dims")
        self.subs[sym] = spec.symbol
        spec = SizeSpec(spec.name, max(spec.min, lo), min(spec.max, hi), m)
        self.specs[spec.name] = spec
        return spec

    def sym(self, size: Any) -> int:
        """An int for a static size, a Sym for a symbolic one."""
        if not isinstance(size, torch.SymInt):
            return int(size)
        expr = size.node.expr
        if expr.is_Integer:
            return int(expr)
        hint = size.node.hint
        return Sym(hint, _plain(expr).xreplace(self.subs))


def _plain(expr: sympy.Expr) -> sympy.Expr:
    """torch's sympy functions (FloorDiv, CeilDiv, ...) as plain sympy."""
    def conv(e):
        name = type(e).__name__
        if name == "FloorDiv":
            return sympy.floor(conv(e.args[0]) / conv(e.args[1]))
        if name in ("CeilDiv", "CleanDiv"):
            return sympy.ceiling(conv(e.args[0]) / conv(e.args[1]))
        if e.args:
            return e.func(*[conv(a) for a in e.args])
        return e
    return conv(expr)


def warn_if_unsplit(graph) -> None:
    """A plan of several ranks that splits no tensor, where dynamic sizes are not declared
    multiples of the plan size: say so (a split needs every allowed size divisible)."""
    from .ir import Shard
    n = graph.plan_ngpus
    odd = [f"{var} ({'a multiple of ' + str(m) if m > 1 else 'any value'} in [{lo}, "
           f"{'any' if hi >= INT_MAX else hi}])"
           for var, (lo, hi, m) in graph.trace_info.sizes.items() if m % n]
    if n < 2 or not odd or any(isinstance(v.placement, Shard) for v in graph.values()):
        return
    import warnings
    var = next(v for v, (_, _, m) in graph.trace_info.sizes.items() if m % n)
    where = next(((v.name, d) for v in graph.inputs for d, size in enumerate(v.meta.shape)
                  if isinstance(size, Sym) and size.code() == var), ("idx", 0))
    warnings.warn(
        f"the plan splits nothing across its {n} ranks: a dim can only be split if it is "
        f"divisible by {n} for every size dynamic_dims allows, and {', '.join(odd)} "
        f"{'is' if len(odd) == 1 else 'are'} not. Declare the sizes you want split as "
        f"multiples, e.g. dynamic_dims={{{where[0]!r}: {{{where[1]}: {{'name': "
        f"{var[2:]!r}, 'multiple_of': {n}}}}}}}",
        stacklevel=3)


def warn_unsplit_sequence(graph, n: int, sizes: list) -> None:
    """tp_sp found no op to split on the sequence dim, and that dim is a dynamic size that is
    not a declared multiple of the plan size `n` (`sizes`: the layer blocks' sequence sizes):
    say that sequence parallelism is off and which multiple_of to declare."""
    odd = [s for s in sizes if isinstance(s, Sym) and not divides(s.expr, n)]
    if not odd:
        return
    import warnings
    size = odd[0]
    names = sorted(str(v) for v in size.expr.free_symbols)
    var = next((v for v in names if v in graph.trace_info.sizes and
                graph.trace_info.sizes[v][2] % n), names[0] if names else size.code())
    lo, hi, m = graph.trace_info.sizes.get(var, (2, INT_MAX, 1))
    where = next(((v.name, d) for v in graph.inputs for d, dim in enumerate(v.meta.shape)
                  if isinstance(dim, Sym) and dim.code() == var), None)
    example = (f"dynamic_dims={{{where[0]!r}: {{{where[1]}: {{'name': {var[2:]!r}, "
               f"'multiple_of': {n}}}}}}}" if where else
               f"'multiple_of': {n} for the size {var[2:]!r} in dynamic_dims")
    warnings.warn(
        f"tp_sp at plan {n} runs without sequence parallelism (as tp): the layer blocks' "
        f"sequence dim is the dynamic size {var[2:]!r}"
        f"{f' (dim {where[1]} of input {where[0]!r})' if where else ''}, "
        f"{'a multiple of ' + str(m) if m > 1 else 'any value'} in [{lo}, "
        f"{'any' if hi >= INT_MAX else hi}], and a dim can only be split if it is divisible by "
        f"{n} for every size dynamic_dims allows. Declare it a multiple of the plan size, e.g. "
        f"{example}, and pad batches to it", stacklevel=4)


# ---- runtime guards --------------------------------------------------------------------------
def check_sizes(inputs: list[tuple[str, Any, tuple]], sizes: dict[str, tuple]) -> None:
    """Each input's dims match its traced shape: a static int, or a named size within its
    range (SIZES: name -> (min, max, multiple)), the same value wherever the name appears."""
    bound: dict[str, tuple[int, str]] = {}
    for name, x, shape in inputs:
        if len(x.shape) != len(shape):
            raise InputMismatchError(f"input {name!r} has {len(x.shape)} dims, traced with "
                                     f"{len(shape)} ({_show(shape)})")
        for d, (got, want) in enumerate(zip(x.shape, shape)):
            if isinstance(want, int):
                if got != want:
                    raise InputMismatchError(
                        f"input {name!r} dim {d} is {got}, but the module was traced with "
                        f"{want} there ({_show(shape)}); only dims named in dynamic_dims may "
                        "vary: add it to dynamic_dims, or pass this size to parallelize's "
                        "dummy_args (another instance_name)")
                continue
            lo, hi, m = sizes[want]
            if not (lo <= got <= hi and got % m == 0):
                hi_text = "any" if hi >= INT_MAX else hi
                mult = f", a multiple of {m}" if m > 1 else ""
                raise InputMismatchError(
                    f"input {name!r} dim {d} ({want}) is {got}, outside the allowed range "
                    f"[{lo}, {hi_text}]{mult} this module was compiled for; compile again "
                    "with a dynamic_dims range that includes it, or pad the batch")
            if want in bound and bound[want][0] != got:
                raise InputMismatchError(
                    f"input {name!r} dim {d} ({want}) is {got}, but {bound[want][1]} gave "
                    f"{want} = {bound[want][0]}: inputs sharing a size name must agree")
            bound.setdefault(want, (got, f"input {name!r} dim {d}"))


def _show(shape: tuple) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


def all_sizes(shape: tuple) -> bool:
    return all(not isinstance(s, Sym) for s in shape)


def at_sizes(x: Any, values: dict[str, int]) -> Any:
    """A Sym evaluated at other values of the named sizes (plan_report's range ends)."""
    if not isinstance(x, Sym):
        return x
    subs = {}
    for key, spec in _SPECS.items():
        if spec.name in values:
            subs[sympy.Symbol(key, integer=True, positive=True)] = \
                sympy.Integer(values[spec.name] // spec.multiple_of)
    v = x.expr.xreplace(subs)
    if v.free_symbols:                  # a size not given: its value at the dummy args
        return int(x)
    return int(v) if v.is_Integer else int(math.floor(float(v)))


def graph_at(graph, values: dict[str, int]):
    """A copy of a planned graph with every dynamic size evaluated at `values` (name -> size;
    the rest at the dummy args): what the cost model prices at a range's end."""
    from .ir import TensorMeta
    g = graph.clone()
    for v in g.values():
        if v.meta is not None and any(isinstance(s, Sym) for s in v.meta.shape):
            v.meta = TensorMeta(tuple(at_sizes(s, values) for s in v.meta.shape), v.meta.dtype)
    return g


def range_ends(sizes: dict[str, tuple]) -> list[tuple[str, dict[str, int]]]:
    """('smallest', {name: min}) and ('largest', {name: max}) over the bounded sizes."""
    lo = {var[2:]: r[0] for var, r in sizes.items()}
    hi = {var[2:]: r[1] for var, r in sizes.items() if r[1] < INT_MAX - 1}
    return [("smallest", lo)] + ([("largest", hi)] if hi else [])
