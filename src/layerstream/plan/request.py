"""What a memory plan is asked for (``PlanRequest``), and the request of a run with given
StreamConfig settings (``request_for``).

Every surface that plans (``make_plan``, ``layerstream plan``, ``layerstream train``'s check,
the runtime's own plans of a live model, the long-sequence comparison and search) passes
one request, so the arguments of a plan are spelled once. The settings a plan shares with
StreamConfig take StreamConfig's values and spelling, "auto" included; ``make_plan``
resolves "auto" (``long_settings.resolve_auto`` and the slot counts in ``memory``).
Pure: no CUDA; torch only for the dtype.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Union

import torch

from ..config import DEFAULT_ARENA_BYTES
from .shapes import DEFAULT_BANDWIDTH_GBPS, DEFAULT_RESERVE_BYTES, parse_dtype

AUTO = "auto"
# the StreamConfig settings a plan takes, under their own names (the rest change no memory
# the plan counts: prefetch, pin, checksum, device, the disk cache, the shared store)
REQUEST_SETTINGS = (
    "slots",
    "backward_slots",
    "arena_bytes",
    "stream_embeddings",
    "offload_activations",
    "loss_chunk_tokens",
    "mlp_tile_tokens",
)
# with the two budgets, which a caller turns into bytes: the flags `layerstream plan` derives
# from StreamConfig's settings (``cli.add_setting_flags``)
PLAN_SETTINGS = ("vram_budget", "host_budget") + REQUEST_SETTINGS


@dataclass(frozen=True)
class PlanRequest:
    """One streamed LoRA training step to plan: ``batch`` x ``seq`` tokens of a model (its
    transformers ``config``) on a GPU budget of ``vram_bytes``.

    The fields' order is the order ``make_plan`` took them in before the request existed,
    so ``PlanRequest(config, 2048, 1, budget, "nf4")`` reads as it did.

    slots: "auto" takes what StreamConfig(slots="auto") takes (``config.auto_slots``) with
        the room the budget leaves them: 3, or 2 when it holds fewer (then the plan may not fit).
    reserve_bytes: kept free for what torch's allocator statistics do not count (CUDA
        context, library workspaces, fragmentation). The plan fits when
        ``peak_vram_bytes + reserve_bytes <= vram_bytes``.
    bandwidth_gbps: pinned host->device GB/s (1e9 bytes/s). The default is the team's
        measurement on an H200; measure your own machine and pass it.
    double_quant: NF4 with double quantisation (bnb_4bit_use_double_quant).
    arena_bytes: StreamConfig.arena_bytes (host RAM of layerstream.from_pretrained).
    stream_embeddings: StreamConfig.stream_embeddings: the input embedding and head stay
        in host memory; the loss phase holds one transient copy of the head weight. "auto":
        only where the long-sequence settings leave the step over (``plan.long_settings``).
    backward_slots: StreamConfig.backward_slots; "auto": as many as the loss phase's memory
        holds (``backward_slot_count``), what the runtime's "auto" takes where it takes any
        (CUDA, expandable segments, no vram_budget; ``request_for`` plans a run's "auto").
    offload_activations: StreamConfig.offload_activations: every layer's checkpointed input
        but ~2 in host memory (``activation_host_bytes``).
    loss_chunk_tokens, mlp_tile_tokens: the chunked head and loss, the sequence-tiled MLP
        (None: off): their terms hold a chunk (tile) of tokens instead of all of them.
        These three may be "auto": what a run decides for this step under ``vram_bytes``.
    trl_fused_head: TRL's trainers compute the loss with their fused log-prob head
        (``trl_head``): its tiles instead of the logits, and loss_chunk_tokens does not apply.
    adapter_dtype: the LoRA weights' dtype: float32 as PEFT makes them by default; TRL's
        trainers cast a 4-bit model's adapters to bfloat16 under ``bf16``. Their gradients
        and AdamW's states take it too.
    lora_dropout: the adapters' dropout is above 0 (TRL's default is 0.05): each adapted
        projection then keeps its dropped input and the mask (``working_set``).
    autocast: the step runs under autocast to the compute dtype (the Trainer with
        ``bf16``/``fp16``): PEFT then feeds the adapters without a cast.
    lora_parameters: comma-separated Parameter names, as PEFT's ``target_parameters`` takes
        them, adapted beside ``lora_targets`` ("": none named). PEFT writes those it chose
        for "all-linear" (a MoE's fused experts and router) there in a live model's config.
    lora_rank_pattern: (pattern, rank) pairs, as PEFT's ``rank_pattern`` takes them: the
        ranks that differ from ``lora_rank`` (PEFT gives a fused gate and up stack twice it).
    residual_dtype: the hidden states' dtype between layers and of the embeddings, head and
        norms where it differs from ``dtype`` (None: ``dtype``). peft's
        ``prepare_model_for_kbit_training`` makes them float32 while the 4-bit layers and
        autocast compute in ``dtype``: the residual stream, the boundaries, the MLP's
        activations (bitsandbytes returns its input's dtype) and the norms are then float32,
        attention and the adapters' kept inputs ``dtype`` (``working_set``).
    head_outputs: the width of the model's output head where it is not the causal LM's
        (None): a sequence classifier's (TRL's reward model's) ``score`` has ``num_labels``
        outputs, so its logits and loss are that narrow, its head that small, no head
        streams with the embedding and no loss is chunked; 0 for a model with no head.
    """

    config: Any
    seq: int
    batch: int
    vram_bytes: int
    quantization: str = "none"
    dtype: Any = torch.bfloat16
    lora_rank: int = 16
    slots: Union[int, str] = AUTO
    bandwidth_gbps: float = DEFAULT_BANDWIDTH_GBPS
    lora_targets: str = "all-linear"
    reserve_bytes: int = DEFAULT_RESERVE_BYTES
    double_quant: bool = True
    arena_bytes: int = DEFAULT_ARENA_BYTES
    stream_embeddings: Union[bool, str] = False
    backward_slots: Union[int, str] = 0
    offload_activations: Union[bool, str] = False
    loss_chunk_tokens: Union[int, str, None] = None
    mlp_tile_tokens: Union[int, str, None] = None
    trl_fused_head: bool = False
    adapter_dtype: Any = torch.float32
    lora_dropout: bool = False
    autocast: bool = False
    lora_parameters: str = ""
    lora_rank_pattern: tuple = ()
    residual_dtype: Any = None
    head_outputs: Optional[int] = None

    def replace(self, **changes) -> "PlanRequest":
        """A copy with some fields changed (an unknown name is a TypeError)."""
        return dataclasses.replace(self, **changes)


def settings_of(stream) -> dict:
    """A StreamConfig's settings that a plan takes, as given: "auto" where StreamConfig chose
    the value itself (slots="auto" becomes 3 there, and stays "auto" here)."""
    automatic = getattr(stream, "automatic", frozenset())
    return {name: AUTO if name in automatic else getattr(stream, name) for name in REQUEST_SETTINGS}


def request_for(settings: Mapping[str, Any], budget: int, **fields) -> PlanRequest:
    """The request of a run with these StreamConfig ``settings`` (by their names, as
    StreamConfig or ``config.parse_setting`` gives them; ``settings_of`` reads a StreamConfig)
    under a vram_budget of ``budget`` bytes; ``fields`` are the request's other fields. How
    a run's "auto" is planned:

    - slots, offload_activations, loss_chunk_tokens, mlp_tile_tokens, stream_embeddings:
      kept "auto", which ``make_plan`` resolves as the run does;
    - backward_slots: under a vram_budget the runtime's "auto" takes none (it leaves the
      budget to the resident window, ``runtime.backward_slots``), so 0.
    A loss chunk or MLP tile of 0 is off, as StreamConfig takes it."""
    values = {name: settings[name] for name in REQUEST_SETTINGS if name in settings}
    for name in ("loss_chunk_tokens", "mlp_tile_tokens"):
        if name in values and values[name] in (0, False):
            values[name] = None
    if values.get("backward_slots") == AUTO:
        values["backward_slots"] = 0
    if "head_outputs" not in fields and "config" in fields:
        fields = dict(fields, head_outputs=head_outputs_of_config(fields["config"]))
    return PlanRequest(**{**fields, **values, "vram_bytes": budget})


CLASSIFIERS = ("ForSequenceClassification", "ForTokenClassification")


def head_outputs_of_config(config) -> Optional[int]:
    """``PlanRequest.head_outputs`` of a checkpoint's config: its labels where every class it
    was saved as is a classifier (a reward model TRL saved), else None (its causal LM)."""
    architectures = getattr(config, "architectures", None) or []
    if architectures and all(name.endswith(CLASSIFIERS) for name in architectures):
        return int(getattr(config, "num_labels", 2))
    return None


def plan_flags(request: PlanRequest, dropout: float = 0.05) -> list:
    """The ``layerstream plan`` flags that describe ``request``'s model and step beyond
    ``--model``, ``--vram-budget``, ``--seq`` and ``--batch`` (where they differ from the
    command's defaults), so an advice line can name a command that plans the run as the
    runtime does; ``dropout``: the value to give ``--lora-dropout`` (the plan only asks
    whether it is above 0). ValueError for what the command has no flags for: adapted
    Parameters, a rank pattern, NF4 without double quantisation."""

    def name(dtype) -> str:
        return str(parse_dtype(dtype)).removeprefix("torch.")

    missing = [
        what
        for what, present in (
            ("adapted Parameters (target_parameters)", request.lora_parameters or request.lora_targets == "none"),
            ("a rank pattern", request.lora_rank_pattern),
            ("NF4 without double quantisation", request.quantization == "nf4" and not request.double_quant),
        )
        if present
    ]
    if missing:
        raise ValueError(f"`layerstream plan` has no flags for {' and '.join(missing)}")
    flags = []
    if request.quantization != "none":
        flags += ["--quantization", request.quantization]
    if name(request.dtype) != "bfloat16":
        flags += ["--dtype", name(request.dtype)]
    if request.residual_dtype is not None and name(request.residual_dtype) != name(request.dtype):
        flags += ["--residual-dtype", name(request.residual_dtype)]
    if request.lora_rank != 16:
        flags += ["--lora-rank", str(request.lora_rank)]
    if request.lora_targets != "all-linear":
        flags += ["--lora-targets", request.lora_targets]
    if name(request.adapter_dtype) != "float32":
        flags += ["--adapter-dtype", name(request.adapter_dtype)]
    if request.lora_dropout:
        flags += ["--lora-dropout", f"{dropout:g}"]
    if request.autocast:
        flags.append("--autocast")
    if request.trl_fused_head:
        flags.append("--trl-fused-head")
    if request.stream_embeddings != AUTO:  # the command's default
        flags += ["--stream-embeddings", str(bool(request.stream_embeddings)).lower()]
    return flags
