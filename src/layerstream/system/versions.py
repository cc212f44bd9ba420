"""The library versions a result was measured with: the demo prints them and every benchmark
result file records them, so a figure is compared with another only where the versions agree
(or the change is known). Imports no library: reads the installed packages' metadata."""

from __future__ import annotations

import os
import platform
from importlib import metadata

LIBRARIES = ("torch", "transformers", "peft", "accelerate", "bitsandbytes", "trl", "datasets", "safetensors")


def versions() -> dict:
    """Python, the CPU count, layerstream and each library installed, by name."""
    import layerstream  # the package's own version (it may run from a source tree, not installed)

    found = {"python": platform.python_version(), "cpus": os.cpu_count(), "layerstream": layerstream.__version__}
    for name in LIBRARIES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return found
