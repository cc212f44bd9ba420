"""The embedded demo: LoRA-train a tiny streamed model on the shipped instruction data.

Needs no download: the model is the embedded tiny one (``embedded``: built from a config
with random weights, a byte-level tokenizer made in code), and the data ships inside the
package. On a machine
without CUDA it streams with host-to-host copies (device "cpu"), which runs the same
machinery, and finishes in well under two minutes.

    python -m layerstream.commands.demo [--steps 60] [--device cpu|cuda] [--slots 2 --prefetch 1]
"""

from __future__ import annotations

import argparse
import json
import logging
import time
import warnings
from typing import List

import torch

from .. import data as embedded

TOKENIZER = embedded.byte_tokenizer()
PAD, BOS, EOS = TOKENIZER.pad_token_id, TOKENIZER.bos_token_id, TOKENIZER.eos_token_id


def load_examples() -> List[dict]:
    return [json.loads(line) for line in embedded.data_path().read_text().splitlines() if line.strip()]


def encode(text: str) -> List[int]:
    return TOKENIZER(text, add_special_tokens=False).input_ids


def decode(ids) -> str:
    return TOKENIZER.decode(ids, skip_special_tokens=True)


def prompt_of(example: dict) -> str:
    return f"Q: {example['instruction']}\nA: "


def batches(examples, batch_size: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    while True:
        order = torch.randperm(len(examples), generator=gen).tolist()
        for start in range(0, len(order) - batch_size + 1, batch_size):
            rows = [
                [BOS] + encode(prompt_of(examples[i]) + examples[i]["response"]) + [EOS]
                for i in order[start : start + batch_size]
            ]
            width = max(len(r) for r in rows)
            ids = torch.full((len(rows), width), PAD)
            labels = torch.full((len(rows), width), -100)
            mask = torch.zeros((len(rows), width), dtype=torch.long)
            for row, tokens in enumerate(rows):
                ids[row, : len(tokens)] = torch.tensor(tokens)
                labels[row, : len(tokens)] = torch.tensor(tokens)
                mask[row, : len(tokens)] = 1
            yield ids, labels, mask


def build_model(layers: int = 6):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(embedded.tiny_config(TOKENIZER, layers, 128))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--prefetch", type=int, default=1)
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    # upstream deprecation noise (peft calls a renamed transformers helper)
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
    for noisy in ("transformers", "bitsandbytes", "peft"):
        logging.getLogger(noisy).setLevel(logging.ERROR)

    from peft import LoraConfig, get_peft_model

    import layerstream

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    from ..system.versions import versions

    print(f"layerstream demo on {device}: " + ", ".join(f"{k} {v}" for k, v in versions().items()), flush=True)
    examples = load_examples()
    model = get_peft_model(
        build_model(args.layers),
        LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", modules_to_save=["lm_head"]),
    )
    layerstream.stream_model(model, slots=args.slots, prefetch=args.prefetch, device=device)
    model.to(device)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    data = batches(examples, args.batch_size)
    model.train()
    losses = []
    started = time.perf_counter()
    for step in range(1, args.steps + 1):
        ids, labels, mask = (t.to(device) for t in next(data))
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if step == 1 or step % 10 == 0 or step == args.steps:
            print(f"step {step:4d}  loss {loss.item():.3f}", flush=True)
    elapsed = time.perf_counter() - started
    stats = layerstream.get_runtime(model).stats()
    first = sum(losses[:5]) / min(5, len(losses))
    last = sum(losses[-5:]) / min(5, len(losses))
    print(f"\nloss {first:.3f} -> {last:.3f} over {args.steps} steps in {elapsed:.1f} s on {device}")
    print(
        f"layer loads {stats['layer_loads']}, {stats['h2d_bytes'] / 2**20:.1f} MiB copied, "
        f"{stats['demand_loads']} demand loads, peak {stats['peak_resident_layers']} layers resident"
    )
    model.eval()
    example = examples[0]
    prompt = torch.tensor([[BOS] + encode(prompt_of(example))], device=device)
    with torch.no_grad():
        out = model.generate(
            input_ids=prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=8,
            do_sample=False,
            pad_token_id=PAD,
            eos_token_id=EOS,
        )
    print(f"sample: {prompt_of(example)!r} -> {decode(out[0, prompt.shape[1] :].tolist())!r}")
    return {"first_loss": first, "last_loss": last, "stats": stats, "seconds": elapsed}


if __name__ == "__main__":
    main()
