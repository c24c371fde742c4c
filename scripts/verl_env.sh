#!/usr/bin/env bash
# The verl integration tests in their own environment: verl 0.9.1 pins transformers
# >= 5.5.3, < 5.11, while the main test environment needs transformers >= 5.25 (its float64
# references and TRL's generation on a CPU; pyproject.toml; HARTS itself imports no
# transformers). Builds a virtual environment at
# $VERL_VENV (default .venv-verl), installs the CPU torch 2.13.0 there (as
# scripts/bootstrap.sh does; a bare `torch` requirement would pull a CUDA build), HARTS
# with the `verl` extra and the test runner, and runs the verl tests (tests/integrations:
# test_verl.py and the README section's verl block).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VERL_VENV:-.venv-verl}
start=$SECONDS
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q --progress-bar off --disable-pip-version-check)
if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
    echo "verl_env: installing torch==2.13.0 (CPU build) into $VENV..."
    "${PIP[@]}" "torch==2.13.0"
fi
echo "verl_env: installing harts[verl] and the test runner into $VENV..."
"${PIP[@]}" -e ".[verl]" "pytest>=8" "pytest-xdist>=3.5" "hypothesis>=6.100"
# The Python that called this script, where its transformers has Kimi-Linear (>= 5.11, the
# main test environment's): the verl tests run transformers' own Kimi-Linear there as the
# reference (tests/integrations/kimi_reference.py), since verl's pin has no such class
if python3 -c "import transformers.models.kimi_linear" >/dev/null 2>&1; then
    HARTS_REFERENCE_PYTHON=$(python3 -c "import sys; print(sys.executable)")
    export HARTS_REFERENCE_PYTHON
else
    echo "verl_env: python3 has no transformers with Kimi-Linear: the cross-environment Kimi-Linear test skips"
fi
echo "verl_env: ready in $((SECONDS - start)) s; running the verl tests"
"$VENV/bin/python" -m pytest -q tests/integrations/test_verl.py tests/integrations/test_readme_section.py
