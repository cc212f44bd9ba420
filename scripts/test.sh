#!/usr/bin/env bash
# Set up ./.venv and run the test suite (CPU tests; add -m gpu on a CUDA machine).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-env.sh
exec .venv/bin/python -m pytest -q "$@"
