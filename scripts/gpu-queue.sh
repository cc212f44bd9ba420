#!/usr/bin/env bash
# Run a list of GPU jobs that together (or one alone) outlast one device command (10 minutes),
# in the background of a warm GPU machine, and collect what they wrote a command at a time.
#
#   bash scripts/gpu-queue.sh start JOBS.sh   # starts JOBS.sh in its own session, returns at once
#   bash scripts/gpu-queue.sh wait 580        # waits up to 580 s (or until the jobs end), then
#                                             # packs the jobs' logs and outputs in
#                                             # $OUT/queue/out.tgz (unpack with tar xzf)
#
# JOBS.sh is a bash file run with `job NAME COMMAND...` defined: each job's output goes to
# $QUEUE/out/NAME.log, its start, end and exit status to $QUEUE/progress.log, and a job that
# writes results gives them `--out $QUEUE/out/NAME` (QUEUE=/tmp/gpu-queue). The jobs run one
# after another. Issue the next `wait` as soon as one returns: the machine goes back when no
# command has run for a short while, and the jobs end with it.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export QUEUE=${QUEUE:-/tmp/gpu-queue}
mode=${1:?start JOBS.sh | wait SECONDS}
case "$mode" in
start)
  jobs_file=$(realpath "${2:?the jobs file}")
  rm -rf "$QUEUE" && mkdir -p "$QUEUE/out"
  # shellcheck disable=SC2016  # expanded by the job runner, not here
  runner='
    job() {
      local name=$1; shift
      echo "$(date -u +%T) start $name: $*" >> "$QUEUE/progress.log"
      "$@" > "$QUEUE/out/$name.log" 2>&1
      local rc=$?
      echo "$(date -u +%T) end $name: rc $rc" >> "$QUEUE/progress.log"
    }
    source "$0"
    echo "$(date -u +%T) all jobs ended" >> "$QUEUE/progress.log"
    touch "$QUEUE/done"'
  setsid nohup bash -c "$runner" "$jobs_file" > "$QUEUE/runner.log" 2>&1 < /dev/null &
  echo "gpu-queue: started $jobs_file (progress: $QUEUE/progress.log)"
  ;;
wait)
  end=$((SECONDS + ${2:?seconds}))
  while [ ! -e "$QUEUE/done" ] && [ "$SECONDS" -lt "$end" ]; do
    sleep 5
  done
  if [ -n "${OUT:-}" ]; then  # three files: the device tool brings back at most eight
    mkdir -p "$OUT/queue" && cp "$QUEUE/progress.log" "$QUEUE/runner.log" "$OUT/queue/" 2>/dev/null
    tar czf "$OUT/queue/out.tgz" -C "$QUEUE/out" . 2>/dev/null
  fi
  cat "$QUEUE/progress.log" 2>/dev/null
  if [ -e "$QUEUE/done" ]; then
    echo "gpu-queue: every job ended"
  else
    echo "gpu-queue: still running"
    exit 3
  fi
  ;;
*)
  echo "gpu-queue: start JOBS.sh | wait SECONDS" >&2
  exit 2
  ;;
esac
