"""TRL's fused log-prob head: how layerstream recognises it, what it holds in memory, and
how a streamed head reaches it.

TRL >= 1.16's trainers of a causal LM (SFT, DPO, GRPO, RLOO, KTO) call
``trl.trainer.utils.add_fused_lm_head`` on it: an instance ``forward`` that, called with
``fused_lm_head=True``, runs the backbone and computes the per-token log-probabilities
itself, in tiles of ``TOKEN_TILE`` tokens x ``VOCAB_TILE`` vocabulary columns
(``trl.kernels.chunked_logprob``), from ``get_output_embeddings().weight`` read directly.
Neither the model's own forward nor the head module's forward runs then: a
``loss_chunk_tokens`` forward in front of the model's is bypassed, and a streamed head
(``stream_embeddings``), which is fetched to the GPU in its module's forward, would hand
TRL its host weight, so TRL would move the hidden states to the host and compute there.

TRL's loss stays in charge: it is the loss the plain script computes (the same kernel on
the same operands, so the losses are equal), it never holds more than one tile of logits
whatever the vocabulary, and it returns what DPO, GRPO and KTO need beside the loss
(per-token log-probabilities, entropies), which a cross-entropy does not. So layerstream
says that loss_chunk_tokens is not applied, plans TRL's footprint (``footprint_bytes``),
and, for a streamed head, ``get_output_embeddings()`` answers TRL's fused forward (and only
it: ``reads_head_itself``) with a stand-in whose weight is a device copy, fetched once per
call like any other use of the streamed head (``DeviceHead``). Recognising the caller needs
no step at which TRL's head must already be there: TRL adds it after ``Trainer.__init__``,
and DPO computes reference log-probabilities before the first training step.
"""

from __future__ import annotations

import weakref
from typing import Callable, List, Optional

from torch import nn

from ..modules.discovery import unwrap_peft
from ..system.log import get_logger

logger = get_logger(__name__)

TOKEN_TILE = 4096  # trl.kernels.chunked_logprob.TOKEN_CHUNK_SIZE
VOCAB_TILE = 32768  # trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE

_warned: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()
# models (unwrapped from PEFT) whose trainer computes the loss from the model's own forward,
# with full logits, and runs the fused head under no_grad for its metrics only (``note_trainer``)
_full_logits: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


def _is_fused_code(code, globals_: dict) -> bool:
    """``add_fused_lm_head``'s ``_fused_forward``: functools.wraps gave the function the model
    class's name and module, but not its code or globals."""
    return code is not None and code.co_name == "_fused_forward" and globals_.get("__name__", "").startswith("trl.")


def _is_fused_forward(function) -> bool:
    return _is_fused_code(getattr(function, "__code__", None), getattr(function, "__globals__", None) or {})


def _chain(module: nn.Module) -> List:
    """The instance forward of ``module`` and every function it wraps (``__wrapped__``), as
    Accelerate's mixed-precision wrappers leave it."""
    out, current = [], module.__dict__.get("forward")
    while current is not None and len(out) < 16:
        function = getattr(current, "__func__", current)
        out.append(function)
        current = getattr(function, "__wrapped__", None)
    return out


def _fused_modules(model: nn.Module) -> List[nn.Module]:
    """The model, or the transformers model inside its PEFT wrapper, that TRL gave a fused head."""
    candidates = [model] if unwrap_peft(model) is model else [model, unwrap_peft(model)]
    return [m for m in candidates if any(_is_fused_forward(f) for f in _chain(m))]


def installed(model: nn.Module) -> bool:
    """Whether TRL's fused log-prob head computes ``model``'s training loss: TRL gave the
    model its head, and its trainer does not compute the loss from full logits instead."""
    return unwrap_peft(model) not in _full_logits and bool(_fused_modules(model))


def metrics_only(model: nn.Module) -> bool:
    """Whether TRL gave ``model`` its fused head but its trainer computes the loss from full
    logits (``note_trainer``): the head then runs for the metrics alone."""
    return unwrap_peft(model) in _full_logits and bool(_fused_modules(model))


def loss_from_full_logits(trainer) -> bool:
    """Whether TRL's SFTTrainer computes this trainer's loss with the model's own forward and
    full logits, and its fused head only for the metrics (under no_grad): a
    ``compute_loss_func``, or label smoothing with the "nll" loss (TRL's ``compute_loss``)."""
    is_sft = any(c.__name__ == "SFTTrainer" and c.__module__.startswith("trl.") for c in type(trainer).__mro__)
    if not is_sft:
        return False
    args = getattr(trainer, "args", None)
    smoothing = getattr(trainer, "label_smoother", None) is not None and getattr(args, "loss_type", "nll") == "nll"
    return getattr(trainer, "compute_loss_func", None) is not None or smoothing


