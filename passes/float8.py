"""float8_linears and lower_float8: the nn.Linear layers ComputeConfig.float8 converts run
torchao's float8 training (nncompile/float8_spec.py says which, runtime/program/float8.py runs them).

float8_linears (before the plan) marks each converted layer's linear op, so the plan never
gives it a partial-sum operand (a partial sum cannot be cast: its amax is not the sum's) and
the cost model prices a float8 matmul:

Before:                                          After:
    y = aten.linear.default(x, w, b)  # f32[8, 64]   y = aten.linear.default(x, w, b)  # f32[8, 64]  float8=tensorwise

It also records, in plan.json's `float8`, every nn.Linear of the model with "float8" or the
reason it stays in high precision (torchao's filter, `skip`, or an op this pass cannot take:
a linear whose weight is not a whole parameter), and under `zero3_gather` whether ZeRO-3
may gather each converted weight in float8 (Float8Spec.all_gather: the tensorwise recipe,
a weight no other op reads; runtime/store/zero_float8.py).

lower_float8 (after localize) makes each marked op the runtime's float8 linear, told how the
plan split its operands (per mesh axis: "T" tokens, "K" the contracted dim, "N" the output
features), so each amax is the full tensor's:

Before (tp 2, column split):                     After:
    y = aten.linear.default(x, w, b)  # S(2)         y = FLOAT8.linear(x, w, b, x_split={},
      [split n]  float8=tensorwise                       w_split={'plan': 'N'}, out_split={'plan': 'N'})

Precondition: float8_linears before the plan; lower_float8 after localize. Idempotent: yes.
"""
from __future__ import annotations

from nncompile.ir import PARAM, Graph, Op, Partial, Shard, Stage
from nncompile.log import log

from .contract import contract

TARGET = "FLOAT8.linear"


def _layer_of(op: Op) -> str | None:
    """The module path of the nn.Linear an aten.linear op runs (None: not one's own call)."""
    if op.target_name != "aten.linear.default" or not op.module_stack:
        return None
    return op.module_stack[-1][0]


class Float8Linears:
    """Mark the linear op of each layer in `layers` ({FQN: None (converts) or why not},
    nncompile.float8_spec.float8_layers) with the recipe."""
    name = "float8_linears"
    requires = produces = ()

    def __init__(self, recipe: str, scales: str, layers: dict[str, str | None],
                 all_gather: bool = True):
        self.recipe, self.scales, self.layers = recipe, scales, dict(layers)
        self.all_gather = all_gather

    def __call__(self, graph: Graph) -> Graph:
        g = graph.clone()
        decided = dict(self.layers)
        seen: set[str] = set()
        for op in g.ops:
            fqn = _layer_of(op)
            if fqn is None or fqn not in self.layers:
                continue
            seen.add(fqn)
            if self.layers[fqn] is not None:
                continue
            w = op.args[1]
            if getattr(w, "kind", None) != PARAM or w.part is not None:
                decided[fqn] = ("its weight is not a whole parameter in the traced program "
                                "(cut from a fused one, or computed)")
                continue
            op.float8 = self.recipe
        for fqn in self.layers:
            if fqn not in seen and decided[fqn] is None:
                decided[fqn] = "not called by the traced forward as its own nn.Linear"
        converted = sum(why is None for why in decided.values())
        log(f"float8 ({self.recipe}): {converted} of {len(decided)} nn.Linear layer(s) "
            "converted (plan.json: float8)")
        g.plan_state.float8 = {"recipe": self.recipe, "scales": self.scales, "layers": {
            fqn: "float8" if why is None else why for fqn, why in decided.items()},
            "zero3_gather": self._gathers(g)}
        return g

    def _gathers(self, g: Graph) -> dict[str, str]:
        """{converted weight FQN: "float8" or why ZeRO-3 gathers it in high precision}."""
        weights = {id(op.args[1]): op.args[1] for op in g.ops if op.float8}
        readers: dict[int, str] = {}     # a weight another op reads -> that op
        for op in g.ops:
            for v in op.inputs():
                if id(v) in weights and not (op.float8 and v is op.args[1]):
                    readers.setdefault(id(v), op.target_name)
        out = {}
        for key, w in weights.items():
            if not self.all_gather:
                out[w.fqn] = "Float8Spec(all_gather=False)"
            elif self.recipe != "tensorwise":
                out[w.fqn] = (f"the {self.recipe} recipe scales the weight per row, differently "
                              "for each product (torchao gathers only tensorwise weights in "
                              "float8)")
            elif key in readers:
                out[w.fqn] = f"{readers[key]} reads it too, in high precision"
            else:
                out[w.fqn] = "float8"
        return out


def zero3_float8_gathers(g: Graph) -> dict[str, list[str]]:
    """{local name: mesh axes the plan splits it along} of the weights ZeRO-3 gathers in
    float8: those plan.json's `zero3_gather` allows, read by FLOAT8.linear ops alone (call
    before lower_zero3 adds its ops)."""
    f8 = g.plan_state.float8 or {}
    allowed = {fqn for fqn, how in f8.get("zero3_gather", {}).items() if how == "float8"}
    out: dict[str, list[str]] = {}
    other: set[str] = set()
    for op in g.ops:
        inputs = op.inputs()
        if op.target == TARGET and getattr(op.args[1], "fqn", None) in allowed:
            w = op.args[1]
            out[w.name] = sorted(op.kwargs["w_split"])
            inputs = [v for v in inputs if v is not w]
        other |= {v.name for v in inputs if getattr(v, "kind", None) == PARAM}
    return {name: axes for name, axes in out.items() if name not in other}


def _splits(v, axes: list[str], letters: dict[int, str]) -> dict[str, str]:
    """{mesh axis: "T" | "K" | "N"} where value `v` is split (a partial sum: nowhere)."""
    out = {}
    rank = len(v.meta.shape)
    for axis in axes:
        p = v.placement_on(axis)
        if isinstance(p, Shard):
            d = p.dim % rank
            out[axis] = letters.get(d, "T")
    return out


@contract(requires=(Stage.LOCALIZED,))
def lower_float8(graph: Graph) -> Graph:
    if not any(op.float8 and op.target != TARGET for op in graph.ops):
        return graph
    g = graph.clone()
    axes = ["plan", *g.axes]
    for op in g.ops:
        if not op.float8 or op.target == TARGET:
            continue
        x, w, *rest = op.args
        b = rest[0] if rest else None
        out = op.outputs[0]
        last = len(x.meta.shape) - 1
        if any(isinstance(v.placement_on(a), Partial) for v in (x, w) for a in axes):
            raise AssertionError(f"float8 linear {op.name} takes a partial sum")   # the rule
        op.target = TARGET
        op.args = (x, w, b)
        op.kwargs = {"x_split": _splits(x, axes, {last: "K"}),
                     "w_split": _splits(w, axes, {0: "N", 1: "K"}),
                     "out_split": _splits(out, axes, {last: "N"})}
    return g


lower_float8.quiet_when_unchanged = True
