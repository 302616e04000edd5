"""Package layers: the import graph between nncompile's packages has one direction.

    core         nncompile/ (ir, rules, frontend, config, mesh, rank_file, ...)
    passes       nncompile.passes           imports core
    codegen      nncompile.codegen (the package: render, notes, body, lifetimes, pipeline)
                                            imports core, passes
    runtime      nncompile.runtime          imports core
    tools        nncompile.tools            imports core, passes, codegen, runtime
    facade       nncompile/__init__.py, __main__.py, api.py and fingerprint.py (parallelize,
                 verify: they compile, check with the tools and load with the runtime)
                                            imports every layer but integration
    integration  nncompile.integration      imports every layer

Inside the runtime, five packages import downward only (RUNTIME_ORDER), no two runtime modules
import each other in a loop, and the runtime loads without the compiler (COMPILER).

Every module is parsed (ast), so imports inside functions count, and so do the names given to
`__import__`, `importlib.import_module` and `importlib.util.find_spec`; relative imports are
resolved. Text inside a string (codegen writes `from nncompile.runtime import ...` into the
generated files) is not an import.
"""
from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[1]
FACADE = {"nncompile", "nncompile.__main__", "nncompile.api", "nncompile.fingerprint"}
CODEGEN = {"nncompile.codegen"}   # and nncompile.codegen.*
ALLOWED = {
    "core": set(),
    "passes": {"core"},
    "codegen": {"core", "passes"},
    "runtime": {"core"},
    "tools": {"core", "passes", "codegen", "runtime"},
    "facade": {"core", "passes", "codegen", "runtime", "tools"},
    "integration": {"core", "passes", "codegen", "runtime", "tools", "facade"},
}
DYNAMIC = {"__import__", "import_module", "find_spec"}   # calls that take a module name
RUNTIME_ORDER = ["protocol", "store", "optim", "checkpoints", "program"]  # each imports earlier
COMPILER = ("nncompile.frontend", "nncompile.rules", "nncompile.passes", "nncompile.codegen",
            "nncompile.api", "nncompile.tools", "nncompile.fingerprint", "nncompile.integration")


def package_dirs() -> dict[str, Path]:
    """pyproject's package-dir mapping: top package name -> directory."""
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    return {name: ROOT / d for name, d in cfg["package-dir"].items()}


def modules() -> dict[str, tuple[Path, bool]]:
    """Every module of the project: dotted name -> (file, is a package's __init__)."""
    out: dict[str, tuple[Path, bool]] = {}
    dirs = package_dirs()
    for pkg, d in dirs.items():
        for path in sorted(d.rglob("*.py")):
            rel = path.relative_to(d).with_suffix("").parts
            if "__pycache__" in rel or any(path.is_relative_to(o) for p, o in dirs.items()
                                           if p != pkg and o != d and o.is_relative_to(d)):
                continue
            is_pkg = rel[-1] == "__init__"
            name = ".".join((pkg,) + (rel[:-1] if is_pkg else rel))
            out[name] = (path, is_pkg)
    return out


def layer(name: str) -> str | None:
    """The layer of module `name`; None outside the project."""
    if name in FACADE:
        return "facade"
    if name in CODEGEN or name.startswith("nncompile.codegen."):
        return "codegen"
    for pkg, lay in (("nncompile.runtime", "runtime"), ("nncompile.integration", "integration"),
                     ("nncompile.tools", "tools"), ("nncompile.passes", "passes")):
        if name == pkg or name.startswith(pkg + "."):
            return lay
    return "core" if name.startswith("nncompile.") else None


def imports(source: str, name: str, is_pkg: bool, known: set[str]) -> list[tuple[int, str]]:
    """(line, imported module) for every import in `source`, the module `name`."""
    package = name if is_pkg else name.rpartition(".")[0]
    found: list[tuple[int, str]] = []

    def resolve(level: int, module: str | None) -> str:
        base = package.split(".")
        base = base[:len(base) - (level - 1)] if level > 1 else base
        return ".".join(base + ([module] if module else []))

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            mod = resolve(node.level, node.module) if node.level else node.module
            for a in node.names:        # `from pkg import mod` imports the module pkg.mod
                sub = f"{mod}.{a.name}"
                found.append((node.lineno, sub if sub in known else mod))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            fn = node.func
            called = fn.id if isinstance(fn, ast.Name) else getattr(fn, "attr", None)
            if called in DYNAMIC:
                target = node.args[0].value
                if target.startswith("."):
                    dots = len(target) - len(target.lstrip("."))
                    target = resolve(dots, target[dots:] or None)
                found.append((node.lineno, target))
    return sorted(found)


def project_imports():
    """(importing module, its file, line, imported module) within the project."""
    mods = modules()
    for name, (path, is_pkg) in mods.items():
        for line, target in imports(path.read_text(), name, is_pkg, set(mods)):
            if layer(target) is not None:
                yield name, path, line, target


def test_core_imports_no_layer_above_it():
    bad = sorted({f"{path.relative_to(ROOT)}:{line}: {target}"
                  for name, path, line, target in project_imports()
                  if layer(name) == "core" and layer(target) != "core"})
    assert not bad, "the core imports a layer above it:\n" + "\n".join(bad)


def test_passes_import_neither_codegen_nor_runtime():
    bad = sorted({f"{path.relative_to(ROOT)}:{line}: {target}"
                  for name, path, line, target in project_imports()
                  if layer(name) == "passes" and layer(target) not in ("core", "passes")})
    assert not bad, "a pass imports a layer above the passes:\n" + "\n".join(bad)


