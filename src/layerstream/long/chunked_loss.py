"""A causal LM's head and cross-entropy in chunks of tokens (``loss_chunk_tokens``).

Why: at long sequences the fp32 logits (tokens x vocab x 4 bytes) and their gradient are
the largest tensors of a step: 64k tokens of Llama-3's 128k vocabulary are 32 GiB each.
Here the head runs on ``chunk`` tokens at a time: forward sums each chunk's cross-entropy
and, when autograd wants them, takes the chunk's gradients while its logits exist, then
drops them; backward scales those gradients by the one it receives. Only one chunk's
logits exist at any time, and the head's product runs no more often than unchunked.

How it hooks in: the model's class gets a forward in front of its own. With labels and
autograd on, it calls the model's own forward without labels while the head, instead of
computing logits, hands back its input (the final hidden states); the loss is computed
here with the semantics of transformers' ``ForCausalLMLoss``: labels shifted left (or
``shift_labels`` as given), ``ignore_index``, a sum divided by ``num_items_in_batch`` when
the Trainer gives it (gradient accumulation), otherwise the mean over counted tokens.
The output carries the loss and no logits. Without labels, or with autograd off
(evaluation, generation), the model's own forward runs unchanged; so it does, with a
warning, when the model's ``loss_function`` is not transformers' ``ForCausalLMLoss`` (one
the user set): the chunks would compute another loss than the one asked for.

The chunks run the same kernels on the same operands whether the model is streamed or
resident, so the two agree bit for bit; against the unchunked loss the sum runs in
another order (close, not equal). A streamed head (``stream_embeddings``) is copied to
the device once per step, not once per chunk.

Dropout in the head (``lora_dropout`` with LoRA on ``lm_head``) draws each chunk's masks
once, in the forward, where that chunk's gradients are taken: nothing is recomputed, so
there is no random state to replay. The masks are drawn chunk by chunk, so they are not
those of the unchunked head with the same seed.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
from typing import List, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

from ..config import check_tokens
from ..errors import StreamingError
from ..modules import swap
from ..modules.discovery import describe_family, unwrap_peft
from ..system.log import get_logger

logger = get_logger(__name__)

_TOKENS = "_layerstream_loss_chunk_tokens"
_SOFTCAPS = "_layerstream_loss_softcaps"  # the forward softcaps its logits (Gemma-2, Gemma-3)
_capturing: contextvars.ContextVar = contextvars.ContextVar("layerstream_head_capture", default=None)
_warned: set = set()


def _warn_once(key: str, message: str, *args) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning(message, *args)


def warn_liger() -> None:
    _warn_once(
        "liger",
        "layerstream: Liger-Kernel's fused linear cross-entropy computes this model's loss; "
        "loss_chunk_tokens is not applied on top of it.",
    )


def applied(model: nn.Module) -> bool:
    """Whether ``model``'s loss is computed in chunks now (not when a step left it off)."""
    return bool(chunk_tokens(model))


def chunk_tokens(model: nn.Module) -> Optional[int]:
    """The tokens per chunk ``apply`` set on ``model``; None (or 0, a step "auto" left off)
    where the model's own loss runs."""
    return unwrap_peft(model).__dict__.get(_TOKENS)


def set_tokens(model: nn.Module, tokens: int) -> None:
    """The chunk of the next calls of a model ``apply`` prepared; 0: its own forward runs
    (loss_chunk_tokens="auto" decides per call)."""
    object.__setattr__(unwrap_peft(model), _TOKENS, tokens)


def refuse_second_order(setting: str, what: str) -> None:
    """Called first in a backward, which autograd runs with grad mode on only under
    ``create_graph=True`` (gradients of gradients, e.g. a gradient penalty). ``what`` takes
    its gradients without a graph to differentiate again, so the second derivative would
    silently miss terms: refused before any gradient is computed."""
    if torch.is_grad_enabled():
        raise StreamingError(
            f"{setting}: a second derivative (backward with create_graph=True, e.g. a gradient penalty) "
            f"through {what} is not supported: its gradients are computed without a graph, so the "
            f"second-order gradients would be wrong. Leave {setting} unset to differentiate twice."
        )


