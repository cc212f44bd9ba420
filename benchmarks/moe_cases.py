"""The mixture-of-experts benchmark's cases and their size arithmetic: which models, under
which caps, and whether each checkpoint fits the disk and its store the host RAM (which
decides the route a case takes; ``moe.py`` runs them)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Callable

import torch

from common import shape_config

GiB = 1 << 30
DISK_BYTES = 64 * GiB  # the GPU machine's disk
HOST_RAM_BYTES = 128 * GiB  # and its RAM
GPU_BYTES = 139 * GiB  # one H200 as CUDA reports it
# of the disk a written checkpoint may take: the system image, carried wheels, TRL's output
# and the page cache's write-back need the rest
CHECKPOINT_DISK_SHARE = 0.75
# of the host RAM the page-locked store may take: locked pages cannot be reclaimed, and the
# load's one-layer copies, the checkpoint's page cache and the processes need the rest
STORE_RAM_SHARE = 0.6
LORA_R, LORA_ALPHA, LORA_DROPOUT = 16, 32, 0.05
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
TARGET_VS_RESIDENT = 0.9
TRL_LOSS = "trl-fused-head"  # the train rows' loss: TRL's fused log-prob head, in both routes
PROFILED_STEPS = 18  # capped.py's profiler: Python over steps 8-15, torch over 16-17
WHOLE_GPU = "1024GiB"  # capped.py's cap for a resident run: the fraction stays 1.0


@dataclass(frozen=True)
class Case:
    name: str
    shape: str  # a common.SHAPES key
    cap: str  # GPU memory the streamed runs may use
    tokens: int = 2048
    decode_batches: tuple = ()
    steps: int = 8  # timed steps of the API route (the TRL route: steps, of which 2 warm up)
    warmup: int = 2
    prompt_tokens: int = 128
    new_tokens: int = 24
    disk: int = DISK_BYTES
    host_ram: int = HOST_RAM_BYTES
    gpu: int = GPU_BYTES


@dataclass
class Session:
    """What every case of one invocation shares: its arguments, the device, the bandwidth
    measured at its start, its command line, and ``keep(rows)``, which writes a case's rows
    so far (a run cut off by the machine's time limit keeps what it measured)."""

    args: argparse.Namespace
    device: str
    gbps: float
    command: str
    keep: Callable[[list], None]


CASES = {
    case.name: case
    for case in (
        Case("qwen3-30b-a3b", "qwen3-30b-a3b", "8GiB", decode_batches=(1, 8)),
        Case("gpt-oss-20b", "gpt-oss-20b", "8GiB", steps=12),
        Case("gpt-oss-120b", "gpt-oss-120b", "24GiB", steps=6),
    )
}

# --dry-run: the same three routes on tiny shapes, on the CPU, with a disk and host RAM
# scaled so that each tiny case takes the route its real one takes
_TINY_MOE = dict(vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)
TINY_SHAPES = {
    "tiny-qwen3-moe": dict(
        _TINY_MOE,
        model_type="qwen3_moe",
        intermediate_size=128,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        head_dim=16,
        max_position_embeddings=512,
    ),
    "tiny-gpt-oss": dict(
        _TINY_MOE,
        model_type="gpt_oss",
        intermediate_size=32,
        num_local_experts=8,
        num_experts_per_tok=2,
        head_dim=16,
        sliding_window=8,
        num_hidden_layers=6,  # of which the host RAM of the 120b-like case holds 4
        layer_types=["sliding_attention", "full_attention"] * 3,
        rope_scaling=dict(
            rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, original_max_position_embeddings=16
        ),
        max_position_embeddings=512,
        quantization_config={"quant_method": "mxfp4"},  # as gpt-oss is published: experts kept packed
    ),
}
_TINY_RUN = dict(tokens=64, steps=3, warmup=1, prompt_tokens=16, new_tokens=6)
TINY_CASES = {
    case.name: case
    for case in (
        Case("tiny-qwen3-moe", "tiny-qwen3-moe", "8GiB", decode_batches=(1, 8), disk=1 << 19, **_TINY_RUN),
        Case("tiny-gpt-oss-20b", "tiny-gpt-oss", "8GiB", **_TINY_RUN),
        Case("tiny-gpt-oss-120b", "tiny-gpt-oss", "24GiB", disk=1 << 19, host_ram=15 << 16, **_TINY_RUN),
    )
}


# -- size arithmetic -----------------------------------------------------------------------
def checkpoint_bytes(config, dtype=torch.bfloat16) -> int:
    """The safetensors payload of the model's state dict in ``dtype`` (tied weights once)."""
    from layerstream.checkpoints import mxfp4
    from layerstream.modules import packed_experts
    from layerstream.plan.shapes import build_meta_model

    model = build_meta_model(config, dtype)
    if mxfp4.keeps_packed(config):  # gpt-oss as published: its experts' blocks and scales
        packed_experts.pack_every(model, dtype)
    saved = {id(t): t for t in model.state_dict(keep_vars=True).values()}  # a tied weight once
    return sum(t.numel() * t.element_size() for t in saved.values())


def case_sizes(case: Case, values: dict, layers_asked: int | None = None) -> dict:
    """Whether the checkpoint (bf16; MXFP4 experts for gpt-oss) fits the disk, whether the host RAM holds the NF4 store
    (experts in bf16), how many layers are measured (as many as the RAM holds, or
    ``layers_asked``), and whether those fit the GPU resident."""
    from layerstream import plan

    config = shape_config(values)
    layers = plan.layer_bytes(config, "nf4", torch.bfloat16)
    resident = plan.resident_bytes(config, torch.bfloat16)
    checkpoint = checkpoint_bytes(config)
    measured = layers_asked or max(2, min(len(layers), int(case.host_ram * STORE_RAM_SHARE // max(layers))))
    fits_disk = checkpoint <= case.disk * CHECKPOINT_DISK_SHARE
    fits_ram = sum(layers) <= case.host_ram * STORE_RAM_SHARE
    gib = lambda n: round(n / GiB, 2)  # noqa: E731
    return {
        "checkpoint_gib": gib(checkpoint),
        "checkpoint_gb": round(checkpoint / 1e9, 2),
        "disk_gib": gib(case.disk),
        "checkpoint_fits_disk": fits_disk,
        "store_nf4_gib": gib(sum(layers)),
        "layer_nf4_gib": gib(max(layers)),
        "host_ram_gib": gib(case.host_ram),
        "store_fits_host_ram": fits_ram,
        "layers_of_model": len(layers),
        "layers_measured": measured,
        "resident_gib_full": gib(sum(layers) + resident),
        "resident_fits_gpu_full": sum(layers) + resident <= case.gpu,
        "resident_gib_measured": gib(sum(layers[:measured]) + resident),
        "resident_fits_gpu_measured": sum(layers[:measured]) + resident <= case.gpu,
        "route": "trl-sft" if fits_disk and fits_ram else "api",
    }
