#!/usr/bin/env bash
# The GPU-marked test suite run whole, as a GPU point is checked before it is called done:
# in the default order, then shuffled with two seeds (each in its own temporary folder).
# Run on the GPU machine after `source .gpu-setup.sh`; each run is well under 10 minutes.
#
#   bash scripts/gpu-suite.sh order            # in order
#   bash scripts/gpu-suite.sh shuffled 1 2     # shuffled with seeds 1 and 2, one after the other
#   COMMIT=abc1234 bash scripts/gpu-suite.sh order   # logs named by that commit
#
# Logs go to $OUT (else benchmarks/results/gpu-suite/), named by the commit; each opens with
# the versions it ran with (Python, torch, transformers, ...), as README's table states them.
# Each log ends with the 25 slowest tests, to see where the time goes.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out=${OUT:-benchmarks/results/gpu-suite}
mkdir -p "$out"
# a copy of the working tree (the GPU machine's) can carry a .git older than the code: give the
# commit the tree is at as COMMIT=<sha> to name the logs by it
if [ -n "${COMMIT:-}" ]; then
  commit=$COMMIT
else
  commit=$(git rev-parse --short HEAD 2>/dev/null || echo worktree)
  git diff --quiet HEAD 2>/dev/null || commit="$commit-modified"  # $OUT takes letters, digits, ".", "_" and "-"
fi
# the GPU machine reaches no hub: the clients' subprocesses must not wait for one
export HF_HUB_OFFLINE=1
suite=(python3 -m pytest -o addopts="" -m "gpu and not multigpu" -q -p no:cacheprovider --durations=25 tests)
versions() {
  python3 -c "import json; from layerstream.system.versions import versions; print('versions:', json.dumps(versions()))" ||
    echo "versions: unknown (layerstream.system.versions did not import)"
}
mode=${1:-order}
shift || true
status=0
if [ "$mode" = order ]; then
  { versions; "${suite[@]}"; } 2>&1 | tee "$out/$commit-in-order.log"
  status=${PIPESTATUS[0]}
else
  for seed in "${@:-1}"; do
    { versions; "${suite[@]}" --shuffle-seed "$seed" --basetemp "/tmp/gpu-suite-$seed"; } 2>&1 |
      tee "$out/$commit-seed$seed.log"
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
  done
fi
exit "$status"
