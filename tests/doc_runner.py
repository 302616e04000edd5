"""Run the code blocks of one documentation page: `python tests/doc_runner.py docs/PAGE.md`.

Blocks, by the info string after the opening fence:

    python            executed in page order, all in one namespace shared by the page
    python file=NAME  written to NAME in the working directory (run it from a later block)
    bash              run with `bash -euo pipefail -c` in the working directory
    output            what the python or bash block just above it prints on standard output;
                      compared line by line with what it printed (see "Shown output" below)
    text              anything else shown to the reader; not run, not compared (not right
                      after a python or bash block, where it would read as its output)
    diff              a change to a file in unified diff format, shown as text (a page
                      that relies on it checks it in a python block)
    python fragment   a piece of a program shown to the reader (it names a `model` or a
                      `loader` the page never builds): compiled, not run, and every
                      `nncompile.<name>` it uses must exist
    bash setup        the repository's own set-up and test commands (a virtual environment,
                      scripts/setup.sh, `python -m pytest`): not run, since the page runs
                      inside the test suite (tests/test_docs.py checks that .ci/run runs
                      them and that the test files they name exist)
    bash gpu          commands that need GPUs: run where CUDA has as many devices as their
                      largest --nproc_per_node, reported as skipped elsewhere

Any other info string (an empty one included) is an error, and so is a page without a python
or bash block, or an output block that does not follow a python or bash block (only blank
lines between): nothing on a page escapes being run.

A page runs the way a person runs it from the repository root in a fresh shell: in a fresh
copy of the repository (its tracked and unignored files; `--workdir DIR` to choose where, and
`--workdir .` from the repository root to run it in the checkout itself, nothing copied), as
the current directory, with nothing added to the environment. PYTHONPATH and NNCOMPILE_REPO
are removed, so a page that needs them has to set them itself. python blocks run as if typed
into `python` started there (the current directory first on sys.path, so `import examples.gpt`
works); bash blocks do not see changes python blocks make to os.environ. A page compiles into
its own `gen/<page>/`, and .gitignore covers everything it writes, so that pages run one after
another in one checkout leave it clean and a copy made later does not carry their files
(tests/test_docs.py checks both).

`torchrun --nproc_per_node=N script args...` in a bash block starts its ranks with torchrun's
environment, forked from a process that imported torch and nncompile once (Launcher below,
tests/rank_launch.py), as the tests' own launches do: an agent and N fresh interpreters per
command were much of a page's time. Any other torchrun option runs the real torchrun, and so
does every command with NNCOMPILE_DOC_TORCHRUN=real.

Shown output: trailing spaces and leading or trailing blank lines are ignored on both sides;
otherwise every line must be equal, with two wildcards for what changes from run to run
(timings, temporary paths): a line that is just `...` (indented or not) stands for any number
of lines (none included), and `...` inside a line for any text on that line. Standard error
(progress lines, warnings) is not compared.

The first failing block stops the page: its page line, its text and the error (for an output
block, a diff of shown against printed lines) are printed and the exit status is 1
(`--keep-going` goes on past output blocks that differ and reports them all; `--printed FILE`
saves what each output block's block printed). On success the last line is
`doc_runner: PAGE: ok: N python, M bash, K file blocks, J outputs (T s)`.
"""
from __future__ import annotations

import argparse
import contextlib
import difflib
import io
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from rank_launch import launch, recv_line

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
FILE_INFO = re.compile(r"^python file=(?P<name>[\w./-]+)$")
BASH_TIMEOUT_S = 300
WILDCARD = "..."
# set by a person's own shell or by the test suite for speed, never relied on by a page
UNSET_ENV = ("PYTHONPATH", "NNCOMPILE_REPO")


