"""Auto-streaming: the settings a launcher (``layerstream run``, ``--layer_stream``) gives,
and the device each model streams to.

While auto-streaming is on, every causal-LM ``from_pretrained`` a script makes loads
through layerstream's loader (``autoload``) and every Trainer streams the model it is
given (``trainer``). The settings are kept as the user gave them and turned into a
``StreamConfig`` only when a model is streamed, because the device is known only then:
the one the launcher was told (``--device``), else the one the script asked for
(``device_map``), else the rank's GPU under a distributed launcher, else the current GPU,
else the host; a Trainer whose arguments say another device (``use_cpu``, the rank's
GPU) moves the streamed model there unless ``--device`` was given.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from ..config import StreamConfig, config_from_settings

_settings: Optional[Dict[str, Any]] = None  # the launcher's values, as parse_setting returns them
# (turn on, turn off) of what auto-streaming changes: registered by ``autoload`` (the loader
# behind from_pretrained) and ``trainer`` (the Trainer's hooks), which the package's
# ``__init__`` imports before this module can be used; this module, which they read the
# settings from, imports neither
_switches: List[Tuple[Callable[[], None], Optional[Callable[[], None]]]] = []


def on_enable(turn_on: Callable[[], None], turn_off: Optional[Callable[[], None]] = None) -> None:
    """Call ``turn_on`` at every ``enable`` and ``turn_off`` at every ``disable``."""
    _switches.append((turn_on, turn_off))


def enable(settings: Dict[str, Any]) -> None:
    """Stream every model the script loads or trains from now on, with these settings
    (StreamConfig field -> value); checked now, before the script runs."""
    global _settings
    check = dict(settings)
    check["device"] = check.get("device") or "cpu"  # the device is chosen later; check the rest
    StreamConfig(**check)
    _settings = dict(settings)
    for turn_on, _ in _switches:
        turn_on()


def disable() -> None:
    global _settings
    _settings = None
    for _, turn_off in _switches:
        if turn_off is not None:
            turn_off()


def active() -> bool:
    return _settings is not None


def explicit_device() -> Optional[str]:
    return None if _settings is None else _settings.get("device")


def config_for(device: Optional[torch.device] = None) -> StreamConfig:
    """The launcher's settings as a StreamConfig for a model on ``device`` (when the
    launcher was not told one)."""
    values = dict(_settings or {})
    values["device"] = values.get("device") or device or default_device()
    return config_from_settings({}, **values)


def default_device() -> torch.device:
    """Where a model streams when neither the launcher nor the script says: the device
    Accelerate set up for this process (the rank's GPU; the CPU with ``use_cpu``), else
    the GPU of ``LOCAL_RANK``, else the current GPU, else the host."""
    try:
        from accelerate.state import PartialState

        if PartialState._shared_state:
            return _as_device(PartialState().device)
    except ImportError:  # pragma: no cover - accelerate is a dependency
        pass
    if not torch.cuda.is_available():
        return torch.device("cpu")
    local_rank = os.environ.get("LOCAL_RANK")
    if local_rank is not None and local_rank.isdigit() and int(local_rank) < torch.cuda.device_count():
        return torch.device("cuda", int(local_rank))
    return torch.device("cuda", torch.cuda.current_device())


def device_of_map(device_map) -> Optional[torch.device]:
    """The device a ``from_pretrained(device_map=...)`` asks for: None for no map (the
    model stays on the host until the Trainer places it), the first GPU it names for
    "auto", a dict or a device; the host for "cpu"."""
    if device_map is None:
        return None
    if isinstance(device_map, str) and device_map in ("auto", "balanced", "balanced_low_0", "sequential"):
        return default_device()
    if isinstance(device_map, dict):
        devices = [_as_device(d) for d in device_map.values() if d not in ("disk",)]
        gpus = [d for d in devices if d.type == "cuda"]
        return gpus[0] if gpus else (devices[0] if devices else None)
    return _as_device(device_map)


def _as_device(value) -> torch.device:
    """A device with its index: code that reads ``hf_device_map`` (the Trainer) needs one."""
    if isinstance(value, int):
        return torch.device("cuda", value)
    device = torch.device(value)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)
    return device
