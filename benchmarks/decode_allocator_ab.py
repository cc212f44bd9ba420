"""Decoding in processes of its own: streamed against resident, and under each CUDA allocator setting.

Two questions, one set of runs. In TRL's GRPO and RLOO pairs (``rl.py --part grpo-8b``), each
side in a process of its own, streamed decoding with every layer in the window was about 20%
slower than resident; in ``rl.py --part generate``, where both models decode in one process,
it was within 5%. Both harnesses give both sides the allocator `layerstream run` gives
(expandable segments, ``allocator_defaults``), so that is not what differs between them.
Here decoding runs without TRL, one process per (model, allocator setting): whether the gap
appears between separate processes with nothing but the model differing. And `layerstream run`
turns expandable segments on where the user left the allocator alone, while the plain script
a user compares with runs torch's default: whether that setting alone changes decoding.
Alternated (A B B A ...): an 8B-shaped random NF4 model, resident (bitsandbytes) or streamed
with every layer in the window, LoRA on every linear layer in train mode (as TRL's GRPO
generates with it), greedy batch 8, a KV cache.

    python benchmarks/decode_allocator_ab.py --out $OUT/decode-allocator   # on the GPU
    python benchmarks/decode_allocator_ab.py --as-trl ...  # generating as TRL's GRPO does
    python benchmarks/decode_allocator_ab.py --shape tiny --device cpu ... # the harness only

Writes ``decode-allocator.json``: per process, its setting, model and decode ms a token step
(each call's), and per (model, setting) the median over its processes.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

SETTINGS = {"default": "expandable_segments:False", "expandable": "expandable_segments:True"}
MODELS = ("resident", "streamed")


def child(args) -> dict:
    """One process: build the model, warm up, time ``args.calls`` calls."""
    import torch
    from peft import LoraConfig, get_peft_model

    import layerstream

    from rl import shape_values
    from rl_generate import build, prompts, streamed, timed_call

    shape = shape_values(args.shape)
    settings = argparse.Namespace(prompt_tokens=args.prompt_tokens, slots=3)
    if args.model == "streamed":  # every layer in the window, as rl.py's generate part sets it
        model = streamed(shape, settings, None)
        layerstream.get_runtime(model).set_window(range(model.config.num_hidden_layers))
    else:
        model = build(shape).to(args.device)
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, target_modules="all-linear", task_type="CAUSAL_LM")
    model = get_peft_model(model, lora)
    model.train(True)
    ids = prompts(settings, args.batch, model.config.vocab_size)
    ids = ids.to(args.device)
    call = timed_call
    if args.as_trl:  # checkpointing on for training, off around each generate, under autocast
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        call = functools.partial(as_trl_generates, timed_call, args.device)
    call(model, ids, 8)  # warm-up: kernels chosen, caches allocated
    calls = [call(model, ids, args.new_tokens) for _ in range(args.calls)]
    return {
        "model": args.model,
        "setting": args.setting,
        "as_trl": args.as_trl,
        "allocator_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
        "decode_ms_per_token_step": [call["decode_ms_per_token_step"] for call in calls],
        "tokens": calls[-1]["out"][:, -args.new_tokens :].tolist()[0][:8],
        "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
    }


def as_trl_generates(timed_call, device: str, model, ids, new_tokens: int) -> dict:
    """One call as TRL's GRPO and RLOO make it with transformers' generation: gradient
    checkpointing turned off around it and on again after (``unwrap_model_for_generation``),
    under bf16 autocast (accelerate's mixed-precision wrapper of the model's forward)."""
    import torch

    model.gradient_checkpointing_disable()
    try:
        with torch.autocast(device, dtype=torch.bfloat16):
            return timed_call(model, ids, new_tokens)
    finally:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def order(rounds: int, models=MODELS) -> list:
    """(model, setting) per process, alternated: each model A B B A, rounds times over."""
    runs = []
    for index in range(rounds):
        pair = list(SETTINGS) if index % 2 == 0 else list(reversed(SETTINGS))
        runs += [(model, setting) for setting in pair for model in models]
    return runs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="llama3-8b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--calls", type=int, default=2, help="timed calls in each process, after a warm-up")
    parser.add_argument("--rounds", type=int, default=2, help="A B (then B A) rounds of processes")
    parser.add_argument(
        "--as-trl",
        action="store_true",
        help="generate as TRL's GRPO does: checkpointing toggled around each call, bf16 autocast",
    )
    parser.add_argument("--models", default=",".join(MODELS), help="which of resident,streamed to run")
    parser.add_argument("--deadline", type=float, default=540, help="seconds; no process starts after it")
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results/decode-allocator"))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", choices=MODELS, help=argparse.SUPPRESS)
    parser.add_argument("--setting", choices=tuple(SETTINGS), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(child(args)), flush=True)
        return 0
    start, processes = time.monotonic(), []
    own = list(argv if argv is not None else sys.argv[1:])
    for model, setting in order(args.rounds, args.models.split(",")):
        if time.monotonic() - start > args.deadline:
            print(f"decode-allocator: deadline reached, {model} with {setting} not run", flush=True)
            break
        env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF=SETTINGS[setting])
        command = [sys.executable, __file__, *own, "--child", "--model", model, "--setting", setting]
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        if done.returncode or not lines:
            print(done.stdout[-2000:], done.stderr[-4000:], flush=True)
            processes.append({"model": model, "setting": setting, "failed": done.returncode})
            continue
        record = json.loads(lines[-1][len("RESULT ") :])
        processes.append(record)
        print(f"decode-allocator: {model:9s} {setting:10s} {record['decode_ms_per_token_step']}", flush=True)
    medians = {}
    for model in MODELS:
        for setting in SETTINGS:
            values = [
                v
                for p in processes
                if p.get("model") == model and p.get("setting") == setting and "failed" not in p
                for v in p["decode_ms_per_token_step"]
            ]
            if values:
                medians[f"{model}/{setting}"] = statistics.median(values)
    print("decode-allocator: medians, ms a token step:", json.dumps(medians, indent=1), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tokens = [p["tokens"] for p in processes if "tokens" in p]
    result = {
        "command": "python benchmarks/decode_allocator_ab.py " + " ".join(own),
        "processes": processes,
        "same_tokens": bool(tokens) and all(t == tokens[0] for t in tokens),
    }
    (out / "decode-allocator.json").write_text(json.dumps({**result, "medians_ms": medians}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    raise SystemExit(main())