class Launcher:
    """The torchrun of a page's bash blocks (tests/shims: `torchrun --nproc_per_node=N
    script args`): its ranks start forked from a process that imported torch and nncompile
    once (rank_launch.py), served here on a Unix socket; other torchrun options run the real
    one. `env` is what the blocks' shell gets to reach it."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="nncompile-doc-")
        path = os.path.join(self.dir, "torchrun.sock")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(path)
        self.sock.listen()
        shims = str(Path(__file__).resolve().parent / "shims")
        self.env = {"NNCOMPILE_DOC_LAUNCHER": path, "NNCOMPILE_DOC_PYTHON": sys.executable,
                    "PATH": shims + os.pathsep + os.environ.get("PATH", "")}
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            conn, _ = self.sock.accept()
            threading.Thread(target=self._launch, args=(conn,), daemon=True).start()

    def _launch(self, conn) -> None:
        with conn:
            data = recv_line(conn)
            if not data.endswith(b"\n"):
                return
            req = json.loads(data)
            try:
                code, out, err = launch(req["script"], req["nproc"], req["args"], req["env"],
                                        req["cwd"], BASH_TIMEOUT_S, split_stderr=True)
            except Exception as e:              # noqa: BLE001 - the block fails with it
                code, out, err = 1, "", f"doc_runner's torchrun: {type(e).__name__}: {e}\n"
            conn.sendall((json.dumps({"code": code, "stdout": out, "stderr": err})
                          + "\n").encode())


class PageError(Exception):
    """The page itself is malformed (unknown info string, unclosed fence, nothing to run)."""


@dataclass
class Block:
    kind: str            # "python", "file", "bash", "output", "text", "python_fragment",
    line: int            # "bash_setup" or "bash_gpu"; the page line of the block's first
    code: str            # code line (1-based)
    name: str | None = None     # file=NAME

    @property
    def label(self) -> str:
        return f"python file={self.name}" if self.kind == "file" else \
            self.kind.replace("_", " ")


def parse(path: str | os.PathLike) -> list[Block]:
    """The page's fenced blocks, in order; PageError on anything that would not be run."""
    lines = Path(path).read_text().splitlines()
    blocks: list[Block] = []
    last_close = -2          # page index of the previous block's closing fence
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, info = m["indent"], m["fence"], m["info"].strip()
        start = i + 1
        j = start
        while j < len(lines):
            close = FENCE.match(lines[j])
            if close and close["fence"][0] == fence[0] and len(close["fence"]) >= len(fence) \
                    and not close["info"].strip():
                break
            j += 1
        else:
            raise PageError(f"{path}:{i + 1}: code fence {fence}{info} is never closed")
        body = [ln[len(indent):] if ln.startswith(indent) else ln.lstrip()
                for ln in lines[start:j]]
        code = "\n".join(body) + "\n"
        file_m = FILE_INFO.match(info)
        if info == "output":
            adjacent = blocks and last_close >= 0 and \
                all(not ln.strip() for ln in lines[last_close + 1:i])
            if not (adjacent and blocks[-1].kind in ("python", "bash")):
                raise PageError(f"{path}:{i + 1}: an output block must follow a python or bash "
                                "block (blank lines only between); use text for other shown text")
            blocks.append(Block("output", start + 1, code))
        elif info == "text" and blocks and blocks[-1].kind in ("python", "bash") and \
                all(not ln.strip() for ln in lines[last_close + 1:i]):
            raise PageError(f"{path}:{i + 1}: a text block right after a {blocks[-1].kind} block "
                            "reads as its output: make it an output block (compared with what "
                            "the block prints), or put prose between")
        elif info in ("python", "bash", "text"):
            blocks.append(Block(info, start + 1, code))
        elif info in ("python fragment", "bash setup", "bash gpu"):
            blocks.append(Block(info.replace(" ", "_"), start + 1, code))
        elif file_m:
            blocks.append(Block("file", start + 1, code, file_m["name"]))
        elif info == "diff":          # a change to a file, shown to the reader: like text
            blocks.append(Block("text", start + 1, code))
        else:
            raise PageError(f"{path}:{i + 1}: code block with info string {info!r}; use python, "
                            "'python file=NAME', bash, output, text or diff (every other block "
                            "would go unchecked)")
        last_close = j
        i = j + 1
    if not any(b.kind in ("python", "bash") for b in blocks):
        raise PageError(f"{path}: no python or bash block to run")
    return blocks


