#!/usr/bin/env bash
# Installs HARTS and its test dependencies into the current Python, keeping any torch
# that is already installed (a CUDA build on a GPU machine stays). Without a torch it
# asks for the CPU build 2.13.0, which the development and CI machines hold on disk; a
# bare `torch` requirement would pull a multi-GB CUDA build instead.
# One line per phase on stdout; pip itself says only warnings and errors (-q, no
# progress bars), which keeps CI logs readable.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PIP=("$PY" -m pip install -q --progress-bar off --disable-pip-version-check)
start=$SECONDS
if "$PY" -c "import torch" >/dev/null 2>&1; then
    echo "bootstrap: keeping torch $("$PY" -c 'import torch; print(torch.__version__)')"
else
    echo "bootstrap: installing torch==2.13.0 (CPU build)..."
    "${PIP[@]}" "torch==2.13.0"
fi
# -e keeps the checkout importable as it changes
echo "bootstrap: installing harts and its test dependencies (pip install -e '.[test]')..."
"${PIP[@]}" -e ".[test]"
echo "bootstrap: done in $((SECONDS - start)) s"
