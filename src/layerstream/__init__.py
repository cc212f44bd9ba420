"""layerstream: stream a transformers model's decoder layers from host memory to the GPU.

Fine-tune (LoRA, QLoRA) and run models larger than the GPU: frozen layer weights live in
pinned host memory and are copied into a few GPU slots just before each layer runs.

The names below are imported when first used, so that ``import layerstream`` and the
``layerstream`` command's ``--help`` and argument errors do not wait for torch and
transformers. Using any of them first loads the integrations (PEFT merges, the Trainer),
which register with the streaming core.
"""

import importlib

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS = {
    "StreamConfig": "config",
    "get_runtime": "api",
    "is_streamed": "api",
    "stream_model": "api",
    "unstream_model": "api",
    "from_pretrained": "loading",
    "StreamRuntime": "runtime.core",
    "StreamingArguments": "integrations.trainer",
    "StreamStatsCallback": "integrations.trainer",
    **{
        name: "errors"
        for name in (
            "HostMemoryError",
            "LayerstreamError",
            "LoadingError",
            "NoDecoderStackError",
            "SlotChecksumError",
            "SlotOwnerError",
            "StreamConfigError",
            "StreamingError",
            "TrainConfigError",
        )
    },
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'layerstream' has no attribute {name!r}")
    importlib.import_module(".integrations", __name__)  # they register before any model streams
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
