"""Under auto-streaming, every causal-LM ``from_pretrained`` loads through layerstream's loader.

Scripts load their model before any Trainer sees it, often straight onto the GPU
(TRL's ``create_model_from_path`` passes ``device_map="auto"`` whenever a GPU is visible,
QLoRA scripts ``device_map={"": rank}``): a model larger than the GPU would fail there,
before streaming could help. So while auto-streaming is on, ``PreTrainedModel.from_pretrained``
of a causal LM (the Auto classes, TRL, PEFT's AutoPeftModelForCausalLM all end there) is
answered by ``layerstream.from_pretrained``: the decoder layers go into the host store one
at a time, NF4 is quantised per layer when the script's BitsAndBytesConfig asks for 4-bit,
and the resident part lands on the device the script asked for, with ``hf_device_map``
and ``is_loaded_in_4bit`` as transformers would set them.

gpt-oss's MXFP4 checkpoints load through the loader too, their experts kept in MXFP4 and
dequantised by each experts call, or dequantised as each layer is read where the script
passes ``Mxfp4Config(dequantize=True)`` (as transformers does then). What the loader cannot read (a
checkpoint pre-quantised otherwise, pickle files, arguments it does not know) is loaded by
transformers itself, on the host
(``device_map="cpu"``, never the whole model on the GPU), then streamed; said once, loudly.
"""

from __future__ import annotations

import re
from typing import Optional

import torch

from ..checkpoints import mxfp4
from ..errors import LoadingError
from ..system.log import get_logger
from . import launch

logger = get_logger(__name__)

_original = None  # PreTrainedModel.__dict__["from_pretrained"] before install
# arguments the loader takes, and arguments that only say how transformers should fetch or
# place the files, which the loader's own reading makes moot
_TAKEN = {
    "dtype",
    "torch_dtype",
    "device_map",
    "quantization_config",
    "attn_implementation",
    "experts_implementation",
    "trust_remote_code",
    "revision",
    "load_in_4bit",
    "load_in_8bit",
    "config",
}
_MOOT = {
    "low_cpu_mem_usage",
    "_from_auto",
    "_from_pipeline",
    "local_files_only",
    "cache_dir",
    "token",
    "force_download",
    "proxies",
    "max_memory",
    "offload_folder",
    "offload_state_dict",
    "offload_buffers",
    "_commit_hash",
    "use_kernels",
}
# arguments that change which files transformers reads; at these values they change nothing
_FILES_AT_DEFAULT = {"variant": (None,), "subfolder": (None, ""), "use_safetensors": (None, True)}


def install() -> None:
    global _original
    from transformers import PreTrainedModel

    if _original is None:
        _original = PreTrainedModel.__dict__["from_pretrained"]
        PreTrainedModel.from_pretrained = classmethod(_from_pretrained)


def uninstall() -> None:
    global _original
    from transformers import PreTrainedModel

    if _original is not None:
        PreTrainedModel.from_pretrained = _original
        _original = None


def _plain(cls, path, *args, **kwargs):
    return _original.__func__(cls, path, *args, **kwargs)


def is_causal_lm(cls) -> bool:
    """A causal LM class: named ``*ForCausalLM``, else one transformers' causal-LM mapping
    holds. The name is checked first: reading the mapping's classes imports every model
    module it names (about 5 s, once per process), which a process loading a Llama need not
    pay."""
    if cls.__name__.endswith("ForCausalLM"):
        return True
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        known = set(MODEL_FOR_CAUSAL_LM_MAPPING.values())
    except Exception:  # a mapping entry that fails to import
        known = set()
    return cls in known


def _from_pretrained(cls, pretrained_model_name_or_path=None, *model_args, **kwargs):
    if (
        not launch.active()
        or model_args
        or pretrained_model_name_or_path is None
        or not is_causal_lm(cls)
        or kwargs.get("state_dict") is not None
        or kwargs.get("gguf_file") is not None
    ):
        return _plain(cls, pretrained_model_name_or_path, *model_args, **kwargs)
    return load(cls, pretrained_model_name_or_path, **kwargs)


def first_sentence(message: str) -> str:
    """A message up to its first full stop that ends a sentence (not one inside a file name
    such as model.safetensors or a path)."""
    return re.split(r"\.\s+", message.strip(), maxsplit=1)[0].rstrip(".")


