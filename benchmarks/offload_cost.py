"""What offload_activations costs per training step: an 8B-shaped (random weights) bf16
and NF4 LoRA step at 8k and 16k tokens, with and without offloading each layer's
checkpointed input, on one streamed model, the two modes alternating round by round.

    python benchmarks/offload_cost.py                      # llama3-8b, bf16 and nf4, 8192 and 16384
    python benchmarks/offload_cost.py --layers 8 --tokens 8192 --quantization nf4

Writes results/offload-cost.json (or $OUT/...): per configuration the median step time
of each mode, every step time, the peak allocated memory of each mode and the ratio
with/without, so the target (at most 1% longer at >= 8k tokens) can be read off.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))


def _arguments(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama3-8b", help="a benchmarks/common.py SHAPES key (default llama3-8b)")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's)")
    parser.add_argument("--quantization", default="none,nf4", help="comma list of none (bf16) and nf4")
    parser.add_argument("--tokens", default="8192,16384", help="comma list of tokens per step (batch 1)")
    parser.add_argument("--rounds", type=int, default=3, help="alternations of the two modes (default 3)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per mode and round (default 3)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per mode first (default 2)")
    parser.add_argument("--lora-rank", type=int, default=32)
    parser.add_argument("--slots", type=int, default=3)
    parser.add_argument("--name", default="offload-cost", help="result file name (default offload-cost)")
    return parser.parse_args(argv)


def _model(shape, layers, quantization, rank):
    import torch
    from peft import LoraConfig, get_peft_model

    from common import build_random, build_random_nf4

    if quantization == "nf4":
        model = build_random_nf4(shape, layers=layers)
    else:
        model = build_random(shape, dtype=torch.bfloat16, layers=layers)
    lora = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear", init_lora_weights=False)
    return get_peft_model(model, lora)


def _step_times(model, optimizer, ids, steps):
    from common import cuda_timer

    times = []
    for _ in range(steps):
        start = cuda_timer()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(cuda_timer() - start)
    return times


def run(args) -> dict:
    import torch

    import layerstream

    from common import median, write_result

    rows = []
    for quantization in args.quantization.split(","):
        model = _model(args.shape, args.layers, quantization, args.lora_rank)
        layerstream.stream_model(model, device="cuda", slots=args.slots, vram_budget=None, backward_slots=0)
        model.to("cuda")
        runtime = layerstream.get_runtime(model)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
        for tokens in (int(t) for t in args.tokens.split(",")):
            ids = torch.randint(3, model.config.vocab_size, (1, tokens), device="cuda")
            times = {False: [], True: []}
            peaks = {False: 0, True: 0}
            host_bytes = 0
            for mode in (False, True):
                runtime.set_offload_activations(mode)
                _step_times(model, optimizer, ids, args.warmup)
            for round_ in range(args.rounds):
                for mode in (False, True) if round_ % 2 == 0 else (True, False):
                    runtime.set_offload_activations(mode)
                    _step_times(model, optimizer, ids, 1)  # the arena of this mode is sized
                    torch.cuda.reset_peak_memory_stats()
                    times[mode] += _step_times(model, optimizer, ids, args.steps)
                    peaks[mode] = max(peaks[mode], torch.cuda.max_memory_allocated())
                    if mode:
                        host_bytes = runtime.offload_policy.offloader.host_bytes
            off, on = median(times[False]), median(times[True])
            row = {
                "shape": args.shape,
                "layers": len(runtime.records),
                "quantization": quantization,
                "tokens": tokens,
                "step_s_without": off,
                "step_s_with": on,
                "ratio": on / off,
                "steps_without": times[False],
                "steps_with": times[True],
                "peak_gib_without": peaks[False] / 2**30,
                "peak_gib_with": peaks[True] / 2**30,
                "activation_host_gib": host_bytes / 2**30,
            }
            print(
                f"{quantization} {tokens} tokens: {off:.3f} s without, {on:.3f} s with offload "
                f"({on / off:.3f}x); peak {row['peak_gib_without']:.2f} -> {row['peak_gib_with']:.2f} GiB",
                flush=True,
            )
            rows.append(row)
        layerstream.unstream_model(model)
        del model, optimizer, runtime
        torch.cuda.empty_cache()
    payload = {"rows": rows, "rounds": args.rounds, "steps": args.steps, "lora_rank": args.lora_rank}
    write_result(args.name, payload)
    return payload


if __name__ == "__main__":
    run(_arguments())
