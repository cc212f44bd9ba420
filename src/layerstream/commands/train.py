"""`layerstream train CONFIG.yaml`: LoRA/QLoRA SFT driven by a YAML config, on TRL's SFTTrainer.

The config is read and checked first (``train_config``); then the model is built or loaded
layer by layer, streamed, given its adapters and trained.
"""

from __future__ import annotations

from typing import Any, Dict

from ..config import StreamConfig
from ..system.log import get_logger
from .train_config import model_config, stream_config, training_arguments

logger = get_logger(__name__)


def say_where_it_trains(config, stream: StreamConfig) -> None:
    """stream.device "auto" on a machine without CUDA trains on the CPU: fine for the embedded
    model, hours per step for a recipe written for a GPU; either way the user is told first."""
    if config["stream"]["device"] != "auto" or stream.device.type != "cpu":
        return
    name = config["model"]["name"]
    slow = (
        "" if name == "embedded-tiny" else f"; {name} on the CPU is far slower than on the GPU its config was made for"
    )
    logger.warning(
        "layerstream: no CUDA device is visible, so this run trains on the CPU (stream.device: auto, "
        "host-to-host copies)%s. Set stream.device: cuda to require a GPU.",
        slow,
    )


def run(config: Dict[str, Dict[str, Any]]):
    """Build, stream and train as the (validated) config says; returns the trainer."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model
    from transformers import set_seed
    from trl import SFTConfig, SFTTrainer

    from .. import api, integrations  # noqa: F401  (integrations: register before streaming)
    from .. import data as embedded
    from ..loading import from_pretrained

    model_section, lora = config["model"], config["lora"]
    dtype = getattr(torch, model_section["dtype"])
    stream = stream_config(config)
    say_where_it_trains(config, stream)
    args = SFTConfig(**training_arguments(config))
    if model_section["name"] == "embedded-tiny":
        from transformers import AutoModelForCausalLM

        tokenizer = embedded.byte_tokenizer()
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(model_config(config, tokenizer), dtype=dtype)
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(
            model_section["name"], trust_remote_code=model_section["trust_remote_code"]
        )
        # the adapters are drawn from training.seed, as a plain script seeding before its
        # get_peft_model draws them, not from whatever the process's generator holds
        set_seed(args.seed)
        quantization = None if model_section["quantization"] == "none" else model_section["quantization"]
        model = from_pretrained(
            model_section["name"],
            quantization=quantization,
            dtype=dtype,
            stream=stream,
            trust_remote_code=model_section["trust_remote_code"],
        )
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = get_peft_model(
        model,
        LoraConfig(
            r=lora["r"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"], target_modules=lora["target_modules"]
        ),
    )
    if not api.is_streamed(model):
        api.stream_model(model, stream)
    rows = config["rows"]
    held = config["data"]["eval_rows"]
    train = Dataset.from_list([{"text": t} for t in rows[: len(rows) - held]])
    evaluation = Dataset.from_list([{"text": t} for t in rows[len(rows) - held :]]) if held else None
    trainer = SFTTrainer(
        model=model, args=args, train_dataset=train, eval_dataset=evaluation, processing_class=tokenizer
    )
    trainer.train()
    trainer.save_model()
    trainer.save_state()
    return trainer
