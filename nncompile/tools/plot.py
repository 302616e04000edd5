"""The op graph of plan.json as a picture a person can read, top to bottom.

    model.model.embed_tokens: embedding  [weight R]
      ┌ model.model.layers.0 ──────────────────────────────────────────┐
      │ input_layernorm: to, pow, mean +5                              │
      │ ◆ sync_grad R -> R                                             │
      │ self_attn.q_proj: linear [weight S(0)]   self_attn.k_proj ...  │
      │ ...                                                            │
      └────────────────────────────────────────────────────────────────┘
      model.model.layers.1 … model.model.layers.7: x 7 identical blocks
    model.model.norm: ...

One box per run of ops of one module (in program order), labelled with its module path
(relative to its block) and op kinds, coloured by the run's output placement, with the
parameters it reads and their placements as coloured tags; collectives are boxes of their own
with a black border. Repeated blocks (a module path with an index, `layers.3`) whose ops,
placements and collectives equal the block before are drawn once: the first expanded inside a
frame, the run of identical ones after it as one summary box, so a 32-layer model draws like a
2-layer one. Drawn with matplotlib's Agg canvas (no pyplot, no display needed).
"""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..ir.placement import Placement, Replicate, Shard, parse_placement

FIXED_COLOURS = {"R": "#4c72b0", "P": "#c44e52", "-": "#bbbbbb"}
SHARD_COLOURS = ["#55a868", "#dd8452", "#8172b3", "#937860", "#da8bc3", "#8c8c8c", "#ccb974",
                 "#64b5cd"]
SUMMARY_COLOUR = "#e8e8e8"
MAX_PIXELS = 40e6
ROW = 0.42                  # inches between rows
CHAR = 0.058                # inches per character at FONT points
FONT = 7.5
GAP = 0.35                  # inches between boxes of a row


def _parsed(placement: str) -> Placement | None:
    """The placement a plan.json entry names (None for '-', no tensor output)."""
    try:
        return parse_placement(placement)
    except ValueError:
        return None


def placement_colour(placement: str) -> str:
    if placement in FIXED_COLOURS:
        return FIXED_COLOURS[placement]
    p = _parsed(placement)
    if isinstance(p, Shard):
        return SHARD_COLOURS[p.dim % len(SHARD_COLOURS)]
    return "#222222"


def _describe(placement: str) -> str:
    p = _parsed(placement)
    if isinstance(p, Shard):
        return f"{placement} split dim {p.dim}"
    return {"R": "R replicated", "P": "P partial sum", "-": "no tensor output"}.get(placement,
                                                                                   placement)


def _split(entry: str) -> tuple[str, str]:
    """'value: placement' -> (value, placement)."""
    name, _, placement = entry.rpartition(": ")
    return (name, placement) if name else (entry, "-")


def _short(target: str) -> str:
    """'aten.linear.default' -> 'linear', 'comm.all_gather' -> 'all_gather'."""
    parts = target.split(".")
    return parts[1] if parts[0] == "aten" and len(parts) > 1 else parts[-1]


def block_of(module: str) -> tuple[str, str, int, str] | None:
    """'model.layers.3.self_attn.q_proj' -> ('model.layers.3', 'model.layers', 3,
    'self_attn.q_proj'): the first indexed module on the path; None outside any."""
    parts = module.split(".") if module else []
    for i, part in enumerate(parts):
        if part.isdigit() and i > 0:
            return (".".join(parts[:i + 1]), ".".join(parts[:i]), int(part),
                    ".".join(parts[i + 1:]))
    return None


