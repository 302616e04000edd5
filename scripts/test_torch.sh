#!/usr/bin/env bash
# Run the test suite (or part of it) on another torch release, in a virtual environment of its
# own, with CUDA hidden. See docs/versions.md.
#
#   scripts/test_torch.sh 2.11.0                                   # the whole suite
#   scripts/test_torch.sh 2.11.0 'transformers==5.17.*' -- tests/test_dropout.py -x
#   scripts/test_torch.sh 2.15.0 -- tests/test_compat.py tests/test_verify.py
#
# The environment is made once per (torch, transformers) pair under
# ${NNCOMPILE_VENVS:-~/.cache/nncompile/venvs} and reused; this checkout is installed into it
# editable (pip install -e .[dev]), so the code tested is always the checkout's.
# torch comes from the package index pip is configured with: the CPU build where the index
# has one (PIP_INDEX_URL / --index-url https://download.pytorch.org/whl/cpu), else the default
# build, which runs on CPU too. A pip constraint file that caps torch is ignored here.
set -euo pipefail

usage() {
    echo "usage: $0 TORCH_VERSION [TRANSFORMERS_SPEC] [-- PYTEST_ARGS...]" >&2
    exit 2
}
[ $# -ge 1 ] || usage
case "$1" in -h|--help) usage ;; esac
TORCH="$1"; shift
TRANSFORMERS="transformers"
if [ $# -ge 1 ] && [ "$1" != "--" ]; then TRANSFORMERS="$1"; shift; fi
if [ $# -ge 1 ]; then
    [ "$1" = "--" ] || usage
    shift
fi

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
CACHE="${NNCOMPILE_VENVS:-$HOME/.cache/nncompile/venvs}"
TAG="torch-${TORCH}_$(echo "$TRANSFORMERS" | tr -c 'A-Za-z0-9.\n' '_')"
VENV="$CACHE/$TAG"

if [ ! -x "$VENV/bin/python" ] || [ ! -f "$VENV/.nncompile-ready" ]; then
    echo "== making $VENV (torch==$TORCH, $TRANSFORMERS): a few GB on the first run" >&2
    mkdir -p "$CACHE"
    rm -rf "$VENV"
    "$PYTHON" -m venv "$VENV"
    # an empty constraint file of its own: a site constraint file capping torch (pip's
    # `constraint` setting) must not pin this release; the index settings stay
    : > "$VENV/constraints.txt"
    export PIP_CONSTRAINT="$VENV/constraints.txt"
    "$VENV/bin/pip" install --quiet "torch==$TORCH" "$TRANSFORMERS"
    "$VENV/bin/pip" install --quiet -e "$ROOT[dev]" "torch==$TORCH" "$TRANSFORMERS"
    unset PIP_CONSTRAINT
    touch "$VENV/.nncompile-ready"
fi

cd "$ROOT"
"$VENV/bin/python" -c "import torch, transformers; \
print(f'== torch {torch.__version__}, transformers {transformers.__version__}')"
# CUDA hidden: the multi-rank tests run on gloo; one thread per process on a shared machine
export CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES-}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec "$VENV/bin/python" -m pytest "$@"