def counts(blocks: list[Block]) -> dict[str, int]:
    return {k: sum(b.kind == k for b in blocks)
            for k in ("python", "bash", "file", "output", "text", "python_fragment",
                      "bash_setup", "bash_gpu")}


def check_fragment(code: str, page: str, line: int) -> None:
    """A `python fragment` block compiles, and each `nncompile.a.b` it names exists (its
    module imported where the name is a submodule)."""
    import ast
    import importlib
    import textwrap
    tree = ast.parse("\n" * (line - 1) + textwrap.dedent(code), filename=page)
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        parts, inner = [], node
        while isinstance(inner, ast.Attribute):
            parts.append(inner.attr)
            inner = inner.value
        if not (isinstance(inner, ast.Name) and inner.id == "nncompile"):
            continue
        obj, path = importlib.import_module("nncompile"), "nncompile"
        for name in reversed(parts):
            path += "." + name
            if not hasattr(obj, name):
                try:
                    obj = importlib.import_module(path)
                    continue
                except ImportError:
                    raise AttributeError(f"{page}:{node.lineno}: the fragment "
                                         f"uses {path}, which does not exist") from None
            obj = getattr(obj, name)


def gpus_needed(code: str) -> int:
    """The largest --nproc_per_node of a `bash gpu` block (1 without torchrun)."""
    return max([int(n) for n in re.findall(r"--nproc_per_node[= ](\d+)", code)] or [1])


def _trim(text: str) -> list[str]:
    lines = [ln.rstrip() for ln in text.splitlines()]
    while lines and not lines[0]:
        lines.pop(0)
    while lines and not lines[-1]:
        lines.pop()
    return lines


def _line_matches(shown: str, printed: str) -> bool:
    if WILDCARD not in shown:
        return shown == printed
    pattern = ".*".join(re.escape(part) for part in shown.split(WILDCARD))
    return re.fullmatch(pattern, printed) is not None


def output_matches(shown: str, printed: str) -> bool:
    """Whether `printed` is what the output block `shown` shows (the rules in the docstring)."""
    want, got = _trim(shown), _trim(printed)
    memo: dict[tuple[int, int], bool] = {}

    def match(i: int, j: int) -> bool:
        if (i, j) not in memo:
            if i == len(want):
                ok = j == len(got)
            elif want[i].strip() == WILDCARD:
                ok = match(i + 1, j) or (j < len(got) and match(i, j + 1))
            else:
                ok = j < len(got) and _line_matches(want[i], got[j]) and match(i + 1, j + 1)
            memo[i, j] = ok
        return memo[i, j]

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 4 * (len(want) + len(got)) + 100))
    return match(0, 0)


def output_diff(shown: str, printed: str, where: str) -> str:
    """A unified diff, shown (the page) against printed, for a failed comparison."""
    want, got = _trim(shown), _trim(printed)
    patterns = [w for w in want if WILDCARD in w and w.strip() != WILDCARD]
    # a printed line that a wildcard line matches is shown as that line: not a difference
    got = [next((w for w in patterns if _line_matches(w, g)), g) for g in got]
    diff = difflib.unified_diff(want, got, f"shown ({where})", "printed", lineterm="", n=2)
    return "\n".join(diff) + f"\n(lines that are just {WILDCARD} stand for any lines, and " \
                             f"{WILDCARD} inside a line for any text)"


class _Tee(io.TextIOBase):
    """Writes through to the real stdout and keeps a copy."""

    def __init__(self, real):
        self.real, self.copy = real, io.StringIO()

    def write(self, s):
        self.copy.write(s)
        return self.real.write(s)

    def flush(self):
        self.real.flush()


