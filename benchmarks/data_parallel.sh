#!/usr/bin/env bash
# Data parallel on two GPUs: the example Trainer script, unchanged, under `layerstream run`,
# once in one process at batch 8 (one GPU visible) and once under
# `accelerate launch --num_processes 2` at batch 4 per GPU; then the losses side by side.
#   bash benchmarks/data_parallel.sh        # writes under $OUT or benchmarks/results/data-parallel
set -euo pipefail
out=${OUT:-benchmarks/results}/data-parallel
common=(--max_steps 8 --logging_steps 1 --report_to none --save_strategy no --seed 0 --learning_rate 1e-3)
CUDA_VISIBLE_DEVICES=0 python3 -m layerstream.commands.cli run --slots 2 examples/train_trainer.py \
  --output_dir "$out/one-process" --per_device_train_batch_size 8 "${common[@]}"
python3 -m accelerate.commands.launch --num_processes 2 --multi_gpu --num_machines 1 --mixed_precision no \
  --dynamo_backend no -m layerstream.commands.cli run --slots 2 examples/train_trainer.py \
  --output_dir "$out/two-processes" --per_device_train_batch_size 4 "${common[@]}"
python3 - "$out" <<'PY'
import json, sys
out = sys.argv[1]
def history(name):
    return json.load(open(f"{out}/{name}/trainer_state.json"))["log_history"]
one, two = history("one-process"), history("two-processes")
losses = lambda h: [e["loss"] for e in h if "loss" in e]
rows = list(zip(losses(one), losses(two)))
worst = max(abs(a - b) / abs(a) for a, b in rows)
summary = {"steps": len(rows), "one_process": losses(one), "two_processes": losses(two),
           "max_relative_difference": worst,
           "stats_logged": all("layerstream/layer_loads" in e for e in two if "loss" in e)}
print(json.dumps(summary, indent=1))
json.dump(summary, open(f"{out}/summary.json", "w"), indent=1)
PY
