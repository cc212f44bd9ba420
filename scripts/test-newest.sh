#!/usr/bin/env bash
# The CPU test suite on the newest release of torch, transformers, peft, trl, bitsandbytes,
# accelerate and datasets, in ./.venv-newest (PYTHON, NEWEST_VENV to change). pyproject.toml
# states lower bounds only; this is how a release above them is tried before users meet it.
# When it runs: before each release and after a release of one of those libraries, by hand;
# .ci/run runs it after the pinned suite when LAYERSTREAM_TEST_NEWEST=1 is set. Arguments go
# to pytest, e.g. `bash scripts/test-newest.sh tests/plan/test_plan.py`.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${NEWEST_VENV:-.venv-newest}
[ -x "$VENV/bin/python" ] || "${PYTHON:-python3}" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip "$@"; }

newest() {  # the newest version of $1 on the package index, as `pip index versions` lists it
  pip index versions "$1" 2>/dev/null | sed -n "s/^$1 (\([^)]*\))\$/\1/Ip" | head -n 1
}

torch_newest=$(newest torch)
[ -n "$torch_newest" ] || { echo "test-newest: cannot read torch's versions from the package index" >&2; exit 1; }
# a CPU build where the index has one (PyPI's Linux wheels bundle the CUDA libraries, several GB;
# they run on the CPU too)
if ! pip install -q "torch==${torch_newest}+cpu" 2>/dev/null && ! pip install -q "torch==${torch_newest}"; then
  echo "test-newest: torch ${torch_newest}, the newest on the index, does not install here (see pip above);" \
    "testing the newest this machine's pip allows" >&2
  pip install -q --upgrade torch
fi
pip install -q -e ".[test]"
pins=()
for name in transformers peft trl bitsandbytes accelerate datasets; do
  version=$(newest "$name")
  [ -n "$version" ] || { echo "test-newest: cannot read $name's versions from the package index" >&2; exit 1; }
  pins+=("$name==$version")
done
pip install -q --upgrade "${pins[@]}"
"$VENV/bin/python" - "$torch_newest" <<'PY'
import importlib.metadata as metadata
import sys

names = ("torch", "transformers", "peft", "trl", "bitsandbytes", "accelerate", "datasets")
print("test-newest: testing " + ", ".join(f"{name} {metadata.version(name)}" for name in names))
if not metadata.version("torch").startswith(sys.argv[1]):
    print(f"test-newest: NOT the newest torch ({sys.argv[1]} is on the index)")
PY
pip check || echo "test-newest: pip check found conflicts (above); the suite runs regardless"
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider "$@"
