#!/usr/bin/env bash
# Create ./.venv (once) with layerstream and its test dependencies installed.
# Sourced by scripts/demo.sh and scripts/test.sh; safe to run again.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  # a CPU build where one is at hand; a plain 'pip install torch' may pull a multi-GB CUDA build
  .venv/bin/pip install -q "torch==2.13.0" || .venv/bin/pip install -q "torch>=2.11,<2.15"
fi
# one editable install of this tree at a time: it writes src/layerstream.egg-info, and .ci/run
# runs scripts/test-newest.sh's install beside this one (each takes the lock on pyproject.toml)
if command -v flock >/dev/null; then
  flock pyproject.toml .venv/bin/pip install -q -e ".[test]"
else
  .venv/bin/pip install -q -e ".[test]"
fi
