"""Auto-streaming in processes a launched command starts (``layerstream run trl sft ...``,
``layerstream run accelerate launch ...``): ``layerstream run`` puts this directory first on
PYTHONPATH and its settings in LAYERSTREAM_AUTOSTREAM, and Python imports this module at
start-up. Without that variable it does nothing. Another sitecustomize further along the
path still runs.

Streaming is turned on when the process first imports transformers, not at start-up: every
Python the command starts inherits the variable (a shell's ``python -c``, a DataLoader
worker spawned anew, a tool of another Python), and one that never loads a model should
neither import torch nor change. A Python without layerstream says once, when it imports
transformers, that its models do not stream.
"""

import importlib.abc
import importlib.util
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


class _EnableAfter:
    """transformers' own loader, then ``_enable`` once the package has run; anything else
    asked of it (resource readers, ``get_data``) is the wrapped loader's."""

    def __init__(self, loader, finder):
        self.loader, self.finder = loader, finder

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        if self.finder in sys.meta_path:
            sys.meta_path.remove(self.finder)
        _enable()

    def __getattr__(self, name):
        return getattr(self.loader, name)


class _WhenTransformersIsImported(importlib.abc.MetaPathFinder):
    """Finds nothing itself: asked for transformers, it lets the other finders find it and
    wraps the loader they give. It stays until transformers is imported: a library asking
    whether transformers is installed (``importlib.util.find_spec``) finds it too."""

    def find_spec(self, name, path=None, target=None):
        if name != "transformers":
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(name, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _EnableAfter(spec.loader, self)
                return spec
        return None


def _chain():
    """Run the sitecustomize this one shadows, if there is one."""
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        if os.path.abspath(entry or ".") == here:
            continue
        candidate = os.path.join(entry or ".", "sitecustomize.py")
        if os.path.isfile(candidate):
            spec = importlib.util.spec_from_file_location("_layerstream_chained_sitecustomize", candidate)
            spec.loader.exec_module(importlib.util.module_from_spec(spec))
            return


if os.environ.get("LAYERSTREAM_AUTOSTREAM"):
    if "transformers" in sys.modules:  # imported before this hook ran (another sitecustomize, a .pth)
        _enable()
    else:
        sys.meta_path.insert(0, _WhenTransformersIsImported())
_chain()