def autocast_state(device_type: str) -> list:
    """The autocast settings now, for the device type and the CPU, to re-enter in backward."""
    kinds = {device_type, "cpu"}
    return [(k, torch.is_autocast_enabled(k), torch.get_autocast_dtype(k)) for k in sorted(kinds)]


@contextlib.contextmanager
def autocast_as(state: list):
    with contextlib.ExitStack() as stack:
        for kind, enabled, dtype in state:
            stack.enter_context(torch.autocast(kind, dtype=dtype, enabled=enabled))
        yield


def spans(total: int, chunk: int) -> List[tuple]:
    return [(start, min(start + chunk, total)) for start in range(0, total, chunk)]


def _kept(tensor):
    return tensor


def span_graph():
    """Where a span's graph is built: it lives only until its gradients are taken, so
    saved-tensor hooks around the step (TRL's activation_offloading, save_on_cpu) are
    shadowed. They would copy each span's logits or MLP activations to the host and back,
    and hand back as new tensors operands that a resident model passes as Parameters (a
    streamed head's weight), which took other kernels: gradients differed by ~1e-8."""
    return torch.autograd.graph.saved_tensors_hooks(_kept, _kept)


def span_gradients(rows, parts, trainables, wanted, run, grad_rows=None) -> List[Optional[torch.Tensor]]:
    """Gradients taken span by span: for each ``(a, b)`` in ``parts``, ``run(leaf, a, b)``
    on a detached leaf of ``rows[a:b]`` returns an output and the gradient flowing into it.
    The rows' gradients fill their spans of ``grad_rows`` when one is given; the
    ``trainables`` that are ``wanted`` get their gradients summed over the spans in order,
    one order for streamed and resident runs alike. One entry per trainable (None where
    not wanted). The loss chunks and the MLP tiles both take their gradients here."""
    params = [p for p, need in zip(trainables, wanted) if need]
    sums: List[Optional[torch.Tensor]] = [None] * len(params)
    with torch.enable_grad(), span_graph():
        for a, b in parts:
            leaf = rows[a:b].detach().requires_grad_(grad_rows is not None)
            out, grad_out = run(leaf, a, b)
            inputs = ([leaf] if grad_rows is not None else []) + params
            grads = list(torch.autograd.grad(out, inputs, grad_out, allow_unused=True))
            if grad_rows is not None:
                grad_rows[a:b] = grads.pop(0)
            for i, g in enumerate(grads):
                if g is not None:
                    sums[i] = g if sums[i] is None else sums[i] + g
    summed = iter(sums)
    return [next(summed) if need else None for need in wanted]


# -- the head, as the chunks call it ------------------------------------------------------------
class _HeadCall:
    """How each chunk computes its logits: the head module itself, or, for a plain
    ``nn.Linear`` head (streamed, or resident with no hook or forward of its own),
    ``F.linear`` on one weight for all chunks: the streamed head's one device copy, and
    under autocast a frozen weight wider than autocast's dtype cast once (``_cast_once``);
    then the model's softcap, if it has one."""

    def __init__(self, head: nn.Module, softcap: Optional[float] = None):
        self.head, self.softcap = head, softcap
        ends = head.__dict__.get("_layerstream_ends")
        plain = swap.original_class(head).forward is nn.Linear.forward and _unhooked(head)
        streamed = hasattr(ends, "head_weight")
        if streamed and not plain:
            _warn_once(
                "hooked-streamed-head",
                "layerstream: the streamed head has hooks or a forward of its own; loss_chunk_tokens "
                "calls it as a module at each chunk, which copies it in again for every chunk (slower, "
                "exact). Remove the hooks, or set stream_embeddings=False, to copy it once a step.",
            )
        self.ends = ends if streamed and plain else None
        self.plain = plain

    def prepare(self):
        call = self.head
        if self.ends is not None:
            weight = _cast_once(self.ends.head_weight(self.head))
            call = functools.partial(F.linear, weight=weight, bias=self.head.bias)
        elif self.plain and (weight := _cast_once(self.head.weight)) is not self.head.weight:
            call = functools.partial(F.linear, weight=weight, bias=self.head.bias)
        cap = self.softcap
        return call if cap is None else lambda x: softcapped(call(x), cap)


