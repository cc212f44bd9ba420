"""layerstream: stream a transformers model's decoder layers from host memory to the GPU.

Fine-tune (LoRA, QLoRA) and run models larger than the GPU: frozen layer weights live in
pinned host memory and are copied into a few GPU slots just before each layer runs.
"""

from .api import get_runtime, is_streamed, stream_model, unstream_model
from .config import StreamConfig
from .errors import (
    HostMemoryError,
    LayerstreamError,
    LoadingError,
    NoDecoderStackError,
    SlotChecksumError,
    SlotOwnerError,
    StreamConfigError,
    StreamingError,
    TrainConfigError,
)
from .integrations import peft as _peft_integration  # noqa: F401  (registers the PEFT merge integration)
from .integrations.trainer import StreamingArguments, StreamStatsCallback
from .loading import from_pretrained
from .runtime import StreamRuntime

__version__ = "0.1.0"

__all__ = [
    "StreamConfig",
    "StreamConfigError",
    "StreamRuntime",
    "StreamingError",
    "LayerstreamError",
    "HostMemoryError",
    "NoDecoderStackError",
    "StreamingArguments",
    "StreamStatsCallback",
    "LoadingError",
    "TrainConfigError",
    "from_pretrained",
    "SlotChecksumError",
    "SlotOwnerError",
    "get_runtime",
    "is_streamed",
    "stream_model",
    "unstream_model",
]
