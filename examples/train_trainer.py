"""A plain Hugging Face Trainer script (HfArgumentParser), LoRA on a tiny model built from
a config, trained on the instruction data shipped in this repository. It knows nothing
of layerstream; to stream it, run it unchanged under the launcher:

    python examples/train_trainer.py --output_dir out --max_steps 20
    layerstream run --slots 2 --device cpu examples/train_trainer.py --output_dir out --max_steps 20
"""

import json
from dataclasses import dataclass, field

import torch
from datasets import Dataset
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, HfArgumentParser, Trainer, TrainingArguments

from layerstream.data import byte_tokenizer, data_path, tiny_config

TOKENIZER = byte_tokenizer()  # byte-level, made in code: no download
PAD, BOS, EOS = TOKENIZER.pad_token_id, TOKENIZER.bos_token_id, TOKENIZER.eos_token_id


@dataclass
class ModelArguments:
    layers: int = field(default=4, metadata={"help": "decoder layers of the tiny model"})
    hidden_size: int = field(default=64)
    lora_rank: int = field(default=8)


def encode(example):
    text = f"Q: {example['instruction']}\nA: {example['response']}"
    ids = [BOS] + TOKENIZER(text, add_special_tokens=False).input_ids + [EOS]
    return {"input_ids": ids, "labels": ids}


def collate(rows):
    width = max(len(r["input_ids"]) for r in rows)
    ids = torch.full((len(rows), width), PAD)
    labels = torch.full((len(rows), width), -100)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        ids[i, :n], labels[i, :n], mask[i, :n] = torch.tensor(r["input_ids"]), torch.tensor(r["labels"]), 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def main():
    model_args, args = HfArgumentParser((ModelArguments, TrainingArguments)).parse_args_into_dataclasses()
    config = tiny_config(TOKENIZER, model_args.layers, model_args.hidden_size)
    torch.manual_seed(0)
    model = get_peft_model(
        AutoModelForCausalLM.from_config(config),
        LoraConfig(r=model_args.lora_rank, target_modules="all-linear", init_lora_weights=False),
    )
    rows = [json.loads(line) for line in data_path().read_text().splitlines() if line.strip()]
    data = Dataset.from_list(rows).map(encode, remove_columns=["instruction", "response"])
    train, held_out = data.select(range(len(data) - 40)), data.select(range(len(data) - 40, len(data)))
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=train,
        data_collator=collate,
        eval_dataset=held_out if args.eval_strategy != "no" else None,
    )
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    trainer.save_state()  # trainer_state.json (log_history) in output_dir


if __name__ == "__main__":
    main()