# ---- the condensed graph -----------------------------------------------------------------
def _runs(plan: dict[str, Any], local_fqn: dict[str, str]) -> list[dict[str, Any]]:
    """Maximal runs of ops with one module path (a collective is a run of its own)."""
    runs: list[dict[str, Any]] = []
    for op in plan["ops"]:
        comm = op["op"].startswith("comm.")
        module = op.get("module") or ""
        if not module and comm:          # an inserted collective of a parameter: its owner
            fqns = [local_fqn[v] for v, _ in map(_split, op["inputs"]) if v in local_fqn]
            module = fqns[0].rpartition(".")[0] if fqns else ""
        outs = [_split(o) for o in op["outputs"]]
        last = runs[-1] if runs else None
        if last is None or comm or last["kind"] == "collective" or last["module"] != module:
            last = {"module": module, "kind": "collective" if comm else "op", "ops": [],
                    "kinds": [], "weights": {}, "outputs": set(), "inputs": []}
            runs.append(last)
        last["ops"].append(op["name"])
        if _short(op["op"]) not in last["kinds"]:
            last["kinds"].append(_short(op["op"]))
        last["placement"] = outs[0][1] if outs else "-"
        last["from"] = _split(op["inputs"][0])[1] if op["inputs"] else "-"
        for value, placement in (_split(e) for e in op["inputs"]):
            if value in local_fqn:
                last["weights"][local_fqn[value]] = placement
            else:
                last["inputs"].append(value)
        last["outputs"].update(v for v, _ in outs)
    return runs


def _label(run: dict[str, Any], rel: str) -> str:
    if run["kind"] == "collective":
        return f"{run['kinds'][0]} {run['from']} -> {run['placement']}"
    kinds = run["kinds"]
    ops = ", ".join(kinds[:3]) + (f" +{len(kinds) - 3}" if len(kinds) > 3 else "")
    return f"{rel}: {ops}" if rel else ops


def _weight_tags(run: dict[str, Any]) -> list[tuple[str, str]]:
    """(text, placement) per parameter a run reads, named relative to its module."""
    prefix = run["module"] + "." if run["module"] else ""
    return [(fqn[len(prefix):] if prefix and fqn.startswith(prefix) else fqn, place)
            for fqn, place in run["weights"].items()]


def condensed_graph(plan: dict[str, Any], manifest: dict[str, Any]):
    """networkx DiGraph of the boxes the picture draws. Node attributes: label, kind ('op',
    'collective', 'input', 'summary'), placement, weights [(name, placement)], block (the
    expanded block's module path, or None), blocks (a summary: the module paths it stands
    for). Returns (graph, expanded block paths)."""
    import networkx as nx
    params = (manifest.get("ranks") or {}).get("0", {}).get("params", [])
    local_fqn = {p["local"]: p["fqn"] for p in params}
    runs = _runs(plan, local_fqn)
    # the blocks, in order, with the signature that says whether two are identical
    blocks: dict[str, dict[str, Any]] = {}
    for run in runs:
        b = block_of(run["module"])
        run["block"] = b[0] if b else None
        run["rel"] = b[3] if b else run["module"]
        if b:
            entry = blocks.setdefault(b[0], {"family": b[1], "index": b[2], "sig": []})
            entry["sig"].append((run["rel"], tuple(run["kinds"]), run["placement"],
                                 tuple(sorted(p for p in _weight_tags(run)))))
    summary_of: dict[str, str] = {}            # collapsed block -> its summary node
    expanded: list[str] = []
    prev: dict[str, Any] | None = None
    for path, entry in blocks.items():
        same = (prev is not None and prev["family"] == entry["family"]
                and prev["index"] + 1 == entry["index"] and prev["sig"] == entry["sig"])
        if same and prev["path"] in summary_of:
            summary_of[path] = summary_of[prev["path"]]
        elif same:
            summary_of[path] = f"summary:{path}"
        else:
            expanded.append(path)
        prev = {**entry, "path": path}
    g = nx.DiGraph()
    node_of: dict[str, str] = {}               # value -> node producing it
    inputs = {i["name"] for i in manifest.get("inputs", [])}
    for i, run in enumerate(runs):
        node = summary_of.get(run["block"]) if run["block"] else None
        if node is None:
            node = f"run{i}"
            g.add_node(node, label=_label(run, run["rel"]), kind=run["kind"],
                       placement=run["placement"], weights=_weight_tags(run),
                       block=run["block"], module=run["module"], order=i)
        elif node not in g:
            g.add_node(node, kind="summary", placement="-", weights=[], block=None,
                       blocks=[], module=run["block"], order=i)
        if g.nodes[node]["kind"] == "summary" and run["block"] not in g.nodes[node]["blocks"]:
            g.nodes[node]["blocks"].append(run["block"])
        for value in run["inputs"]:
            src = node_of.get(value)
            if src is None and value in inputs:
                src = f"input:{value}"
                g.add_node(src, label=value, kind="input", placement="R", weights=[],
                           block=None, module="", order=-1)
            if src is not None and src != node and \
                    g.nodes[src]["order"] < g.nodes[node]["order"]:   # stays acyclic
                g.add_edge(src, node)
        for value in run["outputs"]:
            node_of[value] = node
    for node, d in g.nodes(data=True):
        if d["kind"] == "summary":
            first, last, n = d["blocks"][0], d["blocks"][-1], len(d["blocks"])
            d["label"] = (f"{first} … {last.rsplit('.', 1)[-1]}: x {n} identical block"
                          f"{'s' if n > 1 else ''} (as the one above)" if n > 1 else
                          f"{first}: identical to the block above")
    return g, expanded


