"""A plain TRL SFTTrainer script: LoRA SFT of a tiny model built from a config on the
instruction data shipped in this repository, with a byte-level tokenizer made in code
(no download). It knows nothing of layerstream; stream it unchanged with:

    layerstream run --slots 2 --device cpu examples/train_sft.py --output_dir out --max_steps 20
"""

import json
from pathlib import Path

import torch
from datasets import Dataset
from peft import LoraConfig
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoConfig, AutoModelForCausalLM, HfArgumentParser, PreTrainedTokenizerFast
from trl import SFTConfig, SFTTrainer

DATA = Path(__file__).resolve().parents[1] / "src" / "layerstream" / "data" / "tiny_instructions.jsonl"
SPECIAL = ["<pad>", "<s>", "</s>"]


def byte_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {token: i for i, token in enumerate(SPECIAL)}
    for symbol in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[symbol] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def main():
    (args,) = HfArgumentParser((SFTConfig,)).parse_args_into_dataclasses()
    tokenizer = byte_tokenizer()
    config = AutoConfig.for_model(
        "llama",
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        use_cache=False,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    rows = [json.loads(line) for line in DATA.read_text().splitlines() if line.strip()]
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
