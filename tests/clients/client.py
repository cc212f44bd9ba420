"""A user's training script: one TRL trainer (or the plain Hugging Face Trainer) with its
own defaults, the PEFT method named on the command line, JSONL data on disk, a checkpoint
saved at the last step. Nothing in it knows layerstream: the client matrix runs it once
plainly and once under ``layerstream run``.

    python client.py --trainer dpo --peft lora --model DIR --data DIR --output_dir OUT
"""

import argparse
import json
from pathlib import Path

TRAINERS = ("trainer", "sft", "dpo", "kto", "orpo", "cpo", "grpo", "rloo", "reward")
DATA = {  # which data file each trainer reads
    "trainer": "sft",
    "sft": "sft",
    "dpo": "preference",
    "orpo": "preference",
    "cpo": "preference",
    "kto": "unpaired",
    "grpo": "prompt",
    "rloo": "prompt",
    "reward": "preference",
}
PEFT_METHODS = (
    "lora",
    "dora",
    "rslora",
    "loha",
    "lokr",
    "vera",
    "ia3",
    "prompt_tuning",
    "prefix_tuning",
    "lora_bias_all",
    "lora_attention",
    "modules_to_save",
    "trainable_tokens",
)


def variety_reward(completions, **kwargs):
    """A reward the online trainers can compute without a reward model, and one that differs
    between the completions of a random-weight model (the share of distinct characters): a
    reward that gave every completion of a group the same score (the share of digits, which
    such a model almost never writes) would leave every advantage, loss and gradient at zero,
    and the comparison of the two runs with nothing to compare."""
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [len(set(t)) / max(len(t), 1) for t in texts]