def repository_files() -> list[str]:
    """The repository's tracked and unignored files (paths relative to its root): what a
    person's checkout has; what pages leave behind is ignored (.gitignore), so not listed."""
    try:
        listed = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-co", "--exclude-standard",
                                 "-z"], capture_output=True, check=True).stdout
        return [n for n in listed.decode().split("\0") if n]
    except (OSError, subprocess.CalledProcessError):
        return [str(p.relative_to(ROOT)) for p in ROOT.rglob("*")
                if p.is_file() and not {".git", "__pycache__", ".nncompile", "gen"} & set(p.parts)]


def unignored(paths: list[str]) -> list[str]:
    """Those of `paths` (relative to the repository root) that .gitignore does not ignore:
    what `git status` would show as untracked if a page left them in a checkout."""
    if not paths:
        return []
    proc = subprocess.run(["git", "-C", str(ROOT), "check-ignore", "--no-index", "--stdin", "-z"],
                          input="\0".join(paths).encode(), capture_output=True)
    if proc.returncode not in (0, 1):          # 1: none ignored
        raise RuntimeError(f"git check-ignore failed: {proc.stderr.decode()}")
    ignored = set(n for n in proc.stdout.decode().split("\0") if n)
    return [p for p in paths if p not in ignored]


def copy_repository(dest: Path) -> None:
    """The repository's tracked and unignored files, as a person's checkout has them (nothing
    to copy when `dest` is the repository itself: the page then runs in the checkout)."""
    if dest.resolve() == ROOT:
        return
    for name in repository_files():
        src = ROOT / name
        if src.is_file():
            target = dest / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, target)


def _fail(page: str, block: Block, detail: str) -> int:
    print(f"\ndoc_runner: FAILED {page}:{block.line} ({block.label} block)", flush=True)
    print("---- block ----")
    for k, ln in enumerate(block.code.rstrip("\n").splitlines()):
        print(f"{block.line + k:5d}  {ln}")
    print("---- error ----")
    print(detail.rstrip(), flush=True)
    return 1


