"""Run the code blocks of one documentation page: `python tests/doc_runner.py docs/PAGE.md`.

Blocks, by the info string after the opening fence:

    python            executed in page order, all in one namespace shared by the page
    python file=NAME  written to NAME in the working directory (run it from a later block)
    bash              run with `bash -euo pipefail -c` in the working directory
    text              output shown to the reader; not run

Any other info string (an empty one included) is an error, and so is a page without a python
or bash block: nothing on a page escapes being run. Blocks run in a fresh temporary directory
(`--workdir DIR` to choose one) with NNCOMPILE_REPO set to the repository root, which is also
put on PYTHONPATH (so `examples` is importable); bash blocks get that environment, not changes
python blocks make to os.environ. The first failing block stops the page: its
page line, its text and the error are printed and the exit status is 1. On success the last
line is `doc_runner: PAGE: ok: N python, M bash, K file blocks (T s)`.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
FILE_INFO = re.compile(r"^python file=(?P<name>[\w./-]+)$")
BASH_TIMEOUT_S = 300


class PageError(Exception):
    """The page itself is malformed (unknown info string, unclosed fence, nothing to run)."""


@dataclass
class Block:
    kind: str            # "python", "file", "bash" or "text"
    line: int            # page line of the block's first code line (1-based)
    code: str
    name: str | None = None     # file=NAME

    @property
    def label(self) -> str:
        return f"python file={self.name}" if self.kind == "file" else self.kind


def parse(path: str | os.PathLike) -> list[Block]:
    """The page's fenced blocks, in order; PageError on anything that would not be run."""
    lines = Path(path).read_text().splitlines()
    blocks: list[Block] = []
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
        if info in ("python", "bash", "text"):
            blocks.append(Block(info, start + 1, code))
        elif file_m:
            blocks.append(Block("file", start + 1, code, file_m["name"]))
        else:
            raise PageError(f"{path}:{i + 1}: code block with info string {info!r}; use python, "
                            "'python file=NAME', bash or text (every other block would go "
                            "unchecked)")
        i = j + 1
    if not any(b.kind in ("python", "bash") for b in blocks):
        raise PageError(f"{path}: no python or bash block to run")
    return blocks


def counts(blocks: list[Block]) -> dict[str, int]:
    return {k: sum(b.kind == k for b in blocks) for k in ("python", "bash", "file", "text")}


def _fail(page: str, block: Block, detail: str) -> int:
    print(f"\ndoc_runner: FAILED {page}:{block.line} ({block.label} block)", flush=True)
    print("---- block ----")
    for k, ln in enumerate(block.code.rstrip("\n").splitlines()):
        print(f"{block.line + k:5d}  {ln}")
    print("---- error ----")
    print(detail.rstrip(), flush=True)
    return 1


def run_page(page: str, workdir: Path) -> int:
    page_path = Path(page).resolve()
    try:
        blocks = parse(page_path)
    except PageError as e:
        print(f"doc_runner: FAILED {e}", flush=True)
        return 1
    os.chdir(workdir)
    os.environ["NNCOMPILE_REPO"] = str(ROOT)
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(ROOT) not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + paths)
    sys.path[:0] = [str(workdir), str(ROOT)]
    shell_env = dict(os.environ)    # bash blocks do not see what python blocks set (a terminal would not)
    namespace: dict = {"__name__": "__main__"}
    start = time.perf_counter()
    for block in blocks:
        t0 = time.perf_counter()
        if block.kind == "text":
            continue
        if block.kind == "file":
            target = workdir / block.name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(block.code)
        elif block.kind == "python":
            source = "\n" * (block.line - 1) + block.code   # tracebacks name page lines
            try:
                exec(compile(source, str(page_path), "exec"), namespace)
            except BaseException:                            # noqa: BLE001 - reported
                sys.stdout.flush()
                return _fail(page, block, traceback.format_exc())
        else:
            try:
                proc = subprocess.run(["bash", "-euo", "pipefail", "-c", block.code],
                                      cwd=workdir, env=shell_env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True,
                                      timeout=BASH_TIMEOUT_S)
            except subprocess.TimeoutExpired as e:
                out = e.stdout if isinstance(e.stdout, str) else (e.stdout or b"").decode()
                return _fail(page, block, f"timed out after {BASH_TIMEOUT_S} s\n{out[-6000:]}")
            sys.stdout.write(proc.stdout)
            if proc.returncode != 0:
                return _fail(page, block, f"exit status {proc.returncode}; output tail:\n"
                                          f"{proc.stdout[-6000:]}")
        sys.stdout.flush()
        print(f"doc_runner: {page}:{block.line} {block.label} ok "
              f"({time.perf_counter() - t0:.1f} s)", flush=True)
    n = counts(blocks)
    print(f"doc_runner: {page}: ok: {n['python']} python, {n['bash']} bash, {n['file']} file "
          f"blocks ({time.perf_counter() - start:.1f} s)", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("page", help="a Markdown page, e.g. docs/quickstart.md")
    ap.add_argument("--workdir", help="directory to run in (default: a fresh temporary one)")
    args = ap.parse_args(argv)
    if args.workdir:
        workdir = Path(args.workdir).resolve()
        workdir.mkdir(parents=True, exist_ok=True)
    else:
        workdir = Path(tempfile.mkdtemp(prefix="nncompile-docs-"))
        print(f"doc_runner: working in {workdir}", flush=True)
    return run_page(args.page, workdir)


if __name__ == "__main__":
    sys.exit(main())
