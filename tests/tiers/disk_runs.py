"""What the disk tier's tests share: loading a checkpoint with a host budget that sends
layers to the disk, a LoRA on it, and a byte of a disk layer to corrupt."""

import os

import torch
from peft import get_peft_model

import layerstream

from tiny import lora_config

LAYERS = 6


SLOTS = 2


def layer_bytes(checkpoint) -> int:
    model = layerstream.from_pretrained(checkpoint, dtype=torch.float32, stream=layerstream.StreamConfig(device="cpu"))
    return layerstream.get_runtime(model).store.largest_layer_bytes


def load_streamed(directory, budget=None, device="cpu", **stream):
    # no VRAM budget: on a GPU the resident window would otherwise keep every layer
    config = layerstream.StreamConfig(device=device, slots=SLOTS, host_budget=budget, vram_budget=None, **stream)
    return layerstream.from_pretrained(directory, dtype=torch.float32, stream=config).to(device)


def small_budget(directory) -> int:
    """The ring and one layer: every other layer is read from disk."""
    return 5 * layer_bytes(directory)


def with_lora(model):
    torch.manual_seed(0)  # the same non-zero LoRA B (init_lora_weights=False) on both
    return get_peft_model(model, lora_config())


def disk_layer_tensor(model):
    """(file, offset) of a byte inside a weight of a disk layer, in the checkpoint's file."""
    tier = layerstream.get_runtime(model).disk
    index = tier.tiers.disk[len(tier.tiers.disk) // 2]
    chunk = tier.layers[index].chunks[0]
    begin, end, _ = chunk.pieces[0]
    return chunk.file.path, begin + (end - begin) // 2 + 3  # the high byte of a float32 value


def flip_byte(path, offset, keep_mtime=True):
    stat = os.stat(path)
    with open(path, "r+b") as handle:
        handle.seek(offset)
        value = handle.read(1)[0]
        handle.seek(offset)
        handle.write(bytes([value ^ 0x40]))
    if keep_mtime:  # silent corruption: the size and time checks cannot see it
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
