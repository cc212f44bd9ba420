"""The plain script a `layerstream train` YAML stands for: the config read and checked as
the command reads it, then the model, adapters, data and SFTConfig it names built with
transformers, PEFT and TRL alone, in the order ``commands/train.py`` builds them. The client
matrix runs it against ``layerstream train`` of the same config.

    python train_client.py CONFIG.yaml [--set section.key=value ...]
"""

import argparse


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("config")
    parser.add_argument("--set", action="append", default=[])
    options = parser.parse_args(argv)

    import torch
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer, set_seed
    from trl import SFTConfig, SFTTrainer

    from layerstream.commands.train_config import load, training_arguments

    config = load(options.config, options.set)
    model_section, lora = config["model"], config["lora"]
    args = SFTConfig(**training_arguments(config))
    tokenizer = AutoTokenizer.from_pretrained(model_section["name"])
    set_seed(args.seed)  # the adapters are drawn from the run's seed
    model = AutoModelForCausalLM.from_pretrained(model_section["name"], dtype=getattr(torch, model_section["dtype"]))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = get_peft_model(
        model,
        LoraConfig(
            r=lora["r"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"], target_modules=lora["target_modules"]
        ),
    )
    rows, held = config["rows"], config["data"]["eval_rows"]
    train = Dataset.from_list([{"text": t} for t in rows[: len(rows) - held]])
    evaluation = Dataset.from_list([{"text": t} for t in rows[len(rows) - held :]]) if held else None
    trainer = SFTTrainer(
        model=model, args=args, train_dataset=train, eval_dataset=evaluation, processing_class=tokenizer
    )
    trainer.train()
    trainer.save_model()
    trainer.save_state()


if __name__ == "__main__":
    main()