# ---- layout ------------------------------------------------------------------------------
def _label_width(d: dict[str, Any]) -> float:
    return CHAR * len(d["label"]) + 0.3


def _width(d: dict[str, Any]) -> float:
    """A box's width in inches, its weight tags included."""
    return _label_width(d) + sum(CHAR * len(f"{n} {p}") + 0.3 for n, p in d["weights"])


def _rows(g) -> list[list[str]]:
    """Topological rows; an op moves down as far as its readers allow (a side branch sits
    next to its use); within a row, program order."""
    import networkx as nx
    for depth, nodes in enumerate(nx.topological_generations(g)):
        for n in nodes:
            g.nodes[n]["row"] = depth
    for n in reversed(list(nx.topological_sort(g))):
        readers = [g.nodes[s]["row"] for s in g.successors(n)]
        if readers and g.nodes[n]["kind"] != "input":
            g.nodes[n]["row"] = max(g.nodes[n]["row"], min(readers) - 1)
    rows: dict[int, list[str]] = {}
    for n, d in g.nodes(data=True):
        rows.setdefault(d["row"], []).append(n)
    return [sorted(rows[k], key=lambda n: g.nodes[n]["order"]) for k in sorted(rows)]


def layout(g) -> tuple[dict[str, tuple[float, float]], float, float]:
    """Where each box's label is centred, in inches (x right, y down from 0; its weight tags
    follow on the right), and the drawing's width and height."""
    rows = _rows(g)
    widths = [sum(_width(g.nodes[n]) for n in row) + GAP * (len(row) - 1) for row in rows]
    total = max(widths)
    pos = {}
    for r, (row, w) in enumerate(zip(rows, widths)):
        x = (total - w) / 2
        for n in row:
            bw = _width(g.nodes[n])
            pos[n] = (x + _label_width(g.nodes[n]) / 2, -(r + 0.5) * ROW)
            x += bw + GAP
    return pos, total, len(rows) * ROW


