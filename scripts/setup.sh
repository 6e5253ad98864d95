#!/usr/bin/env bash
# Set up stitchflow on a fresh machine: a virtual environment in .venv with the CPU build of
# torch 2.13 (pip finds it on this machine's disk), triton 3.6 (its CPU interpreter runs our
# kernels in tests) and the package itself with its test dependencies. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
stamp=.venv/.stitchflow-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v WARNING || true
  # torch pinned exactly: a looser pin would pull a multi-GB CUDA build
  .venv/bin/python -m pip install -q "torch==2.13.0" "triton==3.6.0" "numpy<2.3" 2>&1 | grep -v WARNING || true
  .venv/bin/python -m pip install -q -e ".[test]" 2>&1 | grep -v WARNING || true
  .venv/bin/python -c "import torch, triton, stitchflow" 
  touch "$stamp"
fi
