"""Everything fits: a streamed model whose resident window holds every layer against the
same model resident, in one process (no Trainer), alternating, medians of timed steps.

    python benchmarks/window_all_ab.py --shape llama3.2-3b --batch 4 --seq 256 --out $OUT

The zero-edit pair of TRL's sft on the 3B shape (everything fits, every layer in the
window) ran at 0.77x of the plain script; this separates the engine from the Trainer
path. Run it once as is and once with ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``
(what ``layerstream run`` sets and the plain script did not have).
"""

import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import layerstream  # noqa: E402
from layerstream.system.versions import versions  # noqa: E402

import checkpoints  # noqa: E402,F401  (adds the 3B shape to common.SHAPES)
from common import build_random  # noqa: E402


def steps(model, ids, count):
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    times = []
    for _ in range(count):
        torch.cuda.synchronize()
        start = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="llama3.2-3b")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=str(HERE / "results"))
    args = parser.parse_args()
    lora = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear")
    base = build_random(args.shape)
    resident = get_peft_model(copy.deepcopy(base), lora).cuda()
    resident.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    resident.enable_input_require_grads()
    streamed = get_peft_model(base, lora)
    layerstream.stream_model(streamed, vram_budget=None)
    streamed.cuda()
    runtime = layerstream.get_runtime(streamed)
    runtime.set_window(range(len(runtime.records)))
    ids = torch.randint(0, base.config.vocab_size, (args.batch, args.seq), device="cuda")
    rows = {"resident": [], "streamed": []}
    for _ in range(args.rounds):
        for name, model in (("resident", resident), ("streamed", streamed)):
            rows[name] += steps(model, ids, args.steps)[1:]
    result = {k: statistics.median(v) for k, v in rows.items()}
    result["streamed_vs_resident"] = result["resident"] / result["streamed"]
    result.update(vars(args))
    result["allocator"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
    print(json.dumps(result))
    import cProfile
    import pstats

    for name, model in (("resident", resident), ("streamed", streamed)):
        profile = cProfile.Profile()
        profile.enable()
        steps(model, ids, 2)
        profile.disable()
        print(f"== host time of two {name} steps")
        pstats.Stats(profile).sort_stats("tottime").print_stats(14)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"window-all-{args.shape}-{'expandable' if result['allocator'] else 'default'}.json").write_text(
        json.dumps({**result, "times": rows, "versions": versions()}, indent=1)
    )


if __name__ == "__main__":
    main()
