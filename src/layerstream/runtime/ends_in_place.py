"""Whether a model whose embedding and head stream still computes through them.

Why: a streamed end computes in its own forward (``embeddings.StreamedEmbedding`` gathers
the rows on the host, ``StreamedHead`` fetches the weight to the device). Code run after
``stream_model`` can go around that forward while the weight it reads stays in host memory:

- replacing the module: transformers' ``resize_token_embeddings`` gives an untied head a
  new ``nn.Linear`` (the embedding keeps its module and takes new data, which the streamed
  end adopts);
- wrapping it in a layer that reads its weight itself instead of calling it: PEFT's
  trainable tokens;
- replacing its forward on the instance: TRL's ``cast_lm_head_to_fp32``.

On a GPU each of these would compute with the host weight: a device error at best, a
computation on the host at worst, and nothing said. ``check`` runs at each forward of the
model, before the embedding, and refuses with what to do. PEFT's LoRA layers (without
DoRA) call their base layer and then add the adapter, so the streamed forward still runs;
so does an instance forward that wraps the module's own (``__wrapped__``, as Accelerate's
hooks leave it).
"""

from __future__ import annotations

from typing import Optional

from torch import nn

from ..errors import StreamingError

_UNSTREAM = "unstream_model(model), make the change, then stream the model again"
_WITHOUT = "stream with stream_embeddings=False"


def _through_lora(module: nn.Module, streamed: nn.Module) -> Optional[nn.Module]:
    """The outermost module of ``module``'s chain of LoRA layers that does not call its base
    layer's forward (DoRA reads the base weight itself), or anything but a LoRA layer on the
    way to ``streamed``; None when calling ``module`` reaches ``streamed``'s forward."""
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:  # no PEFT: nothing wraps the ends the way it does
        LoraLayer = ()
    for _ in range(16):
        if module is streamed:
            return None
        if not isinstance(module, LoraLayer) or any(getattr(module, "use_dora", {}).values()):
            return module
        module = module.base_layer
    return module


def _own_forward_runs(module: nn.Module) -> bool:
    """Whether calling ``module`` runs its class's forward: no instance forward, or one that
    wraps it (``__wrapped__`` down to the bound class forward)."""
    current = module.__dict__.get("forward")
    if current is None:
        return True
    for _ in range(16):
        if getattr(current, "__self__", None) is module and getattr(current, "__func__", None) is type(module).forward:
            return True
        current = getattr(current, "__wrapped__", None)
        if current is None:
            return False
    return False


def _check_one(found: nn.Module, name: str, what: str, current: Optional[nn.Module]) -> None:
    if current is None:
        raise StreamingError(f"the model has no {what} any more, but {name} streams (stream_embeddings): {_UNSTREAM}.")
    outer = _through_lora(current, found)
    if outer is not None and not any(module is found for module in outer.modules()):
        raise StreamingError(
            f"the model's {what} is no longer {name}, which stream_embeddings streams: it is a "
            f"{type(outer).__name__} now (transformers' resize_token_embeddings gives an untied head a new "
            f"module, for example), which would compute with weights layerstream does not hold: {_UNSTREAM}."
        )
    if outer is not None:
        raise StreamingError(
            f"the model's {what} ({name}) is wrapped by {type(outer).__name__}, which computes with the streamed "
            f"weight itself instead of calling the streamed module (PEFT's trainable tokens and DoRA do), and "
            f"that weight is in host memory: leave the {what} out of the adapter's settings, or {_WITHOUT}."
        )
    if not _own_forward_runs(found):
        replaced = getattr(found.__dict__.get("forward"), "__name__", "another function")
        raise StreamingError(
            f"the forward of {name} was replaced on the module ({replaced}), so it would compute with the "
            f"streamed weight itself, which is in host memory (TRL's cast_lm_head_to_fp32 does this): turn "
            f"that option off, or {_WITHOUT}."
        )


def check(ends, model: nn.Module) -> None:
    """Refuse a forward of ``model`` (the outermost transformers model of a streamed one)
    that would go around a streamed end (see the module's docstring)."""
    found = ends.found
    _check_one(found.embedding, found.embedding_name, "input embedding", model.get_input_embeddings())
    if found.head is not None:
        _check_one(found.head, found.head_name, "output head", model.get_output_embeddings())
