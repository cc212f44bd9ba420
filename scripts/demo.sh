#!/usr/bin/env bash
# Set up ./.venv and run the embedded demo: a tiny model LoRA-trained while streamed.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-env.sh
exec .venv/bin/layerstream demo "$@"
