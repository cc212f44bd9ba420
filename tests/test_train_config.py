"""`layerstream train CONFIG.yaml`: the embedded default trains, and a bad config stops
with a clear message before anything is built or written."""

import json
from pathlib import Path

import pytest

from layerstream import cli
from layerstream.train import TrainConfigError, load

DEFAULT = Path(__file__).resolve().parents[1] / "configs" / "default.yaml"


def test_the_embedded_default_trains_and_its_loss_falls(tmp_path):
    out = tmp_path / "out"
    code = cli.main(["train", str(DEFAULT), "--set", f"training.output_dir={out}",
                     "--set", "training.max_steps=30", "--set", "training.logging_steps=5",
                     "--set", "stream.device=cpu"])
    assert code == 0
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    losses = [e["loss"] for e in history if "loss" in e]
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.5
    assert all("layerstream/layer_loads" in e for e in history if "loss" in e)
    assert (out / "adapter_model.safetensors").exists()


def _write(tmp_path, text):
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("text,match", [
    ("modle: {}\n", r"unknown section\(s\) \['modle'\]"),
    ("lora: {rank: 8}\n", r"unknown key\(s\) \['rank'\] in 'lora'"),
    ("training: {max_stepz: 3}\n", r"unknown key\(s\) \['max_stepz'\] in 'training'"),
    ("stream: {slots: 1, device: cpu}\n", r"stream: stream.slots=1 is too few"),
    ("stream: {slots: 2, prefetch: 2, device: cpu}\n", r"prefetch must be >= 1 and < slots"),
    ("lora: {r: 0}\n", r"lora.r=0 must be an integer >= 1"),
    ("model: {dtype: float8}\n", r"model.dtype"),
    ("data: {path: /nonexistent/data.jsonl}\n", r"dataset file /nonexistent/data.jsonl does not exist"),
    ("training: {eval_strategy: sometimes}\nstream: {device: cpu}\n", r"training: .*sometimes"),
    ("stream: {device: cpu, vram_budget: 16 gigs}\n", r"stream.vram_budget: unknown unit .gigs."),
    ("stream: {device: cpu, vram_budget: 900MiB}\n", r"does not fit in 0.9 GiB .* even when streamed"),
    ("stream: {device: cpu, backward_slots: -1}\n", r"stream: stream.backward_slots must be an integer >= 0 or 'auto'"),
    ("stream: {device: cpu, vram: 8GiB}\n", r"stream.vram is now stream.vram_budget"),
    ("stream: {device: cpu, resident_window: true}\n", r"stream.resident_window is now stream.vram_budget"),
])
def test_bad_configs_stop_before_any_work(tmp_path, text, match):
    out = tmp_path / "never"
    path = _write(tmp_path, text)
    with pytest.raises(TrainConfigError, match=match):
        load(str(path), [f"training.output_dir={out}"])
    assert not out.exists()


def test_malformed_dataset_rows_are_reported_with_their_line(tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "fine"}\n{"instruction": "no response"}\n')
    path = _write(tmp_path, f"data: {{path: {data}}}\nstream: {{device: cpu}}\n")
    with pytest.raises(TrainConfigError, match=r"data.jsonl:2: each row needs"):
        load(str(path))
    data.write_text('{"text": "fine"}\nnot json\n')
    with pytest.raises(TrainConfigError, match=r"data.jsonl:2: not valid JSON"):
        load(str(path))


def test_the_command_exits_with_the_message_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "never"
    path = _write(tmp_path, "stream: {slots: 1, device: cpu}\n")
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["train", str(path), "--set", f"training.output_dir={out}"])
    assert exit_info.value.code == 2
    assert "slots=1 is too few" in capsys.readouterr().err
    assert not out.exists()


def test_overrides_need_a_section_and_a_key(tmp_path):
    with pytest.raises(TrainConfigError, match="section.key=value"):
        load(str(DEFAULT), ["max_steps=3"])


def test_a_run_that_does_not_fit_says_what_to_change_in_config_terms(tmp_path):
    """A 32-layer 4096-wide model at 4 x 4096 tokens in 6 GiB: the planner's advice comes
    back naming the YAML keys to change."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8}))
    path = _write(tmp_path, f"model: {{name: {model}, dtype: bfloat16}}\n"
                            "stream: {device: cpu, vram_budget: 6GiB, slots: 3}\n"
                            "training: {max_length: 4096, per_device_train_batch_size: 4}\n")
    with pytest.raises(TrainConfigError) as error:
        load(str(path), [f"training.output_dir={tmp_path / 'never'}"])
    message = str(error.value)
    assert "does not fit in 6.0 GiB" in message and "batch 4 x 4096 tokens" in message
    assert "model.quantization: nf4" in message and "training.max_length to" in message
    assert "stream.stream_embeddings: true" in message
    assert "--" not in message, "advice must name config keys, not CLI flags"
    assert not (tmp_path / "never").exists()
    fitting = path.read_text().replace("vram_budget: 6GiB", "vram_budget: 80GiB")
    path.write_text(fitting)
    load(str(path), [f"training.output_dir={tmp_path / 'never'}"])


def test_a_vram_budget_keeps_the_layers_that_fit(tmp_path):
    """stream.vram_budget: the embedded model fits whole in 2 GiB, so after the first step
    (measured with no window) its layers stay put and nothing is copied."""
    out = tmp_path / "out"
    code = cli.main(["train", str(DEFAULT), "--set", f"training.output_dir={out}",
                     "--set", "training.max_steps=4", "--set", "training.logging_steps=2",
                     "--set", "stream.device=cpu", "--set", "stream.vram_budget=2GiB"])
    assert code == 0
    logged = [e for e in json.loads((out / "trainer_state.json").read_text())["log_history"] if "loss" in e]
    from layerstream.train import model_config

    layers = model_config(load(str(DEFAULT), [f"training.output_dir={out}"])).num_hidden_layers
    assert logged[-1]["layerstream/window_layers"] == layers
    assert logged[-1]["layerstream/layer_loads"] == 0, "window layers are not copied"


def test_the_stream_section_has_every_streamconfig_setting_under_its_own_name():
    from layerstream.config import settings
    from layerstream.train import SECTIONS

    assert set(SECTIONS["stream"]) == {s.name for s in settings()}
