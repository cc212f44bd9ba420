"""A plain QLoRA Trainer script as people write them, with ``layerstream.StreamingArguments``
added to its parser as docs/usage.md says (``--layer_stream`` streams the model from inside
the script): the model loaded by path with ``device_map="auto"`` and a
``BitsAndBytesConfig``, PEFT's LoRA on every linear layer, gradient checkpointing, text rows
of a JSON-lines file tokenised to ``--max_length``. ``long_context_client.py --client
trainer`` runs it with ``--layer_stream`` and no other layerstream flag, and plainly (without
it) as the baseline.

    python benchmarks/long_trainer_script.py --model_name_or_path DIR --dataset_file ROWS.jsonl \\
        --max_length 36864 --output_dir out --max_steps 3 --layer_stream
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

import layerstream


@dataclass
class ScriptArguments:
    model_name_or_path: str = field(metadata={"help": "checkpoint directory"})
    dataset_file: str = field(metadata={"help": "JSON lines of {'text': ...}"})
    max_length: int = field(default=2048)
    lora_rank: int = field(default=32)
    lora_alpha: int = field(default=16)
    lora_dropout: float = field(default=0.05)


def main():
    parser = HfArgumentParser((ScriptArguments, TrainingArguments, layerstream.StreamingArguments))
    script, args, _ = parser.parse_args_into_dataclasses()
    quantization = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )
    model = AutoModelForCausalLM.from_pretrained(
        script.model_name_or_path, device_map="auto", quantization_config=quantization, dtype=torch.bfloat16
    )
    tokenizer = AutoTokenizer.from_pretrained(script.model_name_or_path)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=args.gradient_checkpointing)
    torch.manual_seed(args.seed)  # the adapters' initial values (the Trainer seeds only after this)
    model = get_peft_model(
        model,
        LoraConfig(
            r=script.lora_rank,
            lora_alpha=script.lora_alpha,
            lora_dropout=script.lora_dropout,
            target_modules="all-linear",
            task_type="CAUSAL_LM",
        ),
    )
    with open(script.dataset_file) as handle:
        texts = [json.loads(line)["text"] for line in handle if line.strip()]
    data = Dataset.from_list([{"text": text} for text in texts]).map(
        lambda row: tokenizer(row["text"], truncation=True, max_length=script.max_length), remove_columns=["text"]
    )
    collator = DataCollatorForLanguageModeling(tokenizer, mlm=False)
    Trainer(model=model, args=args, train_dataset=data, data_collator=collator).train()


if __name__ == "__main__":
    main()
