"""Harness only. ``trl sft`` and ``accelerate launch`` start the training script in a new
process, which the cap ``capped.py`` set in its own process does not reach; ``capped.py``
puts this directory on PYTHONPATH and its settings in CAPPED_CHILD, and the first Python
process started under it applies the same cap (and the same earlier use of the GPU, and
the step timer) before the script runs. layerstream's own start-up hook, first on the
path, runs this one after itself."""

import json
import os
import sys

_settings = os.environ.pop("CAPPED_CHILD", None)
if _settings:
    _settings = json.loads(_settings)
    sys.path.insert(0, _settings["harness"])
    import capped

    capped.prepare(
        _settings["cap"],
        _settings["used_first"],
        _settings["times"],
        _settings.get("profile"),
        _settings.get("memory_trace"),
        tuple(_settings.get("profile_steps") or capped.PROFILE_STEPS),
        tuple(_settings["trace_decode"]) if _settings.get("trace_decode") else None,
    )
