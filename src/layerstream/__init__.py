"""layerstream: stream a transformers model's decoder layers from host memory to the GPU.

Fine-tune (LoRA, QLoRA) and run models larger than the GPU: frozen layer weights live in
pinned host memory and are copied into a few GPU slots just before each layer runs.
"""

from .api import get_runtime, is_streamed, stream_model, unstream_model
from .config import StreamConfig, StreamConfigError
from .discovery import NoDecoderStackError
from .integrations.trainer import StreamingArguments, StreamStatsCallback
from .loading import LoadingError, from_pretrained
from .checksum import SlotChecksumError
from .pool import SlotOwnerError
from .runtime import StreamingError, StreamRuntime

__version__ = "0.1.0"

__all__ = [
    "StreamConfig",
    "StreamConfigError",
    "StreamRuntime",
    "StreamingError",
    "NoDecoderStackError",
    "StreamingArguments",
    "StreamStatsCallback",
    "LoadingError",
    "from_pretrained",
    "SlotChecksumError",
    "SlotOwnerError",
    "get_runtime",
    "is_streamed",
    "stream_model",
    "unstream_model",
]