# ---- drawing -----------------------------------------------------------------------------
def plot_plan(plan: dict[str, Any], manifest: dict[str, Any], output: Path) -> Path:
    """Draw the plan's op graph into `output`, written under a temporary name then renamed."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import FancyBboxPatch, Patch

    g, expanded = condensed_graph(plan, manifest)
    if not g.number_of_nodes():
        raise ConfigError("plan.json has no ops to draw")
    pos, width, height = layout(g)
    legend_w = 2.4
    fig_w, fig_h = width + legend_w + 0.8, height + 1.0
    dpi = max(30, min(110, int(math.sqrt(MAX_PIXELS / (fig_w * fig_h)))))
    fig = Figure(figsize=(fig_w, fig_h), dpi=dpi)
    FigureCanvasAgg(fig)
    ax = fig.add_axes((0.3 / fig_w, 0.2 / fig_h, (width + 0.2) / fig_w, height / fig_h))
    ax.set_xlim(-0.1, width + 0.1)
    ax.set_ylim(-height, 0)
    ax.set_axis_off()
    for u, v in g.edges:
        (x0, y0), (x1, y1) = pos[u], pos[v]
        ax.annotate("", xy=(x1, y1 + 0.11), xytext=(x0, y0 - 0.11), zorder=1,
                    arrowprops=dict(arrowstyle="-|>", color="#9a9a9a", lw=0.6,
                                    mutation_scale=7, shrinkA=0, shrinkB=0))
    for path in expanded:                               # a frame around each expanded block
        mine = [(pos[n], d) for n, d in g.nodes(data=True) if d.get("block") == path]
        if not mine:
            continue
        left = min(x - _label_width(d) / 2 for (x, _), d in mine) - 0.1
        right = max(x - _label_width(d) / 2 + _width(d) for (x, _), d in mine) + 0.1
        mine = [xy for xy, _ in mine]
        top, bottom = max(y for _, y in mine) + 0.3, min(y for _, y in mine) - 0.2
        ax.add_patch(FancyBboxPatch((left, bottom), right - left, top - bottom,
                                    boxstyle="round,pad=0.02", fc="#f7f7fb", ec="#8888aa",
                                    lw=0.8, ls="--", zorder=0))
        ax.text(left + 0.05, top - 0.04, path, fontsize=FONT, va="top", color="#444466",
                style="italic", zorder=0.5)
    for n, d in g.nodes(data=True):
        x, y = pos[n]
        kind = d["kind"]
        colour = SUMMARY_COLOUR if kind == "summary" else placement_colour(d["placement"])
        dark = kind != "summary"
        box = dict(boxstyle="round,pad=0.25" if kind != "input" else "square,pad=0.25",
                   fc=colour, ec="black" if kind in ("collective", "summary") else "white",
                   lw=1.4 if kind == "collective" else 0.6)
        t = ax.text(x, y, d["label"], fontsize=FONT, va="center", ha="center",
                    color="white" if dark else "black", bbox=box, zorder=3,
                    fontweight="bold" if kind == "collective" else "normal")
        t.set_gid(n)
        tx = x + _label_width(d) / 2 + 0.1
        for name, place in d["weights"]:
            text = f"{name} {place}"
            ax.text(tx, y, text, fontsize=FONT - 0.5, va="center", ha="left", color="black",
                    bbox=dict(boxstyle="round,pad=0.15", fc=placement_colour(place),
                              ec="none", alpha=0.55), zorder=3)
            tx += CHAR * len(text) + 0.3
    placements = sorted({d["placement"] for _, d in g.nodes(data=True) if d["kind"] != "summary"}
                        | {p for _, d in g.nodes(data=True) for _, p in d["weights"]},
                        key=lambda p: (not isinstance(_parsed(p), Replicate),
                                       not isinstance(_parsed(p), Shard), p))
    handles = [Patch(fc=placement_colour(p), ec="white", label=_describe(p)) for p in placements]
    handles += [Patch(fc="white", ec="black", lw=1.4, label="collective (comm.*)"),
                Patch(fc="#f7f7fb", ec="#8888aa", ls="--", label="a repeated block, drawn once"),
                Patch(fc=SUMMARY_COLOUR, ec="black", label="identical blocks, summarized")]
    fig.legend(handles=handles, loc="upper right", fontsize=FONT, frameon=False,
               title="output / weight placement", title_fontsize=FONT)
    n_comm = sum(1 for o in plan["ops"] if o["op"].startswith("comm."))
    cfg = manifest.get("config", {})
    fig.suptitle(f"{manifest.get('model', '?')}: policy {manifest.get('policy', '?')}, "
                 f"plan_ngpus {plan.get('plan_ngpus', '?')}, runtime_ngpus "
                 f"{cfg.get('runtime_ngpus', '?')} ({len(plan['ops'])} ops, {n_comm} comm ops)",
                 fontsize=10, x=0.3 / fig_w, ha="left", y=1 - 0.15 / fig_h, va="top")
    return save_figure(fig, output, dpi=dpi)


def save_figure(fig, output: Path, dpi=None) -> Path:
    """Write a matplotlib figure in the format its suffix names, atomically (temp name, then
    rename); a suffix matplotlib cannot write is a ConfigError naming the ones it can."""
    fmt = output.suffix.lstrip(".").lower() or "png"
    supported = fig.canvas.get_supported_filetypes()
    if fmt not in supported:
        raise ConfigError(f"cannot write {output}: .{fmt} is not an image format matplotlib "
                          f"writes; use one of {', '.join('.' + f for f in sorted(supported))}")
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(f".{output.name}.tmp-{os.getpid()}")
    try:
        fig.savefig(tmp, format=fmt, bbox_inches="tight", **({"dpi": dpi} if dpi else {}))
        os.replace(tmp, output)
    finally:
        tmp.unlink(missing_ok=True)
    return output