def test_package_graph_has_one_direction():
    g = nx.DiGraph()
    g.add_nodes_from(ALLOWED)
    where: dict[tuple[str, str], str] = {}
    for name, path, line, target in project_imports():
        a, b = layer(name), layer(target)
        if a != b:
            g.add_edge(a, b)
            where.setdefault((a, b), f"{path.relative_to(ROOT)}:{line}: {target}")
    upward = [f"{a} -> {b} ({where[a, b]})" for a, b in g.edges if b not in ALLOWED[a]]
    assert not upward, "imports against the layer order:\n" + "\n".join(upward)
    assert nx.is_directed_acyclic_graph(g), nx.find_cycle(g)
    # the layers are really used as described (a test of the test's own mapping)
    assert {("runtime", "core"), ("tools", "runtime"), ("facade", "tools"), ("passes", "core"),
            ("codegen", "passes"), ("facade", "codegen")} <= set(g.edges)


def test_every_core_file_is_seen():
    mods = modules()
    core = {p.relative_to(ROOT).as_posix() for n, (p, _) in mods.items() if layer(n) == "core"}
    assert {"nncompile/frontend/__init__.py", "nncompile/ir/graph.py", "nncompile/rank_file.py",
            "nncompile/rows.py", "nncompile/arguments.py"} <= core
    assert not any(f.startswith(("runtime/", "integration/", "nncompile/tools/", "passes/"))
                   for f in core)
    assert layer("nncompile.tools.check") == "tools" and layer("nncompile.api") == "facade"
    assert layer("nncompile.passes.insert_comm") == "passes" == layer("nncompile.passes")
    assert layer("nncompile.codegen") == "codegen" == layer("nncompile.codegen.pipeline")


def test_every_package_is_installed():
    """pyproject lists each package a wheel must hold: a subpackage left out of it imports in
    an editable checkout and is missing from a regular install."""
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())
                 ["tool"]["setuptools"]["packages"])
    found = {n for n, (_, is_pkg) in modules().items() if is_pkg}
    assert found == listed, (f"missing from pyproject's packages: {sorted(found - listed)}; "
                             f"listed but absent: {sorted(listed - found)}")


def test_detector_sees_every_kind_of_import():
    """Imports in functions, relative ones and the dynamic kinds count; strings do not."""
    src = '''
import nncompile.runtime.comm
from ..runtime import rng
from .. import tools
def f():
    from nncompile.integration.lightning import strategy
    __import__("nncompile.runtime").runtime
    importlib.import_module("nncompile.tools.plot")
    importlib.util.find_spec("..runtime", __package__)
    code = "from nncompile.runtime import comm"
'''
    known = {"nncompile.tools", "nncompile.runtime.rng"}
    got = [(line, t) for line, t in imports(src, "nncompile.passes.x", False, known)]
    assert got == [(2, "nncompile.runtime.comm"), (3, "nncompile.runtime.rng"),
                   (4, "nncompile.tools"), (6, "nncompile.integration.lightning"),
                   (7, "nncompile.runtime"), (8, "nncompile.tools.plot"),
                   (9, "nncompile.runtime")], got
    assert [layer(t) for _, t in got] == ["runtime", "runtime", "tools", "integration",
                                          "runtime", "tools", "runtime"]


def _runtime_package(name: str) -> str | None:
    """"store" for nncompile.runtime.store.zero; None for the runtime's own __init__."""
    parts = name.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == ["nncompile", "runtime"] else None


def test_runtime_packages_import_downward():
    seen, bad = set(), []
    for name, path, line, target in project_imports():
        a, b = _runtime_package(name), _runtime_package(target)
        if layer(name) != "runtime" or layer(target) != "runtime":
            continue
        assert a in RUNTIME_ORDER + [None] and b in RUNTIME_ORDER + [None], (name, target)
        if name == "nncompile.runtime":
            bad.append(f"{path.relative_to(ROOT)}:{line}: {target} (the runtime's __init__)")
        elif a != b:
            seen.add((a, b))
            if b is None or RUNTIME_ORDER.index(b) > RUNTIME_ORDER.index(a):
                bad.append(f"{path.relative_to(ROOT)}:{line}: {a} -> {target}")
    assert not bad, "a runtime package imports one above it:\n" + "\n".join(sorted(bad))
    # every package is used by the one above it (a test of the order itself)
    assert {("store", "protocol"), ("optim", "store"), ("checkpoints", "optim"),
            ("program", "checkpoints")} <= seen


def test_runtime_modules_import_without_a_cycle():
    g = nx.DiGraph()
    where = {}
    for name, path, line, target in project_imports():
        if layer(name) == "runtime" and layer(target) == "runtime" and name != target:
            if target in modules() and not modules()[target][1]:      # a module, not a package
                g.add_edge(name, target)
                where[name, target] = f"{path.relative_to(ROOT)}:{line}"
    assert g.number_of_nodes() > 30
    cycles = [c for c in nx.strongly_connected_components(g) if len(c) > 1]
    assert not cycles, "runtime modules importing each other in a loop: " + "; ".join(
        " -> ".join(f"{a} ({where[a, b]})" for a, b in nx.find_cycle(g.subgraph(c)))
        for c in cycles)


def test_runtime_imports_without_the_compiler():
    """A rank program needs the runtime and the core: importing every runtime module (and
    `import nncompile`) loads no tracing, pass, codegen or tool module."""
    import subprocess
    import sys
    runtime = sorted(n for n in modules() if layer(n) == "runtime")
    code = ("import sys, importlib\n"
            f"for m in {runtime!r}: importlib.import_module(m)\n"
            "import nncompile\n"
            f"print([m for m in sys.modules if m.startswith({COMPILER!r})])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", f"the compiler was loaded: {out.stdout}"
