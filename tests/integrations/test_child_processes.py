"""Processes a launched command starts (``trl sft`` and ``accelerate launch`` start the
training script anew) stream through the start-up hook in ``layerstream/_site``, whatever
the program imports first (peft, layerstream itself); a Python without layerstream says
that its models do not stream instead of failing at start-up, and another sitecustomize on
the path still runs."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import layerstream

SITE = Path(layerstream.__file__).parent / "_site"


def _child(code: str, tmp_path, extra_path=()):
    env = dict(os.environ)
    env["LAYERSTREAM_AUTOSTREAM"] = json.dumps({"slots": 2, "device": "cpu"})
    env["PYTHONPATH"] = os.pathsep.join([str(SITE), *map(str, extra_path), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout, done.stderr


def test_a_child_that_imports_transformers_streams_its_models(tmp_path):
    code = (
        "import transformers\n"
        "from transformers import PreTrainedModel\n"
        "from layerstream.integrations import launch\n"
        "print(launch.active(), PreTrainedModel.from_pretrained.__func__.__name__)\n"
    )
    out, _ = _child(code, tmp_path)
    assert out.split() == ["True", "_from_pretrained"]


@pytest.mark.parametrize("first", ["peft", "layerstream", "trl"])
def test_whatever_a_child_imports_first_its_trainer_streams_a_model_it_was_given(tmp_path, first):
    """peft and layerstream import transformers while they are half imported themselves:
    streaming turned on then would be half on (the Trainer's hook missing)."""
    code = (
        f"import {first}\n"
        "import torch\n"
        "from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments\n"
        "import layerstream\n"
        "shape = dict(hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=2)\n"
        "model = LlamaForCausalLM(LlamaConfig(vocab_size=64, num_hidden_layers=2, **shape)).requires_grad_(False)\n"
        "args = TrainingArguments(output_dir='out', use_cpu=True, report_to=[], max_steps=1)\n"
        "Trainer(model=model, args=args)\n"
        "print(layerstream.is_streamed(model))\n"
    )
    out, err = _child(code, tmp_path)
    assert out.strip().splitlines()[-1] == "True" and "auto-streaming is off" not in err


def test_a_python_without_layerstream_says_its_models_do_not_stream(tmp_path):
    """A Python that finds no layerstream (here one whose path finds a package of that name
    that fails to import) says so and runs the program."""
    fake = tmp_path / "fake" / "layerstream"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('no layerstream in this Python')\n")
    out, err = _child("print('ran')", tmp_path, extra_path=[tmp_path / "fake"])
    assert out.strip() == "ran"
    assert "auto-streaming is off in this process" in err and "cannot import layerstream" in err


def test_another_sitecustomize_on_the_path_still_runs(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "sitecustomize.py").write_text("import os\nos.environ['THEIR_HOOK_RAN'] = 'yes'\n")
    out, _ = _child("import os; print(os.environ.get('THEIR_HOOK_RAN'))", tmp_path, extra_path=[theirs])
    assert out.strip() == "yes"
