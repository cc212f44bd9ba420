"""The embedded default: the byte tokenizer round-trips any text, the shipped instructions
are answered correctly, and the tiny checkpoint is the same model for the same seed."""

import json
import re

import pytest
import torch

from layerstream.data import SPECIAL, byte_tokenizer, data_path, write_checkpoint


@pytest.mark.parametrize("text", ["Add 2 and 3.", "naïve café, 東京 🚀", "  two  spaces\nand a line\t"])
def test_the_byte_tokenizer_round_trips_any_text(text):
    tokenizer = byte_tokenizer()
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text.encode("utf-8")), "one token per byte"
    assert tokenizer.decode(ids) == text


def test_the_byte_tokenizers_special_tokens_come_first():
    tokenizer = byte_tokenizer()
    assert [tokenizer.pad_token, tokenizer.bos_token, tokenizer.eos_token] == list(SPECIAL)
    assert [tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id] == [0, 1, 2]
    assert len(tokenizer) == len(SPECIAL) + 256


def _answer(instruction: str) -> str:
    """What each kind of shipped instruction asks for, computed."""
    if match := re.fullmatch(r"Add (\d+) and (\d+)\.", instruction):
        return str(int(match[1]) + int(match[2]))
    if match := re.fullmatch(r"Write in capitals: (\w+)", instruction):
        return match[1].upper()
    if match := re.fullmatch(r"How many letters are in (\w+)\?", instruction):
        return str(len(match[1]))
    if match := re.fullmatch(r"Reverse the word: (\w+)", instruction):
        return match[1][::-1]
    raise AssertionError(f"an instruction of no known kind: {instruction!r}")


def test_every_shipped_instruction_is_answered_correctly():
    rows = [json.loads(line) for line in data_path().read_text().splitlines()]
    assert len(rows) == 400
    wrong = [row for row in rows if row["response"] != _answer(row["instruction"])]
    assert not wrong, wrong[:3]


def test_the_answer_check_sees_a_wrong_answer():
    """Negative control."""
    assert _answer("Add 6 and 4.") == "10" and _answer("Reverse the word: tensor") != "tensor"


def test_the_tiny_checkpoint_is_the_same_model_for_the_same_seed(tmp_path):
    from transformers import AutoModelForCausalLM

    def weights(directory):
        return AutoModelForCausalLM.from_pretrained(directory).state_dict()

    first = weights(write_checkpoint(tmp_path / "a", seed=3))
    again = weights(write_checkpoint(tmp_path / "b", seed=3))
    other = weights(write_checkpoint(tmp_path / "c", seed=4))
    assert all(torch.equal(first[name], again[name]) for name in first)
    assert not all(torch.equal(first[name], other[name]) for name in first)
