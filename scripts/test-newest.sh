#!/usr/bin/env bash
# The CPU test suite on the newest releases of torch, transformers, peft, trl, bitsandbytes,
# accelerate and datasets, in a second venv, ./.venv-newest (PYTHON, NEWEST_VENV to change).
# .ci/run runs it on every submission beside the pinned suite, and its failure fails CI:
# pyproject.toml states lower bounds only, so a user's `pip install` takes these releases.
# Arguments go to pytest, e.g. `bash scripts/test-newest.sh tests/plan/test_plan.py`.
#
# torch: the CPU build from PyTorch's CPU index (TORCH_CPU_INDEX; asked for torch only) where
# that index answers and has the newest release; else PyPI's Linux build of that release, which
# bundles CUDA libraries (about 3 GB to download) and runs on the CPU as well. A machine-wide pip
# constraint that caps torch below its newest release (pip.conf's `constraint`) is lifted for this
# venv only: testing that release is the point.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${NEWEST_VENV:-.venv-newest}
TORCH_CPU_INDEX=${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}
export PIP_CONSTRAINT=/dev/null
[ -x "$VENV/bin/python" ] || "${PYTHON:-python3}" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip "$@"; }
say() { echo "test-newest: $*" >&2; }
editable() {  # `pip install -e .` (and more), one at a time: it writes src/layerstream.egg-info, and
  # .ci/run sets ./.venv up (scripts/setup-env.sh, which takes the same lock) beside this
  if command -v flock >/dev/null; then
    flock pyproject.toml "$VENV/bin/python" -m pip install "$@"
  else
    pip install "$@"
  fi
}

newest() {  # the newest release of $1 on the package index, as `pip index versions` lists it
  pip index versions "$1" 2>/dev/null | sed -n "s/^$1 (\([^)]*\))\$/\1/Ip" | head -n 1
}

names=(torch transformers peft trl bitsandbytes accelerate datasets)
pins=()
for name in "${names[@]}"; do
  version=$(newest "$name")
  [ -n "$version" ] || { say "cannot read $name's versions from the package index"; exit 1; }
  pins+=("$name==$version")
done
say "the newest releases on the index: ${pins[*]}"

# torch alone from the CPU index (fails fast where the index cannot be reached)
pip install -q --retries 0 --timeout 20 --index-url "$TORCH_CPU_INDEX" "${pins[0]}" 2>/dev/null ||
  say "torch: no ${pins[0]} from $TORCH_CPU_INDEX here; PyPI's build (CUDA libraries bundled, run on the CPU)"
# the releases alone first, which writes nothing into this tree: the long part (torch's download)
# then needs no lock (where they do not install together, the next command says so)
pip install -q "${pins[@]}" 2>/dev/null || true
if ! editable -q -e ".[test]" "${pins[@]}"; then
  # the newest releases cannot be installed together (see pip above): test the newest set pip
  # can resolve, and say below which release it is not
  say "the newest releases do not install together; installing the newest set that does"
  editable -q --upgrade --upgrade-strategy eager -e ".[test]" "${pins[0]}" "${names[@]:1}"
fi
"$VENV/bin/python" - "${pins[@]}" <<'PY'
import importlib.metadata as metadata
import sys

wanted = dict(pin.split("==") for pin in sys.argv[1:])
found = {name: metadata.version(name) for name in wanted}
print("test-newest: testing " + ", ".join(f"{name} {version}" for name, version in found.items()), file=sys.stderr)
for name, version in found.items():
    if version.split("+")[0] != wanted[name]:
        print(f"test-newest: NOT the newest {name}: {version} installed, {wanted[name]} on the index", file=sys.stderr)
PY
pip check || say "pip check found conflicts (above); the suite runs regardless"
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider "$@"
