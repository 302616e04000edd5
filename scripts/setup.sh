#!/usr/bin/env bash
# One-command set-up: installs torch 2.13.0 (the local CPU build) when torch is absent, then
# nncompile in editable mode with its test dependencies.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
if ! "$PY" -c "import torch" 2>/dev/null; then
    "$PY" -m pip install "torch==2.13.0"
fi
"$PY" -m pip install -e ".[dev]"