def note_trainer(trainer) -> None:
    """Remember whether this trainer's models' loss runs on full logits
    (``loss_from_full_logits``); the last trainer made for a model decides."""
    full = loss_from_full_logits(trainer)
    for model in (getattr(trainer, "model", None), getattr(trainer, "ref_model", None)):
        if isinstance(model, nn.Module):
            (_full_logits.add if full else _full_logits.discard)(unwrap_peft(model))


def sft_trainer_fuses_head() -> bool:
    """Whether the installed TRL's SFTTrainer (what ``layerstream train`` runs) adds the fused head."""
    try:
        from trl.trainer import sft_trainer
    except ImportError:
        return False
    return hasattr(sft_trainer, "add_fused_lm_head")


def footprint_bytes(tokens: int, hidden: int, elem: int, residual_elem: Optional[int] = None) -> int:
    """What TRL's fused loss holds at its peak, in its backward, beside the hidden states it
    is given, for ``tokens`` counted tokens in a compute dtype of ``elem`` bytes: its tile
    buffer (min(tokens, TOKEN_TILE) x VOCAB_TILE, whatever the vocabulary), the counted
    tokens' hidden states gathered into a copy, and their gradient accumulated in fp32 and
    cast back. Measured on an H200 (8B's 4096 x 128256 head, bf16): 2.417 GB at 65,536
    tokens against 2.416 GB here, 1.343 GB against 1.342 at 16,384 tokens of a 8192-wide
    model; 0.470 GB against 0.403 at 4096 tokens. ``residual_elem``: the hidden states' bytes
    where wider than the compute dtype (a float32 residual stream: the copy and the cast-back
    gradient are float32 then; from TRL's source, not measured)."""
    hidden_elem = elem if residual_elem is None else residual_elem
    return min(tokens, TOKEN_TILE) * VOCAB_TILE * elem + tokens * hidden * (2 * hidden_elem + 4)


def warn_bypassed(model: nn.Module, loss_chunk_tokens: int) -> None:
    """Said once per model: TRL's loss runs, not the chunked loss the settings asked for."""
    if model in _warned:
        return
    _warned.add(model)
    if metrics_only(model):
        logger.warning(
            "layerstream: this trainer computes its loss (label smoothing, or its compute_loss_func) from the "
            "model's full logits, which it asks for without labels, so loss_chunk_tokens=%d is not applied; "
            "the memory planner counts the full logits.",
            loss_chunk_tokens,
        )
        return
    logger.warning(
        "layerstream: TRL's fused log-prob head computes this trainer's loss (%d tokens x %d vocabulary "
        "columns at a time, no full logits), so loss_chunk_tokens=%d is not applied; the memory planner "
        "counts TRL's loss instead. Leave loss_chunk_tokens unset under TRL's trainers.",
        TOKEN_TILE,
        VOCAB_TILE,
        loss_chunk_tokens,
    )


# -- a streamed head for TRL's loss ---------------------------------------------------------
# TRL's losses other than the fused forward that read the head's weight themselves, by
# (module, function): the distillation trainers' chunked divergence loss, which also moves
# the hidden states to that weight's device (trl 1.16)
_READ_HEAD_WEIGHT = {
    ("trl.trainer.distillation_trainer", "_compute_loss"),
    ("trl.experimental.async_distillation.async_distillation_trainer", "_compute_loss"),
}


def reads_head_itself(frame) -> bool:
    """Whether ``frame`` (the caller of ``get_output_embeddings``) is TRL's fused forward or
    another TRL loss that reads the head's weight itself instead of calling the head."""
    if _is_fused_code(frame.f_code, frame.f_globals):
        return True
    return (frame.f_globals.get("__name__", ""), frame.f_code.co_name) in _READ_HEAD_WEIGHT


class DeviceHead:
    """What ``get_output_embeddings()`` hands TRL's fused forward for a streamed head: the
    head's bias, and its weight as one device copy, fetched at the first read and reused
    for the rest of the call (TRL reads it three times). TRL's kernel keeps it for its
    backward, which runs right after the loss: one head on the GPU through the loss phase."""

    def __init__(self, head: nn.Module, fetch: Callable[[nn.Module], object]):
        self.head, self._fetch, self._weight = head, fetch, None

    @property
    def weight(self):
        if self._weight is None:
            self._weight = self._fetch(self.head)
        return self._weight

    @property
    def bias(self):
        return self.head.bias
