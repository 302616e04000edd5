"""A program's body as code: the lowered IR printed statement by statement, no transforms.

The passes decided everything: which ops run (and where a stage begins and ends,
passes/split_stages.py), where ZeRO-3 gathers, prefetches and frees parameters
(passes/lower_zero3.py) and which runs are checkpoint regions (passes/lower_recompute.py).
This module only prints them:

    checkpoint.begin(p, [x])  ...  checkpoint.end(p, [y])
        ->  def recompute_p(x): ...; return (y, )      y, = checkpoint(recompute_p, x, ...)
    zero.gather(attr, path, [w, b])   ->  w, b = comm.zero_gather(self.attr, group=ZERO)
    zero.prefetch(attr, path)         ->  comm.zero_prefetch(self.attr, group=ZERO)
    zero.free(attr, path, [w, b])     ->  del w, b

and adds the `del` lines that free each activation at its last use (lifetimes.py), an
analysis of the straight-line code, not a change to it.
"""
from __future__ import annotations

from nncompile.ir import Graph, Op, Stage, Value, fmt_literal
from nncompile.ir.printer import fmt_body

from .lifetimes import del_lines, fixed_values, last_uses

_FIRST = "the first gather starts now"
_NEXT = "its gather runs while this one computes"


def statements(ops: list[Op]) -> list[tuple]:
    """The body's top-level statements: ("op", op), ("zero", op) or ("region", begin, body,
    end), the body a region's ops (its gathers included)."""
    out: list[tuple] = []
    region = None
    for op in ops:
        t = op.target if isinstance(op.target, str) else ""
        if t == "checkpoint.begin":
            region = (op, [])
        elif t == "checkpoint.end":
            out.append(("region", region[0], region[1], op))
            region = None
        elif region is not None:
            region[1].append(op)
        else:
            out.append(("zero" if t.startswith("zero.") else "op", op))
    return out


def zero_lines(op: Op, indent: str, first: bool = False) -> list[str]:
    """A zero.* op as the lines that run it."""
    kind = op.target.split(".", 1)[1]
    attr, path = op.args[0], op.args[1]
    if kind == "prefetch":
        return [f"{indent}comm.zero_prefetch(self.{attr}, group=ZERO)  # next unit {path}: "
                f"{_FIRST if first else _NEXT}"]
    values = op.args[2]
    names = ", ".join(v.name for v in values)
    if kind == "gather":
        return [f"{indent}# ZeRO-3 unit {path}: gather its {len(values)} parameter(s) over the "
                f"data-parallel ranks",
                f"{indent}{names + (',' if len(values) == 1 else '')} = "
                f"comm.zero_gather(self.{attr}, group=ZERO)"]
    return [f"{indent}del {names}  # ZeRO-3: unit {path} is freed (gathered again in backward)"]


def closure_lines(begin: Op, end: Op, body: list[str], indent: str,
                  draws: bool = False) -> list[str]:
    """A checkpoint region as a closure run under torch.utils.checkpoint. A region that
    draws with runtime/program/rng.py (`draws`) passes rng.recompute_draws, so its recompute draws
    what its forward drew on whichever generator rng.py uses."""
    path, args, outs = begin.args[0], begin.args[1], end.args[1]
    fn = "recompute_" + path.replace(".", "_")
    names = ", ".join(fmt_literal(v) for v in args)
    returned = "".join(v.name + ", " for v in outs)
    extra = ", context_fn=rng.recompute_draws" if draws else ""
    return [f"{indent}# recompute_modules: {path} keeps no activations; "
            "its forward runs again in backward",
            f"{indent}def {fn}({names}):", *body,
            f"{indent}    return ({returned})",
            f"{indent}{returned}= checkpoint({fn}{', ' + names if names else ''}, "
            f"use_reentrant=False{extra})"]


def render_body(g: Graph, indent: str, local_n: int) -> list[str]:
    """The ops of program `g` (the forward, or one stage: its outputs are what it returns)
    as lines. Under ZeRO-3 each op is printed on its own, with its user line wherever it
    differs from the previous op's; otherwise runs of ops share the source comments."""
    zero = Stage.ZERO3_LOWERED in g.stages
    items = statements(g.ops)
    fixed = fixed_values(g)
    stmts = [(s[1].inputs(), s[1].outputs) if s[0] == "op" else (s[1].args[1], s[3].args[1])
             for s in items if s[0] != "zero"]
    frees = iter(last_uses(stmts, g.outputs, fixed))
    inner = indent + "    "
    lines: list[str] = []
    prev: list = [None]            # the user line of the previous op (ZeRO-3's rule)

    def one(op: Op, ind: str, dels: list[Value]) -> list[str]:
        out = fmt_body([op], indent=ind, local_n=local_n, source=op.source != prev[0])
        prev[0] = op.source
        return out + del_lines(dels, ind)

    run: list[Op] = []             # consecutive top-level ops (printed together without ZeRO-3)
    run_frees: list[list[str]] = []

    def flush() -> None:
        if run:
            lines.extend(fmt_body(run, indent=indent, local_n=local_n, after=run_frees))
            run.clear()
            run_frees.clear()

    for k, item in enumerate(items):
        if item[0] == "zero":
            flush()
            lines += zero_lines(item[1], indent, first=k == 0)
        elif item[0] == "op":
            dels = next(frees)
            if zero:
                lines += one(item[1], indent, dels)
            else:
                run.append(item[1])
                run_frees.append(del_lines(dels, indent))
        else:
            flush()
            _, begin, body, end = item
            ops = [op for op in body if not op.is_structural]
            body_dels = iter(last_uses([(op.inputs(), op.outputs) for op in ops], end.args[1],
                                       fixed + list(begin.args[1])))
            text: list[str] = []
            if zero:
                for op in body:
                    text += zero_lines(op, inner) if op.is_structural else \
                        one(op, inner, next(body_dels))
            else:
                text = fmt_body(ops, indent=inner, local_n=local_n,
                                after=[del_lines(d, inner) for d in body_dels])
            draws = any(op.target_name.startswith("rng.") for op in ops)
            lines += closure_lines(begin, end, text, indent, draws)
            lines += del_lines(next(frees), indent)
    flush()
    return lines
