"""Every code block of docs/ runs: one test per page (tests/doc_runner.py in a fresh copy of the
repository, as a person would run it from the repository root), and every output block matches
what its block printed, and the page leaves nothing that .gitignore does not cover; each page
compiles into its own gen/<page>/, so pages run in order in one checkout do not collide; plus
checks that the index links every page, that the runner refuses what it cannot run and that it
catches shown output that differs from the printed."""
from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

import doc_runner

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
RUNNER = Path(doc_runner.__file__).resolve()
# the pages in reading order; docs/README.md links them in this order
PAGES = ["quickstart.md", "concepts.md", "policies.md", "autodist.md", "custom_ops.md",
         "gen_savedir.md", "checkpoints.md", "lightning.md", "troubleshooting.md"]
OWN_PAGES = [p for p in PAGES if p != "custom_ops.md"]     # must exist


def _pages() -> list[str]:
    found = {p.name for p in DOCS.glob("*.md")} - {"README.md"}
    return [p for p in PAGES if p in found or p in OWN_PAGES] + sorted(found - set(PAGES))


def _env() -> dict[str, str]:
    # for speed only: one thread per process, no progress lines on stderr (never compared)
    return {**os.environ, "OMP_NUM_THREADS": "1", "NNCOMPILE_QUIET": "1"}


def _run(page: Path, workdir: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(RUNNER), str(page), "--workdir", str(workdir)],
                          cwd=workdir, env=_env(), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout)


@pytest.mark.parametrize("name", _pages())
def test_page(name, tmp_path):
    page = DOCS / name
    assert page.exists(), f"docs/{name} is missing"
    blocks = doc_runner.parse(page)            # raises on a block it would not run
    n = doc_runner.counts(blocks)
    assert n["python"] + n["bash"] > 0
    since_ns = time.time_ns()
    proc = _run(page, tmp_path)
    out = proc.stdout
    if proc.returncode != 0:
        at = out.find("doc_runner: FAILED")
        report = out[at:] if at >= 0 else "(no failing block reported)"
        pytest.fail(f"docs/{name} failed (exit {proc.returncode})\n{report[-8000:]}\n"
                    f"---- output tail ----\n{out[-3000:]}", pytrace=False)
    summary = (f"ok: {n['python']} python, {n['bash']} bash, {n['file']} file blocks, "
               f"{n['output']} outputs")
    assert summary in out, f"the runner did not run every block of docs/{name}:\n{out[-3000:]}"
    ran = len(re.findall(r"^doc_runner: \S+:\d+ (python|bash|output|python file=\S+) ok ", out,
                         re.M))
    assert ran == n["python"] + n["bash"] + n["file"] + n["output"]
    left = _left_behind(tmp_path, since_ns)
    assert not left, (f"docs/{name}, run from the repository root, leaves files that .gitignore "
                      f"does not ignore (git status shows them; the next page's copy gets "
                      f"them): {left[:20]}; ignore them in .gitignore")


def _left_behind(workdir: Path, since_ns: int) -> list[str]:
    """What a page wrote into its copy of the repository that .gitignore does not ignore, and
    the repository's files it changed (the copy keeps their times: a newer one was written)."""
    copied = set(doc_runner.repository_files())
    new, changed = [], []
    for path in workdir.rglob("*"):
        if not path.is_file() or path.is_symlink():
            continue
        rel = path.relative_to(workdir).as_posix()
        if rel not in copied:
            new.append(rel)
        elif path.stat().st_mtime_ns >= since_ns and not (
                (ROOT / rel).is_file() and path.read_bytes() == (ROOT / rel).read_bytes()):
            changed.append(f"{rel} (changed)")      # written after the copy, other than ours
    return doc_runner.unignored(sorted(new)) + changed


def _savedirs(block: doc_runner.Block) -> list[tuple[int, str | None]]:
    """(page line, gen_savedir) of each parallelize/NnCompileStrategy call in a python block
    that names one; None for a parallelize call that leaves it to its default (./.nncompile).
    A strategy that names none is not counted: building one writes nothing."""
    found = []
    for node in ast.walk(ast.parse(block.code)):
        if not isinstance(node, ast.Call):
            continue
        fn = node.func.attr if isinstance(node.func, ast.Attribute) else \
            getattr(node.func, "id", "")
        if fn not in ("parallelize", "NnCompileStrategy"):
            continue
        kw = {k.arg: k.value for k in node.keywords}
        line = block.line + node.lineno - 1
        if "gen_savedir" in kw:
            value = kw["gen_savedir"]
            found.append((line, value.value if isinstance(value, ast.Constant) else "<computed>"))
        elif None not in kw and fn == "parallelize":     # no **kwargs that could carry it
            found.append((line, None))
    return found


