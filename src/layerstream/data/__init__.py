"""The embedded default: a tiny model, a byte tokenizer and instruction data, no download.

The model is built from a config, the byte-level tokenizer is made in code, and the
instruction data ships in the package. The demo, ``layerstream train``'s default, the
examples and the tests use it."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

SPECIAL = ("<pad>", "<s>", "</s>")


def data_path() -> Path:
    return Path(str(resources.files("layerstream").joinpath("data/tiny_instructions.jsonl")))


def byte_tokenizer():
    """A byte-level fast tokenizer: three special tokens, then one token per byte."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL)}
    for symbol in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[symbol] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token=SPECIAL[0], bos_token=SPECIAL[1], eos_token=SPECIAL[2]
    )


def tiny_config(tokenizer, layers: int = 6, hidden_size: int = 128, model_type: str = "llama"):
    from transformers import AutoConfig

    return AutoConfig.for_model(
        model_type,
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        use_cache=False,
    )


def write_checkpoint(
    directory, layers: int = 4, hidden_size: int = 64, dtype: str = "float32", seed: int = 0, model_type: str = "llama"
) -> Path:
    """Save the tiny model (random weights) and its tokenizer as a checkpoint directory, as
    a hub download would leave one: what scripts under test load by path."""
    import torch
    from transformers import AutoModelForCausalLM

    directory = Path(directory)
    tokenizer = byte_tokenizer()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(
        tiny_config(tokenizer, layers, hidden_size, model_type), dtype=getattr(torch, dtype)
    )
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
