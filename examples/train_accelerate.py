"""A custom Accelerate training loop: LoRA on a tiny model built from a config, trained
on the instruction data shipped in this repository. Runs plain, or streamed with
``--stream`` (one call, ``layerstream.stream_model``, before ``accelerator.prepare``):

    python examples/train_accelerate.py --steps 20
    python examples/train_accelerate.py --steps 20 --stream --slots 2
    accelerate launch examples/train_accelerate.py --steps 20 --stream
"""

import argparse
import json

import torch
from accelerate import Accelerator
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from layerstream.data import byte_tokenizer, data_path, tiny_config

TOKENIZER = byte_tokenizer()


def batches(rows, size):
    for start in range(0, len(rows) - size + 1, size):
        texts = [f"Q: {r['instruction']}\nA: {r['response']}" for r in rows[start : start + size]]
        seqs = [
            [TOKENIZER.bos_token_id] + TOKENIZER(t, add_special_tokens=False).input_ids + [TOKENIZER.eos_token_id]
            for t in texts
        ]
        width = max(len(s) for s in seqs)
        ids = torch.full((size, width), TOKENIZER.pad_token_id)
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
    config = tiny_config(TOKENIZER, layers=4, hidden_size=64)
    torch.manual_seed(0)
    model = get_peft_model(
        AutoModelForCausalLM.from_config(config), LoraConfig(r=8, target_modules="all-linear", init_lora_weights=False)
    )
    if args.stream:
        import layerstream

        layerstream.stream_model(model, slots=args.slots, device=accelerator.device)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    rows = [json.loads(line) for line in data_path().read_text().splitlines() if line.strip()]
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