@pytest.mark.parametrize("name", _pages())
def test_page_writes_its_generated_code_to_its_own_directory(name):
    """Pages run one after another in one checkout (docs/README.md) do not reuse each other's
    generated code: each page compiles into gen/<page>/ (or gen/<page>_<what>/); only the
    quickstart's example script writes the default ./.nncompile."""
    stem = name[:-len(".md")]
    own = re.compile(rf"(\./)?gen/{re.escape(stem)}(_\w+)?")
    wrong = [f"docs/{name}:{line}: gen_savedir={d!r}"
             for block in doc_runner.parse(DOCS / name) if block.kind in ("python", "file")
             for line, d in _savedirs(block) if d != "<computed>" and not own.fullmatch(d or "")]
    assert not wrong, f"compile into gen/{stem}/ (gen_savedir=\"gen/{stem}\"): {wrong}"


def test_index_links_every_page_in_order():
    index = (DOCS / "README.md").read_text()
    links = re.findall(r"\]\(([\w.-]+\.md)\)", index)
    assert [p for p in links if p in PAGES] == PAGES, links
    for link in set(links) - {"custom_ops.md"}:
        assert (DOCS / link).exists(), f"docs/README.md links the missing docs/{link}"
    for page in DOCS.glob("*.md"):
        assert page.name == "README.md" or page.name in links, \
            f"docs/{page.name} is not linked from docs/README.md"
        for target in re.findall(r"\]\(([\w.-]+\.md)(?:#[\w-]+)?\)", page.read_text()):
            assert target == "custom_ops.md" or (DOCS / target).exists(), \
                f"docs/{page.name} links the missing docs/{target}"


@pytest.mark.parametrize("text, error", [
    ("```py\nprint(1)\n```\n", "info string 'py'"),
    ("```\nprint(1)\n```\n", "info string ''"),
    ("  ```sh\n  echo hi\n  ```\n", "info string 'sh'"),
    ("```text\nshown\n```\n", "no python or bash block"),
    ("```python\nprint(1)\n", "never closed"),
    ("```python\nx = 1\n```\n\n```bash\necho ok\n```\n\n```python\nassert x == 2, 'x is 1'\n```\n",
     "FAILED page.md:10 (python block)"),
    ("```bash\nfalse\necho unre\"\"achable\n```\n", "FAILED page.md:2 (bash block)"),
    ("```bash\nmkdir -p sub && cd sub\n```\n\n```bash\necho unre\"\"achable\n```\n",
     "the block leaves the shell in"),
    ("```output\nhi\n```\n\n```bash\necho hi\n```\n", "output block must follow"),
    ("```bash\necho hi\n```\n\nSome prose.\n\n```output\nhi\n```\n", "output block must follow"),
    ("```python\nprint('PYTHONPATH' in __import__('os').environ)\n```\n```output\nTrue\n```\n"
     "```bash\necho unre\"\"achable\n```\n", "+False"),
])
def test_runner_refuses_what_it_cannot_run(tmp_path, text, error):
    (tmp_path / "page.md").write_text(text)
    proc = subprocess.run([sys.executable, str(RUNNER), "page.md", "--workdir", "."],
                          cwd=tmp_path, env=_env(), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=60)
    assert proc.returncode == 1 and error in proc.stdout, proc.stdout
    assert "unreachable" not in proc.stdout           # nothing after a failure runs