def _unhooked(module: nn.Module) -> bool:
    """Whether calling the module runs only its class's forward on its own parameters: no
    hooks of its own or global ones, no forward set on the instance (accelerate's device
    hooks set one), no parametrization (its weight is computed at each call)."""
    return not (parametrize.is_parametrized(module) or "forward" in module.__dict__ or swap.hooked(module, True))


def _cast_once(weight: torch.Tensor) -> torch.Tensor:
    """The weight as autocast would cast it for ``F.linear``, once for every chunk (a head
    whose weight is a plain frozen tensor, not a parametrization's): autocast caches the
    casts of trainable leaves only, so a frozen float32 head under bf16 autocast (peft's
    ``prepare_model_for_kbit_training`` leaves one) would be cast again at each chunk,
    reading and writing the whole head each time. The same ``to`` autocast runs: the same
    bits; a copy of the head in autocast's dtype, which the memory plan counts."""
    kind = weight.device.type
    if weight.requires_grad or not torch.is_autocast_enabled(kind) or not weight.is_floating_point():
        return weight
    dtype = torch.get_autocast_dtype(kind)
    if weight.dtype in (dtype, torch.float64):  # autocast leaves both as they are
        return weight
    return weight.to(dtype)


def softcapped(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """final_logit_softcapping, the operations of Gemma-2's and Gemma-3's forward in their order."""
    logits = logits / cap
    logits = torch.tanh(logits)
    return logits * cap


def _chunk_loss(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int) -> torch.Tensor:
    return F.cross_entropy(logits.float(), targets, ignore_index=ignore_index, reduction="sum")


class ChunkedCrossEntropy(torch.autograd.Function):
    """sum over chunks of cross_entropy(head(hidden[chunk]).float(), targets[chunk]) / divisor,
    keeping no logits. When a gradient is wanted, each chunk's gradients (of ``hidden`` and
    of the head's trainable tensors) are taken in the forward, while its logits exist, and
    backward scales them by the incoming gradient: the head's product runs once forward and
    once for its gradient, as without chunks, instead of again in backward."""

    @staticmethod
    def forward(ctx, hidden, targets, divisor, head_call, chunk, ignore_index, *trainables):
        counted = targets != ignore_index
        parts = spans(hidden.shape[0], chunk)
        # chunks without a counted token add nothing to the loss or any gradient (one sync)
        active = [s for s, keep in zip(parts, torch.stack([counted[a:b].any() for a, b in parts]).tolist()) if keep]
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        need_hidden = ctx.needs_input_grad[0] and head_call.grad_enabled
        wanted = [need and head_call.grad_enabled for need in ctx.needs_input_grad[6:]]
        grad_hidden = torch.zeros_like(hidden) if need_hidden else None
        call = head_call.prepare()
        if not (need_hidden or any(wanted)):
            with torch.no_grad():
                for a, b in active:
                    total = total + _chunk_loss(call(hidden[a:b]), targets[a:b], ignore_index)
            param_grads = [None] * len(wanted)
        else:
            scale = torch.ones((), dtype=torch.float32, device=hidden.device) / divisor
            losses = []

            def run(leaf, a, b):
                part = _chunk_loss(call(leaf), targets[a:b], ignore_index)
                losses.append(part.detach())
                return part, scale

            param_grads = span_gradients(hidden, active, head_call.trainables, wanted, run, grad_hidden)
            for part in losses:
                total = total + part
        # saved, not kept as a ctx attribute: autograd releases saved tensors once this
        # backward has run, while an attribute would hold the tokens x hidden gradient
        # through every layer's backward, until the loss tensor itself is freed
        ctx.save_for_backward(grad_hidden, *param_grads)
        return total / divisor

    @staticmethod
    def backward(ctx, grad):
        refuse_second_order("loss_chunk_tokens", "the chunked loss")
        grad_hidden, *param_grads = ctx.saved_tensors
        scaled = [None if g is None else g * grad.to(g.dtype) for g in param_grads]
        if grad_hidden is not None:
            grad_hidden = grad_hidden * grad.to(grad_hidden.dtype)
        return (grad_hidden, None, None, None, None, None, *scaled)


def causal_lm_loss(
    head: nn.Module,
    hidden: torch.Tensor,
    labels: Optional[torch.Tensor],
    chunk: int,
    num_items_in_batch=None,
    ignore_index: int = -100,
    shift_labels: Optional[torch.Tensor] = None,
    softcap: Optional[float] = None,
) -> torch.Tensor:
    """transformers' ForCausalLMLoss(head(hidden), labels, ...) computed ``chunk`` tokens at a
    time; ``softcap``: the logits softcapped first, as the model's forward does."""
    if shift_labels is None:
        padded = F.pad(labels, (0, 1), value=ignore_index)
        shift_labels = padded[..., 1:]
    targets = shift_labels.reshape(-1).to(hidden.device)
    flat = hidden.reshape(-1, hidden.shape[-1])
    if flat.shape[0] != targets.numel():
        raise StreamingError(
            f"loss_chunk_tokens: {flat.shape[0]} hidden states but {targets.numel()} labels; "
            "give labels of the input's shape."
        )
    if num_items_in_batch is None:
        divisor = (targets != ignore_index).sum()
    else:
        divisor = torch.as_tensor(num_items_in_batch, device=hidden.device)
    head_call = _HeadCall(head, softcap)
    head_call.trainables = [p for p in head.parameters() if p.requires_grad]
    head_call.grad_enabled = torch.is_grad_enabled()  # a Function's needs_input_grad ignores no_grad
    return ChunkedCrossEntropy.apply(flat, targets, divisor, head_call, chunk, ignore_index, *head_call.trainables)


# -- hooking into the model --------------------------------------------------------------------
class _Capture:
    def __init__(self, head: nn.Module):
        self.head, self.hidden = head, None


@contextlib.contextmanager
def not_capturing():
    """A head call inside the chunked forward that is not the model's own (a check that
    runs the head's forward on a placeholder) computes as it would outside it."""
    token = _capturing.set(None)
    try:
        yield
    finally:
        _capturing.reset(token)


class CapturingHead:
    """Mixed in front of the head's class: while the chunked forward runs the model, the
    head hands back its input instead of logits (an empty placeholder goes on)."""

    def forward(self, input, *args, **kwargs):
        box = _capturing.get()
        if box is not None and box.head is self:
            box.hidden = input
            return input.new_empty((*input.shape[:-1], 0))
        return super().forward(input, *args, **kwargs)


def _from_liger(function) -> bool:
    return (getattr(function, "__module__", "") or "").startswith("liger_kernel")


# Gemma-2's and Gemma-3's softcap between the head and the loss, which the chunks apply too
_SOFTCAP_LINES = [
    "if self.config.final_logit_softcapping is not None:",
    "logits = logits / self.config.final_logit_softcapping",
    "logits = torch.tanh(logits)",
    "logits = logits * self.config.final_logit_softcapping",
]


def liger_computes(model: nn.Module) -> bool:
    """Whether Liger-Kernel's fused linear cross-entropy is the model's forward (bound to the
    model by the Trainer's use_liger_kernel, or patched into its class): its loss runs."""
    inner = unwrap_peft(model)
    bound = getattr(inner.__dict__.get("forward"), "__func__", None)
    return _from_liger(bound) or _from_liger(swap.original_class(inner).forward)


def _check_forward(model: nn.Module, cls: type) -> bool:
    """Only a forward that feeds the head's output straight into ``self.loss_function``
    (Llama, Mistral, Qwen2/3, Phi-3 and most others), or through Gemma-2's and Gemma-3's
    softcap (which the chunks apply the same way), can have its loss chunked: another
    transformation of the logits between the two would be skipped, and so would a loss
    added afterwards (a mixture of experts' router loss). Returns whether it softcaps."""
    source = inspect.getsource(inspect.unwrap(cls.forward))
    lines = [line.strip() for line in source.splitlines()]
    head = [i for i, line in enumerate(lines) if line.startswith("logits = self.lm_head(")]
    loss = [
        i
        for i, line in enumerate(lines)
        if "self.loss_function(" in line
        and ("logits=logits" in line or line.startswith("loss = self.loss_function(logits, labels,"))
    ]
    between = lines[head[0] + 1 : loss[0]] if head and loss and head[0] < loss[0] else None
    if between is not None and "aux_loss" not in source:
        if "logits=logits" in lines[loss[0]] and not any("logits" in line for line in between):
            return False
        if [line for line in between if "logit" in line] == _SOFTCAP_LINES:
            return True
    if "aux_loss" in source:
        why = "a mixture of experts: its forward adds the router's load-balancing loss to the cross-entropy"
    else:
        why = "its forward does not pass the head's output straight to self.loss_function"
    raise StreamingError(
        f"loss_chunk_tokens cannot chunk the loss of {describe_family(model)}: {why}, so a chunked "
        "loss would not be this model's loss. Nothing was changed. Leave loss_chunk_tokens unset for "
        "this model (StreamConfig(loss_chunk_tokens=None); no --loss-chunk-tokens, "
        "--layer_stream_loss_chunk_tokens or stream.loss_chunk_tokens); offload_activations still "
        "lowers the memory of long sequences."
    )


def _forward_mixin(cls: type) -> type:
    """A mixin whose forward keeps ``cls.forward``'s signature (the Trainer reads it to keep
    dataset columns and to pass num_items_in_batch)."""
    signature = inspect.signature(cls.forward)
    varkw = next((p.name for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD), None)

    def forward(self, *args, **kwargs):
        return _chunked_forward(self, mixin, signature, varkw, args, kwargs)

    forward.__signature__ = signature
    forward.__doc__ = cls.forward.__doc__
    mixin = type("ChunkedLoss", (), {"forward": forward})
    return mixin


_MIXINS: dict = {}


def _own_loss(model: nn.Module):
    """The loss the model would compute, where it is not transformers' causal-LM
    cross-entropy (the one the chunks compute): one set with ``model.loss_function = fn``,
    a ``loss_type`` or a subclass's own. None for the default."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    function = getattr(model, "loss_function", ForCausalLMLoss)
    return None if function is ForCausalLMLoss else function


# torch.compile runs this frame eagerly and compiles the model's forward under it: traced, the
# head capture's reset would be part of the trace, and a compilation refused or failed inside
# (a streamed layer is refused there) would leave the head capturing for every later call
@torch.compiler.disable(
    recursive=False,
    reason="loss_chunk_tokens runs its head capture eagerly; compile without fullgraph=True",
)
def _chunked_forward(self, mixin, signature, varkw, args, kwargs):
    inner = super(mixin, self).forward
    if not self.__dict__.get(_TOKENS):  # off for this call (loss_chunk_tokens="auto")
        return inner(*args, **kwargs)
    if _from_liger(getattr(inner, "__func__", inner)):
        warn_liger()
        return inner(*args, **kwargs)
    bound = signature.bind(self, *args, **kwargs)
    values = bound.arguments
    extra = dict(values.get(varkw) or {}) if varkw else {}
    labels, shift_labels = values.get("labels"), extra.get("shift_labels")
    if not torch.is_grad_enabled() or labels is None:  # the model computes no loss then
        if torch.is_grad_enabled():
            _warn_once(
                "nolabels",
                "layerstream: loss_chunk_tokens is set but the model was called without labels, so "
                "it computes the full logits (a custom compute_loss or label smoothing pops them).",
            )
        return inner(*args, **kwargs)
    own = _own_loss(self)
    if own is not None:
        _warn_once(
            f"own-loss:{id(own)}",
            "layerstream: loss_chunk_tokens is not applied: %s.loss_function is %s, not transformers' "
            "ForCausalLMLoss, so the model computes that loss itself over the full logits.",
            type(self).__name__,
            getattr(own, "__qualname__", repr(own)),
        )
        return inner(*args, **kwargs)
    keep = values.get("logits_to_keep", 0)
    if not (isinstance(keep, int) and keep == 0):
        raise StreamingError("loss_chunk_tokens computes the loss over every position; call with logits_to_keep=0.")
    values["labels"] = None
    if varkw:
        values[varkw] = {k: v for k, v in extra.items() if k != "shift_labels"}
    head = self.get_output_embeddings()
    swap.swap_in(head, CapturingHead)
    box = _Capture(head)
    token = _capturing.set(box)
    try:
        out = inner(*bound.args[1:], **bound.kwargs)
    finally:
        _capturing.reset(token)
    if box.hidden is None or isinstance(out, tuple):
        raise StreamingError(
            "loss_chunk_tokens: the model's forward did not call its output head "
            f"({type(head).__name__}) once with the hidden states, or returned a tuple; "
            "call it with return_dict=True, or leave loss_chunk_tokens unset."
        )
    loss = causal_lm_loss(
        head,
        box.hidden,
        labels,
        getattr(self, _TOKENS),
        extra.get("num_items_in_batch"),
        extra.get("ignore_index", -100),
        shift_labels,
        self.config.final_logit_softcapping if self.__dict__.get(_SOFTCAPS) else None,
    )
    fields = {k: v for k, v in out.items() if k != "logits"}
    fields["loss"] = loss
    return type(out)(**fields)


def _liger_bound(inner: nn.Module) -> bool:
    """Liger-Kernel bound its fused forward to the model instance."""
    return inner.__dict__.get("forward") is not None and _from_liger(getattr(inner.forward, "__func__", None))


def check(model: nn.Module, tokens: int) -> bool:
    """Refuse what ``apply`` cannot chunk exactly, before anything changes (``stream_model``
    and ``from_pretrained`` call it before they stream a layer). Returns whether the
    model's forward softcaps its logits (the chunks do it too)."""
    check_tokens("loss_chunk_tokens", tokens)
    inner = unwrap_peft(model)
    cls = swap.original_class(inner)
    softcaps = False
    if not _liger_bound(inner) and not _from_liger(cls.forward):
        softcaps = _check_forward(model, cls)
    if getattr(inner, "get_output_embeddings", lambda: None)() is None:
        raise StreamingError(
            f"loss_chunk_tokens: {describe_family(model)} has no output head (get_output_embeddings). "
            "Nothing was changed. Leave loss_chunk_tokens unset for this model."
        )
    return softcaps


def class_takes_chunks(cls: type) -> bool:
    """Whether a causal LM class's forward lets its loss be chunked, read from its source as
    ``check`` reads it (the planner asks before a model exists: from its config's class)."""
    try:
        _check_forward(None, cls)
    except (StreamingError, OSError, TypeError):
        return False
    return True


def apply(model: nn.Module, tokens: int) -> nn.Module:
    """Compute ``model``'s training loss ``tokens`` tokens at a time (a plain or PEFT-wrapped
    transformers causal LM, streamed or not). Returns the same model."""
    softcaps = check(model, tokens)
    inner = unwrap_peft(model)
    if _liger_bound(inner):
        warn_liger()
    cls = swap.original_class(inner)
    mixin = _MIXINS.get(cls) or _MIXINS.setdefault(cls, _forward_mixin(cls))
    swap.swap_in(inner, mixin)
    object.__setattr__(inner, _TOKENS, tokens)
    object.__setattr__(inner, _SOFTCAPS, softcaps)
    return model


def remove(model: nn.Module) -> nn.Module:
    """Undo ``apply``: the model's own forward computes the loss again."""
    inner = unwrap_peft(model)
    mixin = _MIXINS.get(swap.original_class(inner))
    if mixin is not None:
        swap.swap_out(inner, mixin)
    inner.__dict__.pop(_TOKENS, None)
    inner.__dict__.pop(_SOFTCAPS, None)
    head = inner.get_output_embeddings()
    if head is not None:
        swap.swap_out(head, CapturingHead)
    return model
