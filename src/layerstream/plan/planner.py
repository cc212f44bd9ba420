"""The planner's entry point: a memory plan of one streamed LoRA training step, with advice
(what to change, and by how much) when it does not fit. The advice is computed from
alternative plans (``advice``), so it sits above the memory model (``memory``)."""

from __future__ import annotations

from typing import Optional

import torch

from ..config import DEFAULT_ARENA_BYTES
from .advice import advice
from .memory import MemoryPlan, _build
from .shapes import DEFAULT_BANDWIDTH_GBPS, DEFAULT_RESERVE_BYTES


def make_plan(
    config,
    seq: int,
    batch: int,
    vram_bytes: int,
    quantization: str = "none",
    dtype=torch.bfloat16,
    lora_rank: int = 16,
    slots: Optional[int] = None,
    bandwidth_gbps: float = DEFAULT_BANDWIDTH_GBPS,
    lora_targets: str = "all-linear",
    reserve_bytes: int = DEFAULT_RESERVE_BYTES,
    double_quant: bool = True,
    arena_bytes: int = DEFAULT_ARENA_BYTES,
    stream_embeddings: bool = False,
    backward_slots: Optional[int] = 0,
    offload_activations: bool = False,
    loss_chunk_tokens: Optional[int] = None,
    mlp_tile_tokens: Optional[int] = None,
    trl_fused_head: bool = False,
) -> MemoryPlan:
    """Plan a streamed LoRA training step of ``batch`` x ``seq`` tokens on a GPU of
    ``vram_bytes``.

    slots: None picks the largest count in 2..8 (at most the number of layers) that fits;
        when none fits, 2, and the plan does not fit.
    reserve_bytes: kept free for what torch's allocator statistics do not count (CUDA
        context, library workspaces, fragmentation). The plan fits when
        ``peak_vram_bytes + reserve_bytes <= vram_bytes``.
    bandwidth_gbps: pinned host->device GB/s (1e9 bytes/s). The default is the team's
        measurement on an H200; measure your own machine and pass it.
    double_quant: NF4 with double quantisation (bnb_4bit_use_double_quant).
    arena_bytes: StreamConfig.arena_bytes (host RAM of layerstream.from_pretrained).
    stream_embeddings: StreamConfig.stream_embeddings: the input embedding and head stay
        in host memory; the loss phase holds one transient copy of the head weight.
    backward_slots: StreamConfig.backward_slots (default 0); None: as many as the loss
        phase's memory holds (``backward_slot_count``), what the runtime's "auto" takes
        when the caching allocator uses expandable segments.
    offload_activations: StreamConfig.offload_activations: every layer's checkpointed input
        but ~2 in host memory (``activation_host_bytes``).
    loss_chunk_tokens, mlp_tile_tokens: the chunked head and loss, the sequence-tiled MLP
        (None: off): their terms hold a chunk (tile) of tokens instead of all of them.
    trl_fused_head: TRL's trainers compute the loss with their fused log-prob head
        (``trl_head``): its tiles instead of the logits, and loss_chunk_tokens does not apply.

    A plan that does not fit carries ``advice``: what to change, and by how much.
    """
    args = dict(
        config=config,
        seq=seq,
        batch=batch,
        vram_bytes=vram_bytes,
        quantization=quantization,
        dtype=dtype,
        lora_rank=lora_rank,
        slots=slots,
        bandwidth_gbps=bandwidth_gbps,
        lora_targets=lora_targets,
        reserve_bytes=reserve_bytes,
        double_quant=double_quant,
        arena_bytes=arena_bytes,
        stream_embeddings=stream_embeddings,
        backward_slots=backward_slots,
        offload_activations=offload_activations,
        loss_chunk_tokens=loss_chunk_tokens,
        mlp_tile_tokens=mlp_tile_tokens,
        trl_fused_head=trl_fused_head,
    )
    plan = _build(**args)
    if not plan.fits:
        plan.advice = advice(plan, args)
    return plan
