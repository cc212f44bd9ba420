"""Local paths and hub ids: a model name that can only mean a local path, and names no such
directory, is a typo. It is reported as one ("no such directory"), never sent to the hub,
whose answer ("Repo id must be in the form ...") does not say what is wrong."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Optional, Union


def looks_local(model_id: Union[str, os.PathLike]) -> bool:
    """Whether ``model_id`` can only mean a local path: a hub id is ``name`` or ``org/name``.

    A path object, an absolute path, one starting with ``./``, ``../`` or ``~``, one with a
    backslash or more than one ``/``, or one whose first component is a local directory.
    """
    if isinstance(model_id, os.PathLike):
        return True
    text = str(model_id)
    return (
        Path(text).is_absolute()
        or text.startswith(("./", "../", "~"))
        or "\\" in text
        or text.count("/") > 1
        or Path(text.split("/", 1)[0]).is_dir()
    )


def missing_directory(model_id: Union[str, os.PathLike]) -> Optional[str]:
    """The message for a local-looking ``model_id`` that names no directory, else None."""
    if not looks_local(model_id) or Path(model_id).expanduser().exists():
        return None
    return (
        f"no such directory: {model_id}; pass a directory that holds config.json and the "
        "weights, or a hub id like org/name"
    )


# huggingface_hub's validate_repo_id quotes the id last: "...: './models/llama'. Use ..."
_QUOTED_ID = re.compile(r": '(.+)'\.")


def missing_directory_behind(error: BaseException) -> Optional[str]:
    """The "no such directory" message for an error of transformers or huggingface_hub that
    was raised because a mistyped local path was taken for a hub id (transformers' loaders
    send any name that is not a directory to the hub), else None."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if type(error).__name__ == "HFValidationError":
            found = _QUOTED_ID.search(str(error))
            return missing_directory(found.group(1)) if found else None
        error = error.__cause__ or error.__context__
    return None
