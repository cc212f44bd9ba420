"""A user's GRPO script around TRL's GRPOTrainer, for a model too large to write to disk as a
checkpoint on the GPU machine (a 70B shape is 140 GB in bf16): the model is built in memory
at a real shape with random weights, NF4 as bitsandbytes packs it (``common.build_random_nf4``),
and GRPOTrainer gets LoRA r16 on every linear layer and a reward that differs between
completions. Nothing in it knows layerstream: ``rl.py`` runs it under ``layerstream run``,
which streams the Trainer's model.

    layerstream run benchmarks/grpo_client.py --shape llama3-70b --data DIR --output_dir OUT \\
        --steps 3 --generations 8 --completion-tokens 128

``variety_reward`` is the reward TRL's own script gets too (``--reward_funcs
grpo_client.variety_reward``); this module imports nothing heavy at its top, so that import
costs nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def variety_reward(completions, **kwargs):
    """The share of distinct characters in each completion: a reward computed without a
    reward model that differs between a random-weight model's completions, so each group's
    advantages, the loss's gradients and the pair's comparison of them are not all zero (the
    share of digits was the same zero for every completion)."""
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [len(set(text)) / max(len(text), 1) for text in texts]


def build_model(shape: str):
    """The random NF4 model of ``shape``: a name in ``common.SHAPES`` or a config JSON file."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from common import build_random_nf4

    values = json.loads(Path(shape).read_text()) if shape.endswith(".json") else shape
    model = build_random_nf4(values)
    model.config.use_cache = True  # generation keeps its KV cache, as a loaded checkpoint's config says
    return model


def trainer(args):
    from datasets import load_dataset
    from peft import LoraConfig
    from trl import GRPOConfig, GRPOTrainer

    from layerstream.data import byte_tokenizer

    config = GRPOConfig(
        output_dir=args.output_dir,
        max_steps=args.steps,
        logging_steps=1,
        save_strategy="steps",
        save_steps=args.steps,
        report_to="none",
        per_device_train_batch_size=args.generations,
        num_generations=args.generations,
        max_completion_length=args.completion_tokens,
        use_vllm=False,
        bf16=not args.use_cpu,
        use_cpu=args.use_cpu,
        seed=args.seed,
    )
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, target_modules="all-linear", task_type="CAUSAL_LM")
    data = load_dataset("json", data_files=str(Path(args.data) / "train.jsonl"), split="train")
    return GRPOTrainer(
        model=build_model(args.shape),
        reward_funcs=variety_reward,
        args=config,
        train_dataset=data,
        processing_class=byte_tokenizer(),
        peft_config=lora,
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", required=True, help="a common.SHAPES name or a config JSON file")
    parser.add_argument("--data", required=True, help="a folder with train.jsonl of {'prompt': ...} rows")
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--generations", type=int, default=8, help="completions per prompt (and per step)")
    parser.add_argument("--completion-tokens", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--use_cpu", action="store_true")
    args = parser.parse_args(argv)
    trainer(args).train()


if __name__ == "__main__":
    main()