def test_runner_shares_one_namespace_and_writes_files(tmp_path):
    (tmp_path / "page.md").write_text(
        "```python file=sub/hello.py\nprint('hello from', __file__)\n```\n\n"
        "```bash\npython sub/hello.py > said.txt\ntest -z \"${NNCOMPILE_REPO:-}\"\n"
        "test -f examples/gpt.py\n```\n\n```python\nx = open('said.txt').read()\n```\n\n"
        "```python\nassert x.startswith('hello from'), x\nimport examples.gpt\n"
        "print(examples.gpt.__file__)\n```\n")
    env = {**_env(), "NNCOMPILE_REPO": str(ROOT), "PYTHONPATH": str(ROOT)}   # both removed
    proc = subprocess.run([sys.executable, str(RUNNER), "page.md", "--workdir", "."],
                          cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout
    assert "ok: 2 python, 1 bash, 1 file blocks, 0 outputs" in proc.stdout
    # examples/ is the fresh copy's (the page runs from a copy of the repository root)
    assert f"{tmp_path.resolve()}/examples/gpt.py" in proc.stdout


SHOWN = """```bash
printf 'step 0 loss 2.8192\\nstep 1 loss 2.6474\\ntook 3.2 s\\n'
```

```output
step 0 loss 2.8192
step 1 loss 2.6474
took ... s
```

```python
for step in range(4):
    print(f"step {step}")
print("done in /tmp/x")
```

```output
step 0
...
step 3
done in ...
```
"""


def _run_fake(tmp_path, text: str) -> subprocess.CompletedProcess:
    (tmp_path / "page.md").write_text(text)
    return subprocess.run([sys.executable, str(RUNNER), "page.md", "--workdir", "."],
                          cwd=tmp_path, env=_env(), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=60)


def test_output_blocks_are_compared(tmp_path):
    proc = _run_fake(tmp_path, SHOWN)
    assert proc.returncode == 0, proc.stdout
    assert "ok: 1 python, 1 bash, 0 file blocks, 2 outputs" in proc.stdout


def test_wrong_shown_output_fails_with_a_diff(tmp_path):
    proc = _run_fake(tmp_path, SHOWN.replace("loss 2.6474\ntook", "loss 2.6475\ntook"))
    assert proc.returncode == 1
    out = proc.stdout
    assert "FAILED page.md:6 (output block)" in out, out
    assert "the page shows other output than the block above printed" in out
    assert "-step 1 loss 2.6475" in out and "+step 1 loss 2.6474" in out, out
    assert "took 3.2 s" not in out.split("FAILED")[1]       # a wildcard line is no difference
    assert "done in" not in out.split("FAILED")[1]         # nothing after the failure runs


@pytest.mark.parametrize("shown, printed, ok", [
    ("a\nb\n", "a\nb  \n\n", True),              # trailing spaces and blank lines
    ("a\n...\nd\n", "a\nb\nc\nd\n", True),
    ("a\n...\nd\n", "a\nd\n", True),             # ... may stand for no line
    ("a\n...\n", "a\n", True),
    ("a\n    ...\nd\n", "a\n  b\n  c\nd\n", True),       # indented, too
    ("took ... s\n", "took 1.25 s\n", True),
    ("took ... s\n", "took 1.25 ms\n", False),
    ("loss 2.8192\n", "loss 2.8193\n", False),       # numbers match exactly
    ("a\nb\n", "a\nb\nc\n", False),                # no line left over
    ("a (x)\n", "a (x)\n", True),                     # not a regular expression
])
def test_output_matching_rules(shown, printed, ok):
    assert doc_runner.output_matches(shown, printed) is ok


# The repository's README and the nanoGPT example's: every command block runs as a docs page
# does (python fragments compile and name only what nncompile has, GPU commands run where
# there are GPUs); the set-up and test commands, which the suite cannot run inside itself, are
# what CI runs (tests/test_first_run.py checks them).
READMES = ["README.md", "examples/nanogpt/README.md"]


@pytest.mark.parametrize("name", READMES)
def test_readme_runs(name, tmp_path):
    page = ROOT / name
    blocks = doc_runner.parse(page)
    n = doc_runner.counts(blocks)
    since_ns = time.time_ns()
    proc = _run(page, tmp_path, timeout=1200)
    out = proc.stdout
    if proc.returncode != 0:
        at = out.find("doc_runner: FAILED")
        pytest.fail(f"{name} failed (exit {proc.returncode})\n{out[at:][-8000:]}\n"
                    f"---- output tail ----\n{out[-3000:]}", pytrace=False)
    assert (f"ok: {n['python']} python, {n['bash']} bash, {n['file']} file blocks, "
            f"{n['output']} outputs") in out, out[-3000:]
    compiled = len(re.findall(r"^doc_runner: \S+:\d+ python fragment compiled", out, re.M))
    assert compiled == n["python_fragment"]
    left = _left_behind(tmp_path, since_ns)
    assert not left, f"{name} leaves files that .gitignore does not ignore: {left[:20]}"


def test_fragment_check_names_a_missing_name(tmp_path):
    (tmp_path / "page.md").write_text("```python fragment\npm = nncompile.parallelizee(m)\n```\n\n"
                                      "```bash\necho ok\n```\n")
    proc = subprocess.run([sys.executable, str(RUNNER), "page.md", "--workdir", "."],
                          cwd=tmp_path, env=_env(), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=120)
    assert proc.returncode == 1 and "nncompile.parallelizee, which does not exist" in \
        proc.stdout, proc.stdout
