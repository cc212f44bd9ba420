"""Processes a launched command starts (``trl sft`` and ``accelerate launch`` start the
training script anew) stream through the start-up hook in ``layerstream/_site``; every
other Python the command starts inherits the hook too, and must not change: streaming
turns on when a process first imports transformers, never before, and a Python without
layerstream says that its models do not stream instead of failing at start-up."""

import json
import os
import subprocess
import sys
from pathlib import Path

import layerstream

SITE = Path(layerstream.__file__).parent / "_site"


def _child(code: str, tmp_path, extra_path=()):
    env = dict(os.environ)
    env["LAYERSTREAM_AUTOSTREAM"] = json.dumps({"slots": 2, "device": "cpu"})
    env["PYTHONPATH"] = os.pathsep.join([str(SITE), *map(str, extra_path), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout, done.stderr


def test_a_child_that_never_imports_transformers_imports_nothing_of_layerstream_or_torch(tmp_path):
    out, err = _child("import sys; print(sorted(m for m in ('torch', 'layerstream') if m in sys.modules))", tmp_path)
    assert out.strip() == "[]" and "layerstream" not in err


def test_a_child_that_imports_transformers_streams_its_models(tmp_path):
    code = (
        "import transformers\n"
        "from transformers import PreTrainedModel\n"
        "from layerstream.integrations import launch\n"
        "print(launch.active(), PreTrainedModel.from_pretrained.__func__.__name__)\n"
    )
    out, _ = _child(code, tmp_path)
    assert out.split() == ["True", "_from_pretrained"]


def test_asking_whether_transformers_is_installed_leaves_the_hook_for_its_import(tmp_path):
    """Libraries probe with importlib.util.find_spec (TRL's import of itself does) before
    importing transformers; the probe must not use up the hook."""
    code = (
        "import importlib.util, sys\n"
        "assert importlib.util.find_spec('transformers') is not None and 'transformers' not in sys.modules\n"
        "import transformers\n"
        "from layerstream.integrations import launch\n"
        "print(launch.active())\n"
    )
    out, _ = _child(code, tmp_path)
    assert out.strip() == "True"


def test_a_python_without_layerstream_says_its_models_do_not_stream(tmp_path):
    code = (
        "import sys\nsys.modules['layerstream'] = None  # as a Python without it\nimport transformers\nprint('ran')\n"
    )
    out, err = _child(code, tmp_path)
    assert out.strip() == "ran"
    assert "auto-streaming is off in this process" in err and "cannot import layerstream" in err


def test_another_sitecustomize_on_the_path_still_runs(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "sitecustomize.py").write_text("import os\nos.environ['THEIR_HOOK_RAN'] = 'yes'\n")
    out, _ = _child("import os; print(os.environ.get('THEIR_HOOK_RAN'))", tmp_path, extra_path=[theirs])
    assert out.strip() == "yes"
