"""Auto-streaming in processes a launched command starts (``layerstream run trl sft ...``,
``layerstream run accelerate launch ...``): ``layerstream run`` puts this directory first on
PYTHONPATH and its settings in LAYERSTREAM_AUTOSTREAM, and Python imports this module at
start-up. Without that variable it does nothing. Another sitecustomize further along the
path still runs, whatever happens here.

Streaming is turned on at start-up, before the program imports anything: turned on later (at
the first import of transformers), a program importing peft or layerstream first would find
it half on. Every Python the command starts pays that import (a few seconds); a Python
without layerstream says that its models do not stream and runs on.
"""

import os
import sys


def _enable():
    import json

    try:
        from layerstream.integrations import launch
    except ImportError as exc:
        sys.stderr.write(
            f"layerstream: auto-streaming is off in this process: {sys.executable} cannot import "
            f"layerstream ({exc}); its models load and train without streaming\n"
        )
        return
    try:
        launch.enable(json.loads(os.environ["LAYERSTREAM_AUTOSTREAM"]))
    except Exception as exc:  # noqa: BLE001 - a start-up hook must not stop the program; say why
        from layerstream.system.log import get_logger

        get_logger("layerstream.launch").warning(
            "layerstream: auto-streaming is off in this process: %s", exc, main_process_only=False
        )


def _chain():
    """Run the sitecustomize this one shadows, if there is one."""
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        if os.path.abspath(entry or ".") == here:
            continue
        candidate = os.path.join(entry or ".", "sitecustomize.py")
        if os.path.isfile(candidate):
            spec = importlib.util.spec_from_file_location("_layerstream_chained_sitecustomize", candidate)
            spec.loader.exec_module(importlib.util.module_from_spec(spec))
            return


try:
    if os.environ.get("LAYERSTREAM_AUTOSTREAM"):
        _enable()
finally:
    _chain()
