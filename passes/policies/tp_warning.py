"""The `tp` policy's report on itself: the one warning that names the linears of the layer
blocks left replicated, a line per layer kind with the reason found for it, and the share of
the blocks' weight elements a plan splits.

    tp at plan 2: 2 linear(s) in the layer blocks run replicated, because splitting them
    would need extra communication:
      attn.c_attn[0/3], [1/3], [2/3] (h.0, h.1): heads not divisible by 2 (3 heads in h.0); ...
"""
from __future__ import annotations

from nncompile.ir import FREE_KINDS, Graph, Op, Shard

from ..pipeline_stages import layer_of


def _kind(path: str) -> str:
    """`transformer.h.3.attn.c_attn` -> `attn.c_attn`: the same layer in every block."""
    layer = layer_of(path)
    return path[len(layer) + 1:] if layer and path.startswith(layer + ".") else path


def _head_counts(g: Graph, layer: str) -> list[int]:
    """Head counts in `layer`: the heads dim of reshapes `[b, t, C] -> [b, t, H, ...]` and of
    attention's q, k and v."""
    attention, reshapes = [], []
    for op in g.ops:
        if layer_of(op.module_path) != layer or not op.outputs or not op.outputs[0].is_tensor:
            continue
        name = getattr(op.target, "_opname", None)
        ins, out = op.tensor_inputs(), op.outputs[0].meta.shape
        if name == "scaled_dot_product_attention":
            attention += [v.meta.shape[-3] for v in ins[:3] if len(v.meta.shape) >= 3]
        elif name in ("view", "reshape", "_unsafe_view") and ins:
            shape = ins[0].meta.shape
            if len(shape) == 3 and len(out) >= 4 and tuple(out[:2]) == tuple(shape[:2]) \
                    and _numel(out[2:]) == shape[2]:
                reshapes.append(out[2])
    return attention or reshapes


def _parts_of_heads(op: Op) -> list[int]:
    """The head counts a split of `[b, t, H, d]` along H cuts it into (multi-query Falcon's
    `qkv.split([heads, 1, 1], dim=-2)`: 4 / 1 / 1)."""
    if getattr(op.target, "_opname", None) not in ("split", "split_with_sizes") \
            or not op.args or len(op.args[0].meta.shape) != 4:
        return []
    cut = (op.args[2] if len(op.args) > 2 else op.kwargs.get("dim", 0)) % 4
    return [v.meta.shape[cut] for v in op.outputs if v.is_tensor] if cut == 2 else []


def _numel(shape) -> int:
    total = 1
    for d in shape:
        total *= d
    return total


def _fed_by(col: Op, stop: Op, replicated_linears: dict[int, int]) -> list[Op]:
    """The replicated linears of `col`'s block that its input comes from, when its column
    split stopped where it meets the residual stream (`stop` adds a replicated activation):
    such a linear closes a region as a row split, once the linears before it split."""
    if getattr(stop.target, "_opname", None) not in ("add", "sub"):
        return []
    stream = {id(v) for v in stop.tensor_inputs() if v.requires_grad and v.kind not in FREE_KINDS
              and len(v.meta.shape) == len(stop.outputs[0].meta.shape)}
    layer, found, seen = layer_of(col.module_path), [], set()
    todo = [v for v in col.tensor_inputs() if v.kind not in FREE_KINDS]
    while todo:
        v = todo.pop()
        op = v.producer
        if id(v) in stream or op is None or id(op) in seen or layer_of(op.module_path) != layer:
            continue
        seen.add(id(op))
        if id(op) in replicated_linears:
            found.append(op)
            continue
        todo += [u for u in op.tensor_inputs() if u.kind not in FREE_KINDS]
    return sorted(found, key=lambda op: replicated_linears[id(op)])


def _why(g: Graph, n: int, col: Op, stop: Op | None, replicated_linears: dict[int, int]
         ) -> str:
    """Why the column split of `col` was undone: the reason actually found."""
    if stop is None:
        return "its split reaches the model's output still split"
    src = f" ({stop.source})" if stop.source else ""
    where = f"{stop.target_name} in {stop.module_path or 'the model'}{src}"
    feeds = _fed_by(col, stop, replicated_linears)
    if feeds:
        names = ", ".join(dict.fromkeys(_kind(op.module_path or op.name) for op in feeds))
        return (f"its input comes from {names}, which run replicated (a row split needs it "
                f"split); as a column split its output would meet the residual stream at "
                f"{where}")
    shapes = [v.meta.shape for v in stop.tensor_inputs() + stop.outputs if v.is_tensor]
    layer = layer_of(col.module_path)
    heads = sorted(set(_head_counts(g, layer)) | set(_parts_of_heads(stop)), reverse=True) \
        if layer else []
    if any(len(sh) >= 4 for sh in shapes) and any(h % n for h in heads):
        return (f"heads not divisible by {n} ({' / '.join(map(str, heads))} heads in "
                f"{layer}); its split stopped at {where}")
    return f"its split stopped at {where}: no rule takes its inputs split as they arrive"


def replicated_warning(g: Graph, n: int, ops: list[Op], stops: dict[str, Op]) -> str:
    """One line per layer kind (`attn.c_attn` of every block), in graph order, with the
    reason found for its first block (`stops`: where each one's split stopped)."""
    kinds: dict[str, list[Op]] = {}
    for op in ops:       # a part of a fused projection: its own line ("attn.c_attn[1/3]")
        kinds.setdefault(_kind(op.module_path or op.name) + op.attrs.get("part", ""),
                         []).append(op)
    rows: list[list] = []
    for kind, members in kinds.items():
        blocks = list(dict.fromkeys(layer_of(op.module_path) or op.name for op in members))
        shown = ", ".join(blocks[:3]) + (f", ... ({len(blocks)} blocks)" if len(blocks) > 3
                                         else "")
        first = next((op for op in members if op.name in stops), members[0])
        why = _why(g, n, first, stops.get(first.name), {id(op): i for i, op in enumerate(ops)})
        part = first.attrs.get("part", "")
        if part and rows and rows[-1][0] == kind[:-len(part)] and rows[-1][2:] == [shown, why]:
            rows[-1][1].append(part)         # the parts of one fused projection: one line
        else:
            rows.append([kind[:-len(part)] if part else kind, [part] if part else [], shown, why])
    lines = [f"  {kind}{', '.join(parts)} ({shown}): {why}." for kind, parts, shown, why in rows]
    text = "\n".join(lines)
    hint = ""
    if "heads not divisible" in text:
        hint = (" A single key/value head cannot be split by any plan size."
                if " / 1 heads in " in text or "(1 heads in " in text else
                " Pick a plan size that divides the head counts to split them.")
    convs = sum("conv" in op.target_name for op in ops)
    what = ("convolution(s)" if convs == len(ops) else "linear(s)" if not convs
            else "linear(s) and convolution(s)")
    return (f"tp at plan {n}: {len(ops)} {what} in the layer blocks run replicated, "
            f"because splitting them would need extra communication:\n{text}{hint}")


def split_share(graph: Graph) -> float:
    """Share of the layer blocks' weight elements (parameters of 2 or more dims inside
    numbered blocks, `h.3.attn.c_attn.weight`) that a planned graph splits: 1.0 for a full
    Megatron plan, 0.0 when every block runs replicated."""
    total = split = 0
    for v in graph.params:
        if len(v.meta.shape) < 2 or layer_of(v.fqn or "") is None:
            continue
        total += _numel(v.meta.shape)
        if isinstance(v.placement, Shard):
            split += _numel(v.meta.shape)
    return split / total if total else 0.0
