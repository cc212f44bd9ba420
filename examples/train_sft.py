"""A plain TRL SFTTrainer script: LoRA SFT of a tiny model built from a config on the
instruction data shipped in this repository, with the embedded byte-level tokenizer
(``layerstream.data``: made in code, no download). It knows nothing of layerstream; stream it unchanged with:

    layerstream run --slots 2 --device cpu examples/train_sft.py --output_dir out --max_steps 20
"""

import json

import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import AutoModelForCausalLM, HfArgumentParser
from trl import SFTConfig, SFTTrainer

from layerstream.data import byte_tokenizer, data_path, tiny_config


def main():
    (args,) = HfArgumentParser((SFTConfig,)).parse_args_into_dataclasses()
    tokenizer = byte_tokenizer()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(tokenizer, layers=4, hidden_size=64))
    rows = [json.loads(line) for line in data_path().read_text().splitlines() if line.strip()]
    data = Dataset.from_list([{"text": f"Q: {r['instruction']}\nA: {r['response']}"} for r in rows])
    trainer = SFTTrainer(
        model=model,
        args=args,
        train_dataset=data,
        processing_class=tokenizer,
        peft_config=LoraConfig(r=8, target_modules="all-linear", init_lora_weights=False),
    )
    trainer.train()
    trainer.save_state()


if __name__ == "__main__":
    main()
