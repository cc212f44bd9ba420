"""What streaming adds to the host's work per decoding token step, with no layer to copy
(or, with ``--window N``, with all but N layers copied in each token step).

Decoding a batch of 8 is bound by the host (Python, torch's dispatcher, kernel launches), so a
streamed model with every layer in its resident window decodes as fast as the resident one
only if the runtime's own work per layer visit is small next to the layer's. This builds one
random model twice from one seed, keeps one resident and streams the other with every layer
set in the window, adds LoRA on every linear layer to both (as TRL's scripts do, after
streaming, as ``layerstream run`` does) in train mode, and times greedy ``generate`` calls of
both, alternated in rounds in one process: a token step is (call of N+1 tokens - call of 1
token) / N. Python's profiler over one more call of each counts the Python-level calls.

    python benchmarks/decode_host_cost.py --out benchmarks/results/decode-host-cost/cpu.json
    python benchmarks/decode_host_cost.py --nf4 ...   # bitsandbytes NF4 layers, as --load_in_4bit
    python benchmarks/decode_host_cost.py --device cuda --layers 32 --hidden 4096 ...   # on a GPU

Both models compute the same tokens (checked each round), so the difference is host work.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import time
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM

import layerstream


def shape(args) -> dict:
    heads = max(4, args.hidden // 128)  # 8B's head width at 8B's hidden size
    return dict(
        model_type="llama",
        vocab_size=96,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_attention_heads=heads,
        num_key_value_heads=max(2, heads // 4),
        head_dim=args.hidden // heads,
        num_hidden_layers=args.layers,
        max_position_embeddings=256,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )


def build(args, streamed: bool):
    torch.manual_seed(0)
    if args.nf4:  # bitsandbytes' NF4 layers as BitsAndBytesConfig loads them, the same bytes twice
        from common import build_random_nf4

        model = build_random_nf4(shape(args))
        model.config.use_cache = True
        model.requires_grad_(False)
        if not streamed:
            model = model.to(args.device)
    else:
        values = shape(args)
        config = AutoConfig.for_model(values.pop("model_type"), **values, use_cache=True)
        model = AutoModelForCausalLM.from_config(config).to(args.device)
    if streamed:
        layerstream.stream_model(model, slots=3, vram_budget=None, device=args.device)
        window = args.layers if args.window is None else args.window
        layerstream.get_runtime(model).set_window(range(window))
        model = model.to(args.device)  # the resident part
    if args.lora:
        lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, target_modules="all-linear", task_type="CAUSAL_LM")
        model = get_peft_model(model, lora)
    model.train(args.train)
    return model


def call(model, ids, new_tokens: int):
    if ids.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=0,
    )
    if ids.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, out


def token_step_ms(model, ids, new_tokens: int):
    full, out = call(model, ids, new_tokens + 1)
    prefill, _ = call(model, ids, 1)
    return (full - prefill) / new_tokens * 1e3, out


def python_calls(model, ids, new_tokens: int) -> int:
    profile = cProfile.Profile()
    profile.enable()
    call(model, ids, new_tokens + 1)
    profile.disable()
    return sum(entry[1] for entry in pstats.Stats(profile).stats.values())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--window", type=int, default=None, help="layers kept resident (default: all); the rest are copied in each step"
    )
    parser.add_argument("--nf4", action="store_true", help="bitsandbytes NF4 layers (as --load_in_4bit loads them)")
    parser.add_argument("--no-lora", dest="lora", action="store_false")
    parser.add_argument("--eval", dest="train", action="store_false", help="eval mode (default: train, as TRL)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.window is not None and not 0 <= args.window <= args.layers:
        parser.error(f"--window {args.window}: give 0 to {args.layers} layers (--layers)")
    if args.device == "cpu":
        torch.set_num_threads(1)  # one thread: the host's own work, not how it spreads
    models = {"resident": build(args, False), "streamed": build(args, True)}
    ids = torch.randint(3, 90, (args.batch, 16), generator=torch.Generator().manual_seed(1)).to(args.device)
    for model in models.values():
        call(model, ids, 4)  # warm up
    steps = {name: [] for name in models}
    same = True
    for _ in range(args.rounds):
        outs = {}
        for name, model in models.items():
            ms, outs[name] = token_step_ms(model, ids, args.new_tokens)
            steps[name].append(ms)
        same = same and torch.equal(outs["resident"], outs["streamed"])
    runtime = layerstream.get_runtime(models["streamed"])
    loads_before = runtime.stats()["layer_loads"]
    calls = {name: python_calls(model, ids, args.new_tokens) for name, model in models.items()}
    loads_per_call = runtime.stats()["layer_loads"] - loads_before
    medians = {name: statistics.median(values) for name, values in steps.items()}
    visits = (args.new_tokens + 1) * args.layers
    result = {
        "settings": vars(args),
        "torch": torch.__version__,
        "same_tokens": same,
        "token_step_ms": steps,
        "median_token_step_ms": medians,
        "streamed_over_resident": medians["streamed"] / medians["resident"],
        "python_calls_per_call": calls,
        "extra_python_calls_per_layer_visit": (calls["streamed"] - calls["resident"]) / visits,
        "layer_loads_per_call": loads_per_call,  # layers copied in during the profiled call
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
