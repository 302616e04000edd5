"""Progress lines on stderr, `[nncompile] ...`; NNCOMPILE_QUIET=1 silences them."""
from __future__ import annotations

import os
import sys


def log(msg: str) -> None:
    if os.environ.get("NNCOMPILE_QUIET") != "1":
        print(f"[nncompile] {msg}", file=sys.stderr, flush=True)
