"""A custom Accelerate training loop: LoRA on a tiny model built from a config, trained
on the instruction data shipped in this repository. Runs plain, or streamed with
``--stream`` (one call, ``layerstream.stream_model``, before ``accelerator.prepare``):

    python examples/train_accelerate.py --steps 20
    python examples/train_accelerate.py --steps 20 --stream --slots 2
    accelerate launch examples/train_accelerate.py --steps 20 --stream
"""

import argparse
import json
from pathlib import Path

import torch
from accelerate import Accelerator
from peft import LoraConfig, get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM

DATA = Path(__file__).resolve().parents[1] / "src" / "layerstream" / "data" / "tiny_instructions.jsonl"
PAD, BOS, EOS, BYTE0 = 0, 1, 2, 3


def batches(rows, size):
    for start in range(0, len(rows) - size + 1, size):
        seqs = [
            [BOS] + [BYTE0 + b for b in f"Q: {r['instruction']}\nA: {r['response']}".encode()] + [EOS]
            for r in rows[start : start + size]
        ]
        width = max(len(s) for s in seqs)
        ids = torch.full((size, width), PAD)
        labels = torch.full((size, width), -100)
        for i, s in enumerate(seqs):
            ids[i, : len(s)], labels[i, : len(s)] = torch.tensor(s), torch.tensor(s)
        yield ids, labels


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--stream", action="store_true", help="stream decoder layers with layerstream")
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--cpu", action="store_true")
    args = parser.parse_args(argv)
    accelerator = Accelerator(cpu=args.cpu)
    config = AutoConfig.for_model(
        "llama",
        vocab_size=BYTE0 + 256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=PAD,
        bos_token_id=BOS,
        eos_token_id=EOS,
        use_cache=False,
    )
    torch.manual_seed(0)
    model = get_peft_model(
        AutoModelForCausalLM.from_config(config), LoraConfig(r=8, target_modules="all-linear", init_lora_weights=False)
    )
    if args.stream:
        import layerstream

        layerstream.stream_model(model, slots=args.slots, device=accelerator.device)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    rows = [json.loads(line) for line in DATA.read_text().splitlines() if line.strip()]
    losses = []
    model.train()
    for step, (ids, labels) in zip(range(args.steps), batches(rows, args.batch_size)):
        ids, labels = ids.to(accelerator.device), labels.to(accelerator.device)
        loss = model(input_ids=ids, labels=labels).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        accelerator.print(f"step {step + 1} loss {loss.item():.4f}")
    return losses


if __name__ == "__main__":
    main()
