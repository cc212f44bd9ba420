#!/usr/bin/env bash
# The GPU-marked test suite run whole, as a GPU point is checked before it is called done:
# in the default order, then shuffled with two seeds (each in its own temporary folder).
# Run on the GPU machine after `source .gpu-setup.sh`; each run is well under 10 minutes.
#
#   bash scripts/gpu-suite.sh order            # in order
#   bash scripts/gpu-suite.sh shuffled 1 2     # shuffled with seeds 1 and 2, one after the other
#   bash scripts/gpu-suite.sh all              # in order and seeds 1 and 2, side by side (about
#                                              # the time of one run on a 16-core GPU machine)
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
if [ "$mode" = all ]; then
  # each run in its own shared-memory folder (the shared host store's segments) and its own
  # temporary folder; waited for with `wait` (a `pgrep -f gpu-suite.sh` loop matches the
  # command line that started this script, and never ends)
  pids=()
  for run in order "shuffled 1" "shuffled 2"; do
    shm=$(mktemp -d /dev/shm/gpu-suite-shm.XXXXXX)
    # shellcheck disable=SC2086  # "shuffled 1" is two arguments
    LAYERSTREAM_SHM_DIR=$shm bash "${BASH_SOURCE[0]}" $run > /dev/null 2>&1 &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do
    wait "$pid" || status=1
  done
  for run in in-order seed1 seed2; do
    tail -n 1 "$out/$commit-$run.log"
  done
  exit "$status"
fi
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
