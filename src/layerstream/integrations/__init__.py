"""Integrations with the Hugging Face training stack.

Importing this package registers PEFT's merges, the Trainer's hooks and the counting of
generation with the streaming core (``api.on_stream``), so every entry point that streams a model imports it first."""

from . import autoload, generation, peft, trainer  # noqa: F401  (register with the core and the launcher)
