# The GPU measurements the open issues still wait on, as a job list for scripts/gpu-queue.sh
# (kept in the tree: a job list kept only on one checkout is lost with it). On the GPU machine:
#
#   source .gpu-setup.sh; bash scripts/gpu-queue.sh start benchmarks/pending-gpu-jobs.sh
#   bash scripts/gpu-queue.sh wait 540     # again at once after each return, until all ended
#
# COMMIT=<sha> names the suite's logs (the machine's copy of the tree may carry an older .git);
# SUITE=1 runs the GPU suite first (in order and shuffled), for code it has not run on: the
# last whole run is LOG.md's newest "GPU suite at" entry. Jobs run one after another, the most
# needed first; each writes under $QUEUE/out/NAME, which the `wait` commands pack in
# $OUT/queue/out.tgz. Edit it as measurements land (LOG.md says what ran).
export HF_HUB_OFFLINE=1
gib=$(python3 -c "import torch; print(int(torch.cuda.get_device_properties(0).total_memory / 2**30))")
echo "$(date -u +%T) GPU memory ${gib} GiB" >> "$QUEUE/progress.log"
if [ "$gib" -gt 100 ]; then cap=80; else cap=79; fi  # an H100's whole memory is 79.6 GiB
suite_beside() {  # the GPU suite, in order and shuffled, beside a job that writes checkpoints
  "$@" > "$QUEUE/out/prepare-beside-suite.log" 2>&1 &
  COMMIT=${COMMIT:-worktree} OMP_NUM_THREADS=5 OUT=$QUEUE/out/suite bash scripts/gpu-suite.sh all
  wait
}
prepare() {  # the checkpoint and data of the long rows, beside the suite where SUITE=1
  if [ "${SUITE:-0}" = 1 ]; then
    suite_beside "$@"
  else
    "$@"
  fi
}
# the timeline's mark events recorded once each (new since the last GPU run; seconds)
job timeline python3 -m pytest -o addopts="" -m gpu -q -p no:cacheprovider tests/tiers/test_cuda_copies.py -k timeline
# the checkpoint and the longest length's data (each job writes its own shorter data, seconds)
job prepare prepare python3 benchmarks/long_context_client.py --client trainer \
  --cells "$cap:400000,$cap:217088,12:45056,16:67584,24:133120" --prepare-only --work /tmp/lcc
# (an H200 only) the Trainer script's 24 GiB pair, none yet: nine minutes of device time
if [ "$gib" -gt 100 ]; then
  job trainer24 python3 benchmarks/long_context_client.py --client trainer --cells 24:133120 --baseline \
    --same-loss-baseline --merge benchmarks/results/long-context/long-context-client.json --work /tmp/lcc \
    --deadline 560 --out "$QUEUE/out/trainer24"
fi
# TRL's GRPO (QLoRA, 12 GiB) streamed against resident, each run's second step's generation
# traced for 16 token steps (decode_trace.py: kernels, host time and waits per token step):
# inside TRL the streamed side decoded 5-36% slower than resident, outside TRL at par; then the
# same pair with the streamed side uncapped, to tell the cap's share (four steps, as round 1 of
# the QLoRA pair on an H100: a round of about eight minutes with the traces)
job grpo-trace python3 benchmarks/rl.py --part grpo-8b --round 3 --grpo-steps 4 --work /tmp/rl \
  --trace-decode "$QUEUE/out/grpo-trace/traces" --deadline 560 --out "$QUEUE/out/grpo-trace"
# the streamed side's own host work per token step on the GPU, both models in one process
# (NF4 as --load_in_4bit loads it, LoRA in train mode, batch 8, every layer in the window; a
# minute): on the CPU 1.024x resident (decode-host-cost/cpu-nf4-lora-train.json)
job hostcost python3 benchmarks/decode_host_cost.py --device cuda --nf4 --layers 32 --hidden 4096 \
  --out "$QUEUE/out/hostcost/decode-host-cost.json"
job grpo-whole python3 benchmarks/rl.py --part grpo-8b --round 1 --grpo-cap whole --grpo-steps 4 --work /tmp/rl \
  --trace-decode "$QUEUE/out/grpo-whole/traces" --deadline 560 --out "$QUEUE/out/grpo-whole"
# the GPU suite whole, in order and shuffled (seeds 1 and 2), for the code since its last run
job suite env COMMIT="${COMMIT:-worktree}" OMP_NUM_THREADS=5 OUT="$QUEUE/out/suite" bash scripts/gpu-suite.sh all
# generation under 8 GiB against the same command's resident rounds with the whole GPU: the
# capped rows' bound is the slower of the resident token step and the copies (fraction_of_bound)
job generate python3 benchmarks/rl.py --part generate --caps 8GiB --rounds 3 --work /tmp/rl --deadline 560 \
  --out "$QUEUE/out/generate"
# the decode gap of TRL's GRPO/RLOO pairs, with TRL's generation conditions and no TRL (five of
# eight processes ran in the fortieth session; more rounds settle the processes' spread)
job decode python3 benchmarks/decode_allocator_ab.py --as-trl --rounds 2 --calls 2 --deadline 420 \
  --out "$QUEUE/out/decode"
# the 80 GB rows of the other two clients (TRL's sft.py trained 400,000 under 79 GiB on an H100):
# `layerstream train`'s long recipe at 400,000; the Trainer script near the longest a 125 GiB
# host holds its offloaded float32 residual stream: 230,740 by the plan
# (long-context/plan-trainer-script-79gib-host-125gib.txt); at 217,088 the plan needs 110.36 GiB
# of host RAM (plan-trainer-script-79gib-217088.txt), 2 GiB under what may be page-locked
job "train$cap" python3 benchmarks/long_context_client.py --client train --cells "$cap:400000" --warmup 0 \
  --steps 1 --work /tmp/lcc --deadline 840 --out "$QUEUE/out/train$cap"
job "trainer$cap" python3 benchmarks/long_context_client.py --client trainer --cells "$cap:217088" \
  --warmup 0 --steps 1 --work /tmp/lcc --deadline 600 --out "$QUEUE/out/trainer$cap"