def run_page(page: str, workdir: Path, keep_going: bool = False,
             printed_json: str | None = None) -> int:
    page_path = Path(page).resolve()
    try:
        blocks = parse(page_path)
    except PageError as e:
        print(f"doc_runner: FAILED {e}", flush=True)
        return 1
    copy_repository(workdir)
    os.chdir(workdir)
    for name in UNSET_ENV:
        os.environ.pop(name, None)
    # like `python` started in the repository root: the current directory first on sys.path
    here = Path(__file__).resolve().parent
    sys.path[:] = [str(workdir)] + [p for p in sys.path
                                    if p and Path(p).resolve() not in (here, ROOT)]
    shell_env = dict(os.environ)    # bash blocks do not see what python blocks set (a terminal would not)
    if any(b.kind == "bash" and "torchrun" in b.code for b in blocks) and \
            os.environ.get("NNCOMPILE_DOC_TORCHRUN") != "real":
        shell_env.update(Launcher().env)
    namespace: dict = {"__name__": "__main__"}
    printed = ""                    # standard output of the last python or bash block
    mismatches = 0                  # output blocks that differ (--keep-going)
    seen: dict[int, str] = {}       # output block line -> what its block printed (--printed)
    start = time.perf_counter()
    for block in blocks:
        t0 = time.perf_counter()
        if block.kind in ("text", "bash_setup"):
            continue
        if block.kind == "python_fragment":
            try:
                check_fragment(block.code, str(page_path), block.line)
            except (SyntaxError, AttributeError):
                return _fail(page, block, traceback.format_exc(limit=0))
            print(f"doc_runner: {page}:{block.line} {block.label} compiled", flush=True)
            continue
        if block.kind == "bash_gpu":
            import torch
            need = gpus_needed(block.code)
            if not torch.cuda.is_available() or torch.cuda.device_count() < need:
                print(f"doc_runner: {page}:{block.line} {block.label} skipped (needs {need} "
                      f"CUDA devices)", flush=True)
                continue
        if block.kind == "output":
            seen[block.line] = printed
            if printed_json:
                Path(printed_json).write_text(json.dumps(seen, indent=1))
            if not output_matches(block.code, printed):
                status = _fail(page, block, "the page shows other output than the block above "
                                            "printed\n" + output_diff(block.code, printed,
                                                                      f"{page}:{block.line}"))
                if not keep_going:
                    return status
                mismatches += 1
                continue
        elif block.kind == "file":
            target = workdir / block.name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(block.code)
        elif block.kind == "python":
            source = "\n" * (block.line - 1) + block.code   # tracebacks name page lines
            tee = _Tee(sys.stdout)
            try:
                with contextlib.redirect_stdout(tee):
                    exec(compile(source, str(page_path), "exec"), namespace)
            except BaseException:                            # noqa: BLE001 - reported
                sys.stdout.flush()
                return _fail(page, block, traceback.format_exc())
            printed = tee.copy.getvalue()
        else:
            ends_in = workdir / ".doc_runner_pwd"      # where a pasted block leaves the shell
            code = f"trap 'pwd > {ends_in}' EXIT\n{block.code}"
            try:
                proc = subprocess.run(["bash", "-euo", "pipefail", "-c", code],
                                      cwd=workdir, env=shell_env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True,
                                      timeout=BASH_TIMEOUT_S)
            except subprocess.TimeoutExpired as e:
                out = e.stdout if isinstance(e.stdout, str) else (e.stdout or b"").decode()
                return _fail(page, block, f"timed out after {BASH_TIMEOUT_S} s\n{out[-6000:]}")
            sys.stdout.write(proc.stdout + proc.stderr)
            if proc.returncode != 0:
                return _fail(page, block, f"exit status {proc.returncode}; output tail:\n"
                                          f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
            printed = proc.stdout
            left_in = ends_in.read_text().strip() if ends_in.exists() else str(workdir)
            ends_in.unlink(missing_ok=True)
            if Path(left_in).resolve() != workdir.resolve():
                return _fail(page, block, f"the block leaves the shell in {left_in}, not where "
                                          "it started: the next block, pasted into the same "
                                          "shell, would run there; cd back, or cd in a "
                                          "subshell ( ... )")
        sys.stdout.flush()
        print(f"doc_runner: {page}:{block.line} {block.label} ok "
              f"({time.perf_counter() - t0:.1f} s)", flush=True)
    n = counts(blocks)
    if mismatches:
        print(f"doc_runner: {page}: {mismatches} of {n['output']} output blocks differ",
              flush=True)
        return 1
    print(f"doc_runner: {page}: ok: {n['python']} python, {n['bash']} bash, {n['file']} file "
          f"blocks, {n['output']} outputs ({time.perf_counter() - start:.1f} s)", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("page", help="a Markdown page, e.g. docs/quickstart.md")
    ap.add_argument("--workdir", help="directory to copy the repository to and run in "
                                      "(default: a fresh temporary one)")
    ap.add_argument("--keep-going", action="store_true",
                    help="report every output block that differs, not only the first (a "
                         "failing python or bash block still stops the page)")
    ap.add_argument("--printed", metavar="FILE",
                    help="write what each output block's python or bash block printed to FILE "
                         "(JSON: page line -> text), to update a page from")
    args = ap.parse_args(argv)
    if args.workdir:
        workdir = Path(args.workdir).resolve()
        workdir.mkdir(parents=True, exist_ok=True)
    else:
        workdir = Path(tempfile.mkdtemp(prefix="nncompile-docs-"))
        print(f"doc_runner: working in {workdir}", flush=True)
    printed = str(Path(args.printed).resolve()) if args.printed else None
    return run_page(args.page, workdir, args.keep_going, printed)


if __name__ == "__main__":
    sys.exit(main())
