"""The plan fingerprint: a hash of what decides the generated code, and of nothing else.

reuse="match" compares it with the one in `manifest.json`; the generated files carry it as
`FINGERPRINT` (provenance only: checkpoints load by comparing shards, runtime/checkpoints/state.py).

Covered (a change here gives another fingerprint):
    graph      the traced graph printed without source comments: ops, arguments, value names,
               inputs, parameter/buffer FQNs, shapes and dtypes, and the output structure
    config     ComputeConfig.plan_json(): plan_ngpus, runtime_ngpus, constant_folding,
               inference_only, parallel, user_config (for autodist without its `device`)
    policy     a built-in's name; a callable's source text (inspect.getsource), else its
               qualified name
    device     autodist only: the resolved device profile (name and numbers), and the content
               of parallel.load_plan_path
    custom_ops the register_op annotation of each custom op the graph calls (the string, or a
               callable rule's source)
    version    the nncompile version and a hash of the compiler's own source (nncompile/ and
               its passes, not the runtime), so an upgraded compiler that writes other code
               regenerates even where the version number did not change
Not covered: the working directory, the model file's path, line numbers and source text
(comments only), the training-runtime fields of ComputeConfig (config.RUNTIME_FIELDS), and
code that does not change the traced graph (e.g. the body of a custom op).
"""
from __future__ import annotations

import functools
import hashlib
import inspect
import json
from pathlib import Path
from typing import Any

from .version import __version__
from .config import ComputeConfig
from .custom_ops import REGISTRY, is_custom_op
from .ir import Graph, print_graph


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _qualname(obj: Any) -> str:
    name = getattr(obj, "__qualname__", None) or type(obj).__qualname__
    return f"{getattr(obj, '__module__', None) or type(obj).__module__}.{name}"


def source_text(obj: Any) -> str:
    """A callable's source code, else its qualified name (builtins, C functions, REPL code)."""
    if isinstance(obj, functools.partial):
        return (f"partial({source_text(obj.func)}, *{obj.args!r}, "
                f"**{sorted(obj.keywords.items())!r})")
    target = obj if inspect.isroutine(obj) or inspect.isclass(obj) else type(obj)
    try:
        return inspect.getsource(target)
    except (OSError, TypeError):
        return _qualname(obj)


def _is_autodist(pas_policy: Any) -> bool:
    from nncompile.passes.policies import POLICIES
    return pas_policy == "autodist" if isinstance(pas_policy, str) \
        else pas_policy is POLICIES["autodist"]


def _device(config: ComputeConfig) -> str:
    from nncompile.passes.autodist import get_profile
    out = {"profile": get_profile(config.parallel.device).to_json()}
    plan = config.parallel.load_plan_path
    if plan and Path(plan).is_file():
        out["load_plan"] = _sha(Path(plan).read_text())
    return json.dumps(out, sort_keys=True, default=repr)


def _custom_ops(graph: Graph) -> str:
    names = sorted({op.target._opname for op in graph.const_ops + graph.ops
                    if is_custom_op(op.target)})
    rules = {}
    for name in names:
        op = REGISTRY.get(name)
        ann = None if op is None else op.annotation
        rules[name] = ann if isinstance(ann, str) or ann is None else source_text(ann)
    return json.dumps(rules, sort_keys=True)


def fingerprint_inputs(graph: Graph, config: ComputeConfig, pas_policy: Any,
                       graph_text: str | None = None) -> dict[str, str]:
    """The text of each covered part (see the module docstring), by name. graph_text: the
    graph printed without source lines, where the caller has it already."""
    plan = config.plan_json()
    autodist = _is_autodist(pas_policy)
    if autodist:
        plan["parallel"] = {k: v for k, v in plan.get("parallel", {}).items()
                            if k != "device"}
    return {
        "graph": (print_graph(graph, source=False) if graph_text is None else graph_text)
        + f"# out_spec: {graph.out_spec}\n"
        + "".join(f"# {k}: {getattr(graph.trace_info, k)!r}\n"
                  for k in ("args", "signature", "defaults", "sizes")),
        "config": json.dumps(plan, sort_keys=True),
        "policy": pas_policy if isinstance(pas_policy, str) else source_text(pas_policy),
        "device": _device(config) if autodist else "",
        "custom_ops": _custom_ops(graph),
        "version": f"{__version__} {compiler_digest()}",
    }


@functools.lru_cache(maxsize=None)
def compiler_digest() -> str:
    """A hash of the source files that decide the generated code: the nncompile package and
    its passes, without the runtime (which runs the code and does not write it)."""
    from . import passes
    root = Path(__file__).resolve().parent
    dirs = {root, Path(passes.__file__).resolve().parent}
    files = sorted({f.resolve() for d in dirs for f in d.rglob("*.py")
                    if "runtime" not in f.relative_to(d).parts[:1]})
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def compute_fingerprint(graph: Graph, config: ComputeConfig, pas_policy: Any,
                        graph_text: str | None = None) -> tuple[str, dict[str, str]]:
    """(fingerprint, {part: short hash of that part}); the parts go into the manifest so a
    mismatch can say which part changed. graph_text: see fingerprint_inputs."""
    parts = fingerprint_inputs(graph, config, pas_policy, graph_text)
    digest = _sha(json.dumps(parts, sort_keys=True))
    return digest, {k: _sha(v)[:16] for k, v in parts.items()}
