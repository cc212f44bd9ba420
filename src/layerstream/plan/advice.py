"""What would make a plan that does not fit fit: each change with what it saves."""

from __future__ import annotations

from typing import List

from ..units import GiB, size
from .memory import MemoryPlan, _build
from .request import AUTO, PlanRequest
from .shapes import (
    LOSS_LOGIT_COPIES,
    STREAM_EMBEDDINGS_ADVICE,
    STREAM_EMBEDDINGS_ADVICE_SHARE,
    _text_config,
    embedding_bytes,
    model_shape,
)

# the tile the advice and `layerstream plan`'s comparison try when none is given, and the
# longest loss chunk they try
DEFAULT_LONG_TOKENS = 4096
# the shortest loss chunk they try (shorter chunks add launches and save little)
MIN_LOSS_CHUNK_TOKENS = 256
# a default loss chunk's term is at most this (4096 tokens of a 128k vocabulary take 5.9 GiB: half a 12 GiB card)
DEFAULT_LOSS_CHUNK_BYTES = GiB

# the long-sequence options: (plan argument, what `layerstream plan` takes, what it is)
LONG_OPTIONS = (
    ("offload_activations", "--offload-activations", "checkpointed inputs in host memory"),
    ("loss_chunk_tokens", "--loss-chunk-tokens N", "chunked head and cross-entropy"),
    ("mlp_tile_tokens", "--mlp-tile-tokens N", "sequence-tiled MLP"),
)


def default_loss_chunk_tokens(vocab_size: int) -> int:
    """The loss chunk tried when none is given: the largest power of two, at most
    DEFAULT_LONG_TOKENS and at least MIN_LOSS_CHUNK_TOKENS, whose fp32 logits and their
    copies (``LOSS_LOGIT_COPIES x chunk x vocab x 4`` bytes) take at most
    DEFAULT_LOSS_CHUNK_BYTES: 512 for a 128,256 vocabulary, 2048 for 32,000."""
    chunk = DEFAULT_LONG_TOKENS
    while chunk > MIN_LOSS_CHUNK_TOKENS and LOSS_LOGIT_COPIES * chunk * vocab_size * 4 > DEFAULT_LOSS_CHUNK_BYTES:
        chunk //= 2
    return chunk


def _vocab_size(plan_or_request) -> int:
    """The vocabulary of a plan, or of a request's transformers config."""
    if isinstance(plan_or_request, PlanRequest):
        return int(_text_config(plan_or_request.config).vocab_size)
    return plan_or_request.vocab_size


def option_value(name: str, plan_or_request):
    """The value a long-sequence option takes when it is switched on: as given, else (off,
    or "auto") the default (the loss chunk's depends on the vocabulary:
    ``default_loss_chunk_tokens``)."""
    given = getattr(plan_or_request, name)
    if name == "offload_activations":
        return True
    if given and given != AUTO:
        return given
    if name == "loss_chunk_tokens":
        return default_loss_chunk_tokens(_vocab_size(plan_or_request))
    return DEFAULT_LONG_TOKENS


def _long_sequence_advice(plan: MemoryPlan, request: PlanRequest, verdict) -> List[str]:
    out = []
    for name, flag, what in LONG_OPTIONS:
        if getattr(plan, name):
            continue
        if name == "loss_chunk_tokens" and request.head_outputs is not None:
            continue  # a classifier's score: no causal LM loss to chunk (chunked_loss refuses it)
        value = option_value(name, request)
        other = _build(request.replace(slots=plan.slots, **{name: value}))
        saved = plan.peak_vram_bytes - other.peak_vram_bytes
        if saved > 0:
            spelled = flag if name == "offload_activations" else flag.replace("N", str(value))
            extra = f", {size(other.activation_host_bytes)} of host memory" if other.activation_host_bytes else ""
            out.append(f"use {spelled} ({what}): saves {size(saved)}{extra} ({verdict(saved)})")
    return out


def advice(plan: MemoryPlan, request: PlanRequest) -> List[str]:
    """What would make ``plan`` (of ``request``, its "auto" settings decided) fit, each with
    what it saves and whether it is enough."""
    short = -plan.headroom_bytes
    out = [
        f"short by {size(short)}: predicted peak {size(plan.peak_vram_bytes)} + reserve "
        f"{size(plan.reserve_bytes)} > budget {size(plan.vram_bytes)}"
    ]

    def verdict(saved: int) -> str:
        return "enough on its own" if saved >= short else f"not enough alone, still {size(short - saved)} short"

    nf4 = _build(request.replace(quantization="nf4", slots=plan.slots)) if plan.quantization == "none" else None
    saved = plan.peak_vram_bytes - nf4.peak_vram_bytes if nf4 is not None else 0
    if saved > 0:  # NF4 blocks of a tiny layer can take more than its bytes
        out.append(
            f"use --quantization nf4: layers shrink from {size(plan.max_layer_bytes)} to "
            f"{size(nf4.max_layer_bytes)}, saving {size(saved)} over {plan.slots} slots "
            f"({verdict(saved)})"
        )
    if plan.slots > 2:
        saved = (plan.slots - 2) * plan.max_layer_bytes
        out.append(f"use fewer slots: --slots 2 saves {size(saved)} ({verdict(saved)})")
    ends = embedding_bytes(request.config, request.dtype)
    if request.head_outputs is not None:  # a classifier's score is no end that streams: the embedding alone
        ends = model_shape(request.config, request.dtype).embedding.nbytes
    if not plan.stream_embeddings and ends >= STREAM_EMBEDDINGS_ADVICE_SHARE * plan.static_bytes:
        streamed = _build(request.replace(stream_embeddings=True, slots=plan.slots))
        saved = plan.peak_vram_bytes - streamed.peak_vram_bytes
        what, copies = f"the input embedding ({size(ends)}) stays", ""  # a classifier's: no head streams
        if streamed.head_copy_bytes:
            what = f"the input embedding and head ({size(ends)}) stay"
            copies = f"; the head ({size(streamed.head_copy_bytes)}) is then copied to the GPU twice per step"
        if saved > 0:
            out.append(
                f"{STREAM_EMBEDDINGS_ADVICE}: {what} in host memory, saving {size(saved)} ({verdict(saved)}){copies}"
            )
    out.extend(_long_sequence_advice(plan, request, verdict))
    # activations grow linearly with batch x seq; find the largest that fits
    max_tokens = plan.largest_tokens
    if max_tokens // plan.batch >= 1:
        out.append(
            f"reduce --seq to {max_tokens // plan.batch} or less: activations and logits take "
            f"{size(plan.activation_bytes)} at seq {plan.seq} x batch {plan.batch}"
        )
    if plan.batch > 1 and plan.largest_batch >= 1:
        out.append(f"reduce --batch to {plan.largest_batch} or less at seq {plan.seq}")
    if max_tokens < plan.batch:
        out.append(
            f"everything but the activations already takes "
            f"{size(plan.peak_vram_bytes - plan.activation_bytes + plan.reserve_bytes)} "
            "with the reserve: no seq or batch fits without other changes"
        )
    out.append(f"or use a GPU with at least {size(plan.needed_bytes, round_up=True)} for this plan as it is")
    return out
