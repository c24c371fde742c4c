#!/usr/bin/env bash
# Installs HARTS and its test dependencies into the current Python, keeping any torch
# that is already installed (a CUDA build on a GPU machine stays). Without a torch it
# asks for the CPU build 2.13.0, which the development and CI machines hold on disk; a
# bare `torch` requirement would pull a multi-GB CUDA build instead.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    "$PY" -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
fi
# -e keeps the checkout importable as it changes; --quiet keeps CI logs readable.
"$PY" -m pip install --quiet --disable-pip-version-check -e ".[test]"
