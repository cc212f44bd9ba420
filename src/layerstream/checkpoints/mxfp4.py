"""MXFP4 checkpoints (gpt-oss as published), dequantised layer by layer as transformers does.

gpt-oss is published with its expert projections in MXFP4: ``mlp.experts.gate_up_proj_blocks``
(uint8, two FP4 values per byte, 32 values per block), ``mlp.experts.gate_up_proj_scales``
(uint8, one E8M0 exponent per block), the same for ``down_proj``, and a ``quantization_config``
with ``quant_method: "mxfp4"`` in config.json. transformers keeps them in MXFP4 only with its
Triton kernels; without them (no triton or ``kernels`` package, an older GPU), or when a
script passes ``Mxfp4Config(dequantize=True)``, its quantizer (``Mxfp4HfQuantizer``)
dequantises them while loading: ``get_weight_conversions`` gives, per projection, a
``WeightConverter`` from ``[<proj>_blocks, <proj>_scales]`` to the model's ``<proj>``
parameter, whose one operation, ``Mxfp4Dequantize``, calls ``dequantize_convertops`` ->
``convert_moe_packed_tensors`` into the dtype of the parameter it fills (5.17: into that
function's default, bfloat16, whatever the parameter's; see ``packed_experts.dequantised_dtype``).

layerstream streams plain tensors (its slots never hold transformers' Triton tensors), so its
loader always dequantises: it builds that quantizer with ``dequantize=True``, hands it to
transformers' conversion mapping (``checkpoints.conversion``), and so reads each layer's
blocks and scales and dequantises them with transformers' own operation as the layer is
read, one expert at a time, never the whole model. The model it gives is the one
transformers gives when it dequantises: same tensors, and no quantization_config left on
its config.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Mapping, Optional

import torch

from ..system.log import get_logger
from ..units import size

logger = get_logger(__name__)

METHOD = "mxfp4"


def quantization_of(directory: Path) -> Optional[dict]:
    """config.json's quantization_config where it names MXFP4, else None (an unreadable
    config.json is transformers' to report)."""
    try:
        config = json.loads((Path(directory) / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    quantization = config.get("quantization_config") if isinstance(config, dict) else None
    return quantization if isinstance(quantization, dict) and names_mxfp4(quantization) else None


def names_mxfp4(quantization_config) -> bool:
    """Whether a quantization_config (transformers' Mxfp4Config, or its dict) is MXFP4."""
    if isinstance(quantization_config, Mapping):
        method = quantization_config.get("quant_method")
    else:
        method = getattr(quantization_config, "quant_method", None)
    return str(getattr(method, "value", method) or "").lower() == METHOD


def stored_bytes(values: int) -> int:
    """What ``values`` weights take in MXFP4: 4 bits each, and a 1-byte exponent per 32."""
    return values // 2 + values // 32


def asks_dequantise(quantization_config) -> bool:
    """Whether a script's MXFP4 config asks for dequantised experts (``Mxfp4Config(dequantize=True)``)."""
    if isinstance(quantization_config, Mapping):
        return bool(quantization_config.get("dequantize", False))
    return bool(getattr(quantization_config, "dequantize", False))


def keeps_packed(config) -> bool:
    """Whether a model of ``config`` holds its experts packed in MXFP4 (``modules.packed_experts``):
    one loaded so by layerstream (its config carries ``PACKED``), or a checkpoint's config that
    names MXFP4 without asking to dequantise (what the loader keeps packed by default)."""
    if getattr(config, PACKED, False):
        return True
    quantization = getattr(config, "quantization_config", None)
    return quantization is not None and names_mxfp4(quantization) and not asks_dequantise(quantization)


PACKED = "layerstream_packed_experts"  # a config attribute: the experts stay MXFP4 (the planner reads it)


def dequantised_config(config):
    """A copy of ``config`` whose experts are dequantised, as transformers' own load holds
    them (the planner's "transformers load + stream_model" route)."""
    config = copy.deepcopy(config)
    if getattr(config, PACKED, False):
        delattr(config, PACKED)
    quantization = getattr(config, "quantization_config", None)
    if quantization is not None and not isinstance(quantization, Mapping):
        quantization = quantization.to_dict()
    config.quantization_config = {**(quantization or {"quant_method": METHOD}), "dequantize": True}
    return config


def dequantizer(quantization: dict):
    """transformers' quantizer for this pre-quantised MXFP4 checkpoint, set to dequantise (as
    it sets itself without its kernels): what transformers' conversion mapping needs to map
    ``*_blocks`` and ``*_scales`` onto the model's parameters."""
    from transformers import Mxfp4Config
    from transformers.quantizers import AutoHfQuantizer

    config = Mxfp4Config.from_dict(dict(quantization))
    config.dequantize = True
    return AutoHfQuantizer.from_config(config, pre_quantized=True)


def dequantises(converter) -> bool:
    """Whether ``converter`` is transformers' MXFP4 dequantisation alone. Its function,
    ``convert_moe_packed_tensors``, computes each index of the leading (expert) dimension
    from that index's blocks and scales only, so the loader may call it an expert at a time:
    the same values, without a whole projection's dequantised copy beside the layer's own."""
    from transformers.integrations.mxfp4 import Mxfp4Dequantize

    operations = getattr(converter, "operations", None) or ()
    return bool(operations) and all(isinstance(op, Mxfp4Dequantize) for op in operations)


def without_quantization(config):
    """A copy of ``config`` without its quantization_config: transformers removes it from the
    config of a model it dequantised (``remove_quantization_config``)."""
    config = copy.deepcopy(config)
    if getattr(config, "quantization_config", None) is not None:
        del config.quantization_config
    return config


def say_dequantised(directory, dequantised: Mapping[str, torch.Tensor], layers: int) -> None:
    """Say once what dequantising costs in host memory: ``dequantised`` maps each model
    tensor filled from MXFP4 blocks and scales to its (meta) tensor."""
    if not dequantised:
        return
    values = sum(t.numel() for t in dequantised.values())
    dtype = next(iter(dequantised.values())).dtype
    held = sum(t.numel() * t.element_size() for t in dequantised.values())
    stored = stored_bytes(values)
    projections = sorted({name.rsplit(".", 1)[-1] for name in dequantised})
    per_layer = max(layers, 1)
    logger.warning(
        "layerstream: %s stores its experts in MXFP4 (%s); they are dequantised to %s as each layer is "
        "read, with transformers' own dequantisation, as transformers loads them without its MXFP4 kernels "
        "(Mxfp4Config(dequantize=True)). They take %s of host memory per layer where the files hold %s, "
        "%s over the %d layers; the host memory check and `layerstream plan` count them so.",
        directory,
        ", ".join(projections),
        str(dtype).replace("torch.", ""),
        size(held / per_layer),
        size(stored / per_layer),
        size(held),
        layers,
    )


def say_packed(directory, packed: Mapping[str, object], layers: int) -> None:
    """Say once that the experts stay in MXFP4, what they take, and how to dequantise instead
    (``packed``: experts module name -> its ``PackedExperts``)."""
    if not packed:
        return
    per_layer = max(layers, 1)
    dequantised = sum(p.stack_bytes() for p in packed.values())
    stored = sum(stored_bytes(e * i * o) for p in packed.values() for e, i, o in p.shapes.values())
    dtype = str(next(iter(packed.values())).dtype).replace("torch.", "")
    logger.warning(
        "layerstream: %s stores its experts in MXFP4; they stay so in host memory and on their way to the "
        "GPU (%s per layer, %s dequantised), and each experts call dequantises them to %s where it runs, with "
        "transformers' own arithmetic: the values transformers' dequantising load holds, bit for bit. For "
        "dequantised expert Parameters instead (LoRA on the experts needs them), pass "
        "quantization_config=Mxfp4Config(dequantize=True).",
        directory,
        size(stored / per_layer),
        size(dequantised / per_layer),
        dtype,
    )