def peft_config(method: str, model_path: str, lora_dropout: float = 0.05):
    """The PEFT method as a user would write it: TRL's ModelConfig defaults for the LoRA
    family (r 16, alpha 32, dropout 0.05, every linear layer)."""
    import peft

    lora = dict(r=16, lora_alpha=32, lora_dropout=lora_dropout, target_modules="all-linear", task_type="CAUSAL_LM")
    if method == "lora":
        return peft.LoraConfig(**lora)
    if method == "lora_attention":
        return peft.LoraConfig(**dict(lora, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    if method == "dora":
        return peft.LoraConfig(use_dora=True, **lora)
    if method == "rslora":
        return peft.LoraConfig(use_rslora=True, **lora)
    if method == "lora_bias_all":
        return peft.LoraConfig(bias="all", **lora)
    if method == "modules_to_save":
        return peft.LoraConfig(modules_to_save=["lm_head"], **lora)
    if method == "loha":
        return peft.LoHaConfig(r=8, alpha=16, module_dropout=0.05, target_modules="all-linear", task_type="CAUSAL_LM")
    if method == "lokr":
        return peft.LoKrConfig(r=8, alpha=16, module_dropout=0.05, target_modules="all-linear", task_type="CAUSAL_LM")
    if method == "vera":
        return peft.VeraConfig(r=16, vera_dropout=0.05, target_modules="all-linear", task_type="CAUSAL_LM")
    if method == "ia3":
        return peft.IA3Config(task_type="CAUSAL_LM")  # PEFT's own targets for the model type
    if method == "prefix_tuning":
        return peft.PrefixTuningConfig(num_virtual_tokens=4, task_type="CAUSAL_LM")
    if method == "prompt_tuning":
        return peft.PromptTuningConfig(num_virtual_tokens=4, task_type="CAUSAL_LM")
    if method == "trainable_tokens":
        from transformers import AutoTokenizer

        digits = AutoTokenizer.from_pretrained(model_path).convert_tokens_to_ids(list("0123456789"))
        return peft.TrainableTokensConfig(target_modules=["embed_tokens"], token_indices=digits)
    raise SystemExit(f"unknown PEFT method {method!r}; one of {', '.join(PEFT_METHODS)}")


def trl_config(trainer: str, common: dict):
    """The trainer's own config class with its defaults; only the run's size is set."""
    if trainer == "sft":
        from trl import SFTConfig

        return SFTConfig(max_length=48, **common)
    if trainer == "dpo":
        from trl import DPOConfig

        return DPOConfig(max_length=48, **common)
    if trainer == "kto":
        from trl import KTOConfig

        return KTOConfig(max_length=48, **common)
    if trainer == "orpo":
        from trl.experimental.orpo import ORPOConfig

        return ORPOConfig(max_length=48, **common)
    if trainer == "cpo":
        from trl.experimental.cpo import CPOConfig

        return CPOConfig(max_length=48, **common)
    if trainer == "reward":
        from trl import RewardConfig

        return RewardConfig(max_length=48, **common)
    online = dict(num_generations=2, max_completion_length=8, **common)
    if trainer == "grpo":
        from trl import GRPOConfig

        return GRPOConfig(**online)
    from trl import RLOOConfig

    return RLOOConfig(**online)


def trl_trainer(name: str, model: str, args, data, peft):
    import trl

    if name in ("grpo", "rloo"):
        cls = trl.GRPOTrainer if name == "grpo" else trl.RLOOTrainer
        return cls(model=model, reward_funcs=variety_reward, args=args, train_dataset=data, peft_config=peft)
    if name == "orpo":
        from trl.experimental.orpo import ORPOTrainer as cls
    elif name == "cpo":
        from trl.experimental.cpo import CPOTrainer as cls
    else:
        cls = {"sft": trl.SFTTrainer, "dpo": trl.DPOTrainer, "kto": trl.KTOTrainer, "reward": trl.RewardTrainer}[name]
    return cls(model=model, args=args, train_dataset=data, peft_config=peft)


def plain_trainer(model_path: str, args, data, peft):
    """The Hugging Face Trainer with no TRL: the model from ``from_pretrained`` as transformers
    loads it, PEFT applied by hand, the texts tokenized by the script."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer, DataCollatorForLanguageModeling, Trainer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_path), peft)
    tokens = data.map(lambda row: tokenizer(row["text"], truncation=True, max_length=48), remove_columns=["text"])
    collator = DataCollatorForLanguageModeling(tokenizer, mlm=False)
    return Trainer(model=model, args=args, train_dataset=tokens, data_collator=collator)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--trainer", choices=TRAINERS, required=True)
    parser.add_argument("--peft", choices=PEFT_METHODS, default="lora")
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", required=True, help="a directory of <kind>.jsonl files")
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--lora_dropout", type=float, default=0.05, help="LoRA's dropout (TRL's default)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--use_cpu", action="store_true")
    parser.add_argument("--dtype", help="the dtype a TRL trainer loads the model in (TRL's default: float32)")
    options = parser.parse_args(argv)

    from datasets import Dataset
    from transformers import set_seed

    set_seed(0)  # the adapters the plain Trainer's script makes are drawn before the Trainer seeds

    rows = [json.loads(line) for line in (Path(options.data) / f"{DATA[options.trainer]}.jsonl").open()]
    data = Dataset.from_list(rows)
    common = dict(
        output_dir=options.output_dir,
        max_steps=options.steps,
        per_device_train_batch_size=2,
        logging_steps=1,
        save_strategy="steps",
        save_steps=options.steps,
        report_to="none",
        use_cpu=options.use_cpu,
    )
    peft = peft_config(options.peft, options.model, options.lora_dropout)
    if options.trainer == "reward":  # a reward model scores sequences: PEFT's task for it (TRL's --lora_task_type)
        peft.task_type = "SEQ_CLS"
    if options.trainer == "trainer":
        from transformers import TrainingArguments

        trainer = plain_trainer(options.model, TrainingArguments(**common), data, peft)
    else:
        if options.dtype:  # as a user asks for it: the trainer's model_init_kwargs
            common["model_init_kwargs"] = {"dtype": options.dtype}
        trainer = trl_trainer(options.trainer, options.model, trl_config(options.trainer, common), data, peft)
    trainer.train()
    trainer.save_model(options.output_dir)


if __name__ == "__main__":
    main()
