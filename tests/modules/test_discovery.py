"""The decoder stack is found by what its layers are, plain or PEFT-wrapped."""

import pytest
from peft import get_peft_model
from torch import nn
from transformers import AutoConfig, LlavaConfig, LlavaForConditionalGeneration

from layerstream.modules.discovery import find_decoder_layers

from tiny import FAMILIES, lora_config, tiny_model


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_is_found(family):
    model = tiny_model(family, layers=3)
    path, layers = find_decoder_layers(model)
    assert path == "model.layers" and len(layers) == 3


def test_found_under_a_peft_wrapper():
    model = get_peft_model(tiny_model("qwen2", layers=3), lora_config())
    path, layers = find_decoder_layers(model)
    assert path == "base_model.model.model.layers"
    assert layers is model.base_model.model.model.layers


def test_language_stack_preferred_over_a_longer_vision_tower():
    text = AutoConfig.for_model(
        "llama",
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    vision = AutoConfig.for_model(
        "clip_vision_model",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=8,
        num_attention_heads=4,
        image_size=32,
        patch_size=8,
    )
    model = LlavaForConditionalGeneration(LlavaConfig(text_config=text, vision_config=vision, image_token_id=95))
    path, layers = find_decoder_layers(model)
    assert len(layers) == 3 and "language_model" in path


def test_layers_named_in_no_split_modules_are_recognised():
    class Block(nn.Module):
        def forward(self, x):
            return x

    class Model(nn.Module):
        _no_split_modules = ["Block"]

        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(4))
            self.other = nn.ModuleList(nn.Linear(2, 2) for _ in range(6))

    path, layers = find_decoder_layers(Model())
    assert path == "blocks" and len(layers) == 4
