"""Each real recipe in configs/ run at its model's shape with random weights, under its VRAM budget.

For every recipe: the model is built from the recipe's `model.config` (the real
config.json) with random weights (NF4 as bitsandbytes packs it, or bf16), LoRA as the
recipe sets it, streamed with the recipe's slots and prefetch; the recipe's
`stream.vram` is enforced with torch.cuda.set_per_process_memory_fraction. Training
steps of batch x max_length random tokens (AdamW on the adapters) are timed; the first
is a warm-up. Reported per recipe: median step time, peak allocated and reserved VRAM,
and the memory planner's prediction for the same run.

    python benchmarks/recipes.py [--only NAME ...]    # writes $OUT/recipes.json or benchmarks/results/
"""

from __future__ import annotations

import argparse
import gc
import json
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model

import layerstream
from layerstream import plan as planner
from layerstream.commands.train_config import load

from common import build_random, build_random_nf4, cap_gpu, cuda_timer, median, write_result

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
RECIPES = [
    "llama-3.1-8b-qlora-8gb",
    "mistral-7b-lora-8gb",
    "qwen3-14b-qlora-12gb",
    "qwen2.5-32b-lora-24gb",
    "llama-3.1-70b-qlora-24gb",
]


def run_recipe(name: str, steps: int) -> dict:
    config = load(str(CONFIGS / f"{name}.yaml"))
    model_section, lora, stream = config["model"], config["lora"], config["stream"]
    training = config["training"]
    seq, batch = int(training["max_length"]), int(training["per_device_train_batch_size"])
    budget = planner.parse_bytes(stream["vram"])
    shape = json.loads(Path(model_section["config"]).read_text())
    predicted = planner.make_plan(
        planner.PlanRequest(
            planner.load_config(model_section["config"]),
            seq=seq,
            batch=batch,
            vram_bytes=budget,
            quantization=model_section["quantization"],
            dtype=model_section["dtype"],
            lora_rank=lora["r"],
            slots=stream["slots"],
        )
    )
    nf4 = model_section["quantization"] == "nf4"
    model = build_random_nf4(shape) if nf4 else build_random(shape)
    model = get_peft_model(
        model,
        LoraConfig(
            r=lora["r"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"], target_modules=lora["target_modules"]
        ),
    )
    layerstream.stream_model(model, slots=stream["slots"], prefetch=stream["prefetch"], vram_budget=None)
    cap_gpu(budget)
    model.cuda()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    ids = torch.randint(0, shape["vocab_size"], (batch, seq), device="cuda")
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps + 1):
        start = cuda_timer()
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(cuda_timer() - start)
    stats = layerstream.get_runtime(model).stats()
    row = {
        "recipe": name,
        "model": model_section["name"],
        "quantization": model_section["quantization"],
        "seq": seq,
        "batch": batch,
        "slots": stream["slots"],
        "prefetch": stream["prefetch"],
        "vram_budget_gib": budget / 2**30,
        "step_s": median(times[1:]),
        "times": times,
        "tokens_per_s": batch * seq / median(times[1:]),
        "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
        "planned_peak_gib": predicted.peak_vram_bytes / 2**30,
        "planned_copy_s": predicted.copy_seconds_per_step,
        "host_store_gib": stats["host_bytes"] / 2**30,
        "h2d_gbps": stats["h2d_gbps"],
        "pinned": stats["pinned"],
    }
    del optimizer, model
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(1.0)
    return row


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", nargs="*", default=RECIPES)
    parser.add_argument("--steps", type=int, default=4, help="timed steps after one warm-up")
    args = parser.parse_args()
    result = {"steps": args.steps, "rows": []}
    for name in args.only:
        row = run_recipe(name, args.steps)
        print({k: v for k, v in row.items() if k != "times"}, flush=True)
        result["rows"].append(row)
        write_result("recipes", result)  # after each recipe: a run cut short keeps what it measured
    print("| recipe | budget GiB | peak allocated GiB | planned peak GiB | step s | tokens/s |")
    print("|---|---|---|---|---|---|")
    for r in result["rows"]:
        print(
            f"| {r['recipe']} | {r['vram_budget_gib']:.0f} | {r['peak_allocated_gib']:.2f} | "
            f"{r['planned_peak_gib']:.2f} | {r['step_s']:.3f} | {r['tokens_per_s']:.0f} |"
        )


if __name__ == "__main__":
    main()
