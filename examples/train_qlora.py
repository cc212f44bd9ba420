"""A plain QLoRA Trainer script, as people write them: the model loaded by path with
``device_map="auto"`` and a ``BitsAndBytesConfig``, prepared with PEFT, trained on the
instruction data shipped in this repository. It knows nothing of layerstream; to train a
model larger than the GPU with it, run it unchanged under the launcher:

    python examples/train_qlora.py --model_name_or_path DIR --load_in_4bit --output_dir out --max_steps 20
    layerstream run examples/train_qlora.py --model_name_or_path DIR --load_in_4bit --output_dir out --max_steps 20

DIR is a checkpoint directory (config.json, safetensors, tokenizer), e.g. one written by
``layerstream.data.write_checkpoint``.
"""

import json
from dataclasses import dataclass, field

import torch
from datasets import Dataset
from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    BitsAndBytesConfig,
    DataCollatorForLanguageModeling,
    HfArgumentParser,
    Trainer,
    TrainingArguments,
)

from layerstream.data import data_path  # the instruction data shipped with layerstream


@dataclass
class ModelArguments:
    model_name_or_path: str = field(metadata={"help": "checkpoint directory or hub id"})
    load_in_4bit: bool = field(default=False, metadata={"help": "QLoRA: load the base in 4-bit NF4"})
    lora_rank: int = field(default=8)
    max_length: int = field(default=128)


def main():
    model_args, args = HfArgumentParser((ModelArguments, TrainingArguments)).parse_args_into_dataclasses()
    quantization = (
        BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16,
        )
        if model_args.load_in_4bit
        else None
    )
    model = AutoModelForCausalLM.from_pretrained(
        model_args.model_name_or_path,
        device_map="auto",
        quantization_config=quantization,
        dtype=torch.bfloat16 if quantization else torch.float32,
    )
    tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path)
    if quantization is not None:
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    torch.manual_seed(args.seed)
    model = get_peft_model(
        model, LoraConfig(r=model_args.lora_rank, target_modules="all-linear", init_lora_weights=False)
    )
    rows = [json.loads(line) for line in data_path().read_text().splitlines() if line.strip()]
    data = Dataset.from_list([{"text": f"Q: {r['instruction']}\nA: {r['response']}"} for r in rows])
    data = data.map(
        lambda row: tokenizer(row["text"], truncation=True, max_length=model_args.max_length), remove_columns=["text"]
    )
    trainer = Trainer(
        model=model, args=args, train_dataset=data, data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False)
    )
    trainer.train()
    trainer.save_state()  # trainer_state.json (log_history) in output_dir


if __name__ == "__main__":
    main()