def _quantization(kwargs):
    from transformers import BitsAndBytesConfig

    config = kwargs.get("quantization_config")
    if config is None and (kwargs.get("load_in_4bit") or kwargs.get("load_in_8bit")):
        config = BitsAndBytesConfig(
            load_in_4bit=bool(kwargs.get("load_in_4bit")), load_in_8bit=bool(kwargs.get("load_in_8bit"))
        )
    return config


def load(cls, path, **kwargs):
    """``cls.from_pretrained(path, **kwargs)`` as a streamed model."""
    from .. import loading
    from ..api import stream_model

    target = launch.device_of_map(kwargs.get("device_map"))
    stream = launch.config_for(target if target is not None else None)
    quantization = _quantization(kwargs)
    # 8-bit, FP4, other quantisers: refused by name; an Mxfp4Config is the loader's to judge
    # (for an MXFP4 checkpoint: dequantize=True dequantises, else the experts stay packed)
    if quantization is not None and not mxfp4.names_mxfp4(quantization):
        loading.nf4_settings(quantization, torch.bfloat16)
    extra = {k: v for k, v in kwargs.items() if k not in _TAKEN and k not in _MOOT}
    for name, defaults in _FILES_AT_DEFAULT.items():  # other files than the loader reads: transformers loads
        if name in extra and extra[name] in defaults:
            del extra[name]
    if "_adapter_model_path" not in (kwargs.get("adapter_kwargs") or {}):
        extra.pop("adapter_kwargs", None)  # no adapter to load with the model (the Auto classes always pass it)
    config = _config(cls, path, kwargs, extra)
    reason = None
    if extra:
        taken = ", ".join(f"{name}={extra[name]!r}" for name in sorted(extra))
        reason = f"the script passes arguments the layerstream loader does not take ({taken})"
    model = None
    if reason is None:
        try:
            model = loading.from_pretrained(
                path,
                dtype=kwargs.get("dtype", kwargs.get("torch_dtype", "auto")) or "auto",
                quantization_config=quantization,
                stream=stream,
                trust_remote_code=bool(kwargs.get("trust_remote_code")),
                revision=kwargs.get("revision"),
                attn_implementation=kwargs.get("attn_implementation"),
                experts_implementation=kwargs.get("experts_implementation"),
                model_class=cls,
                config=config,
            )
        except LoadingError as exc:
            if not getattr(exc, "transformers_can_load", False):
                raise
            reason = f"the layerstream loader cannot read it ({first_sentence(str(exc))})"
    if model is None:
        logger.warning(
            "layerstream: %s: %s; transformers loads it into host memory (device_map='cpu'), "
            "then its layers stream. That needs the whole model in host RAM once.",
            path,
            reason,
        )
        plain = dict(kwargs, device_map="cpu")
        model = _plain(cls, path, **plain)
        model = stream_model(model, stream)
    _place(model, target)
    logger.warning(
        "layerstream: %s loaded streamed: decoder layers in host memory (%s), the rest on %s",
        path,
        "NF4" if getattr(model, "is_loaded_in_4bit", False) else str(model.dtype),
        target if target is not None else "the host until the Trainer places it",
    )
    return model


def _config(cls, path, kwargs, extra):
    """The model's config, with the keyword arguments that set config attributes applied
    (as transformers does); those leave ``extra``."""
    import copy

    config = kwargs.get("config")
    if config is None:
        from transformers import AutoConfig

        try:
            config = AutoConfig.from_pretrained(
                path, trust_remote_code=bool(kwargs.get("trust_remote_code")), revision=kwargs.get("revision")
            )
        except (OSError, ValueError):
            return None  # the loader reports what is wrong with the checkpoint
    config = copy.deepcopy(config)
    for name in [k for k in extra if hasattr(config, k)]:
        setattr(config, name, extra.pop(name))
    return config


def _place(model, target: Optional[torch.device]) -> None:
    """The resident part on the device the script asked for, and ``hf_device_map`` as
    transformers sets it for a model loaded with a device_map."""
    if target is None:
        if hasattr(model, "hf_device_map"):
            del model.hf_device_map
        return
    model.to(target)
    model.hf_device_map = {"": target.index if target.type == "cuda" else target.type}


launch.on_enable(install, uninstall)
