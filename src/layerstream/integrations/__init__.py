"""Integrations with the Hugging Face training stack.

Importing this package registers PEFT's merges and the Trainer's hooks with the streaming
core (``api.on_stream``), so every entry point that streams a model imports it first."""

from . import peft, trainer  # noqa: F401  (register with the core)
