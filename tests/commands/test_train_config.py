"""`layerstream train CONFIG.yaml`: the embedded default trains, and a bad config stops
with a clear message before anything is built or written."""

import json
from pathlib import Path

import pytest

from layerstream.commands import cli
from layerstream.commands.train_config import TrainConfigError, load

DEFAULT = Path(__file__).resolve().parents[2] / "configs" / "default.yaml"


def test_the_embedded_default_trains_and_its_loss_falls(tmp_path):
    """Half the default's batch (16): a step costs about a second on a two-core runner (bf16
    autocast on the CPU), and the loss falls as far over the same 30 steps (0.73 against 0.77)."""
    out = tmp_path / "out"
    code = cli.main(
        [
            "train",
            str(DEFAULT),
            "--set",
            f"training.output_dir={out}",
            "--set",
            "training.max_steps=30",
            "--set",
            "training.logging_steps=5",
            "--set",
            "training.per_device_train_batch_size=8",
            "--set",
            "stream.device=cpu",
        ]
    )
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


@pytest.mark.parametrize(
    "text,match",
    [
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
        ("stream: {device: cpu, vram_budget: 900MiB}\n", r"does not fit in 900.00 MiB .* even when streamed"),
        (
            "stream: {device: cpu, backward_slots: -1}\n",
            r"stream: stream.backward_slots must be an integer >= 0 or 'auto'",
        ),
        ("stream: {device: cpu, vram: 8GiB}\n", r"stream.vram is now stream.vram_budget"),
        ("stream: {device: cpu, resident_window: true}\n", r"stream.resident_window is now stream.vram_budget"),
    ],
)
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
    """A 32-layer 4096-wide model at 4 x 4096 tokens in 6 GiB, its ends kept on the GPU: the
    planner's advice comes back naming the YAML keys to change."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "vocab_size": 128256,
                "hidden_size": 4096,
                "intermediate_size": 14336,
                "num_hidden_layers": 32,
                "num_attention_heads": 32,
                "num_key_value_heads": 8,
            }
        )
    )
    path = _write(
        tmp_path,
        f"model: {{name: {model}, dtype: bfloat16}}\n"
        "stream: {device: cpu, vram_budget: 6GiB, slots: 3, stream_embeddings: false}\n"
        "training: {max_length: 4096, per_device_train_batch_size: 4}\n",
    )
    with pytest.raises(TrainConfigError) as error:
        load(str(path), [f"training.output_dir={tmp_path / 'never'}"])
    message = str(error.value)
    assert "does not fit in 6.00 GiB" in message and "batch 4 x 4096 tokens" in message
    assert "model.quantization: nf4" in message and "training.max_length to" in message
    assert "stream.stream_embeddings: true" in message
    assert "--" not in message, "advice must name config keys, not CLI flags"
    assert not (tmp_path / "never").exists()
    fitting = path.read_text().replace("vram_budget: 6GiB", "vram_budget: 80GiB")
    path.write_text(fitting)
    load(str(path), [f"training.output_dir={tmp_path / 'never'}"])


def test_a_vram_budget_keeps_the_layers_that_fit(tmp_path):
    """stream.vram_budget: the embedded model fits whole in 2 GiB, so after the first step
    (measured with no window) its layers stay put and nothing is copied. (Two sequences a step:
    what fits does not depend on the batch, which the default's 16 only makes slower.)"""
    out = tmp_path / "out"
    code = cli.main(
        [
            "train",
            str(DEFAULT),
            "--set",
            f"training.output_dir={out}",
            "--set",
            "training.max_steps=4",
            "--set",
            "training.logging_steps=2",
            "--set",
            "training.per_device_train_batch_size=2",
            "--set",
            "stream.device=cpu",
            "--set",
            "stream.vram_budget=2GiB",
        ]
    )
    assert code == 0
    logged = [e for e in json.loads((out / "trainer_state.json").read_text())["log_history"] if "loss" in e]
    from layerstream.commands.train_config import model_config

    layers = model_config(load(str(DEFAULT), [f"training.output_dir={out}"])).num_hidden_layers
    assert logged[-1]["layerstream/window_layers"] == layers
    assert logged[-1]["layerstream/layer_loads"] == 0, "window layers are not copied"


def test_the_stream_section_has_every_streamconfig_setting_under_its_own_name():
    from layerstream.commands.train_config import SECTIONS
    from layerstream.config import settings

    assert set(SECTIONS["stream"]) == {s.name for s in settings()}


def _bad_value_files(tmp_path):
    """What some bad values point at: a dataset of empty texts, one whose last two rows
    are the only ones with text, a plain file and a directory without config.json."""
    (tmp_path / "empty.jsonl").write_text('{"text": ""}\n{"text": "   "}\n{"text": "\\n"}\n')
    (tmp_path / "tail.jsonl").write_text('{"text": ""}\n{"text": " "}\n{"text": "a"}\n{"text": "b"}\n')
    (tmp_path / "a-file").write_text("not a directory\n")
    (tmp_path / "no-config").mkdir()


BAD_VALUES = [
    (["lora.dropout=high"], r"lora\.dropout='high' must be a number in \[0, 1\)"),
    (["lora.dropout=1.5"], r"lora\.dropout=1\.5 must be a number in \[0, 1\)"),
    (["lora.dropout=true"], r"lora\.dropout=True must be a number"),
    (["lora.alpha=0"], r"lora\.alpha=0 must be an integer >= 1"),
    (["lora.r='8'"], r"lora\.r='8' must be an integer >= 1"),
    (["lora.r=true"], r"lora\.r=True must be an integer >= 1"),
    (["lora.target_modules=[q_projj]"], r"lora\.target_modules: 'q_projj' matches no module .*'q_proj'"),
    (["lora.target_modules=[q_proj, v_projj]"], r"lora\.target_modules: 'v_projj' matches no module"),
    (["lora.target_modules='q_proj, v_proj'"], r"lora\.target_modules: 'q_proj, v_proj' .*regular expression"),
    (["lora.target_modules=[mlp]"], r"lora\.target_modules=\['mlp'\] matches model\.layers\.0\.mlp, a LlamaMLP"),
    (["lora.target_modules=[]"], r"lora\.target_modules=\[\]: write all-linear"),
    (["training.per_device_train_batch_size=0"], r"training\.per_device_train_batch_size=0 must be >= 1"),
    (["training.per_device_eval_batch_size=0"], r"training\.per_device_eval_batch_size=0 must be >= 1"),
    (["training.per_device_train_batch_size='16'"], r"training\.per_device_train_batch_size='16' must be an integer"),
    (["training.learning_rate=fast"], r"training\.learning_rate='fast' must be a number"),
    (["training.learning_rate=-1"], r"training\.learning_rate=-1(\.0)? must be a number >= 0"),
    (["training.max_steps=-5"], r"training\.max_steps=-5 must be >= 1, or -1"),
    (["training.max_steps=0"], r"training\.max_steps=0 must be >= 1, or -1"),
    (["training.max_steps=-1", "training.num_train_epochs=0"], r"training\.num_train_epochs=0(\.0)? trains no step"),
    (["training.gradient_accumulation_steps=0"], r"training\.gradient_accumulation_steps=0 must be >= 1"),
    (["training.max_length=0"], r"training\.max_length=0 must be >= 1"),
    (["training.packing='yes'"], r"training\.packing='yes' must be true or false"),
    (["training.save_strategy=yes"], r"training\.save_strategy=true: YAML reads yes"),
    (["training.eval_strategy=steps", "data.eval_rows=0"], r"training\.eval_strategy='steps' .*data\.eval_rows"),
    (["training.output_dir={tmp}/a-file"], r"training\.output_dir='.*a-file' is an existing file"),
    (["training.output_dir={tmp}/a-file/run"], r"training\.output_dir='.*a-file/run' cannot be created"),
    (["model.name=./no-such-layerstream-model"], r"model\.name='\./no-such-layerstream-model': no such directory"),
    (["model.name=/no/such/model"], r"model\.name='/no/such/model': no such directory"),
    (["model.name=~/no-such-layerstream-model"], r"model\.name='~/no-such-layerstream-model': no such directory"),
    (["model.name=owner/model/revision"], r"model\.name='owner/model/revision': no such directory"),
    (["model.name={tmp}/no-config"], r"model\.name='.*no-config': the directory holds no config\.json"),
    (["model.name={tmp}/no-config", "model.layers=4"], r"model\.layers shapes the embedded tiny model only"),
    (["model.layers=0"], r"model\.layers=0 must be an integer >= 1"),
    (["model.hidden_size='128'"], r"model\.hidden_size='128' must be an integer >= 1"),
    (["model.hidden_size=130"], r"model\.hidden_size=130: .*not a multiple of the number of attention heads"),
    (["model.hidden_size=12"], r"model\.hidden_size=12 gives each of the 4 attention heads an odd width"),
    (["model.trust_remote_code=maybe"], r"model\.trust_remote_code='maybe' must be true or false"),
    (["model.config=missing.json"], r"model\.config='.*missing\.json': no such file"),
    (["data.path={tmp}"], r"dataset file .* is a directory \(data\.path\)"),
    (["data.path=null"], r"data\.path=None must be 'embedded' or a JSON-lines file"),
    (["data.path={tmp}/empty.jsonl", "data.eval_rows=0"], r"empty\.jsonl \(data\.path\): every text is empty"),
    (["data.path={tmp}/tail.jsonl", "data.eval_rows=2"], r"data\.eval_rows=2 leaves only empty texts"),
    (["data.path={tmp}/tail.jsonl", "data.eval_rows=4"], r"data\.eval_rows=4 must be in 0\.\.3"),
    (["data.eval_rows=true"], r"data\.eval_rows=True must be in"),
]


@pytest.mark.parametrize("overrides,match", BAD_VALUES, ids=[" ".join(o) for o, _ in BAD_VALUES])
def test_each_bad_value_is_refused_naming_its_key_before_any_output(tmp_path, overrides, match):
    _bad_value_files(tmp_path)
    out = tmp_path / "never"
    path = _write(tmp_path, f"stream: {{device: cpu}}\ntraining: {{output_dir: {out}}}\n")
    with pytest.raises(TrainConfigError, match=match):
        load(str(path), [o.format(tmp=tmp_path) for o in overrides])
    assert not out.exists()
    assert (tmp_path / "a-file").is_file()


@pytest.mark.parametrize(
    "override",
    [
        "training.per_device_train_batch_size=0",
        "training.learning_rate=fast",
        "training.learning_rate=-1",
        "training.gradient_accumulation_steps=0",
    ],
)
def test_the_command_exits_2_on_a_value_that_used_to_fail_after_making_the_output_dir(tmp_path, capsys, override):
    out = tmp_path / "never"
    with pytest.raises(SystemExit) as exit_info:
        cli.main(
            [
                "train",
                str(DEFAULT),
                "--set",
                f"training.output_dir={out}",
                "--set",
                "stream.device=cpu",
                "--set",
                override,
            ]
        )
    assert exit_info.value.code == 2
    assert override.split("=")[0] in capsys.readouterr().err
    assert not out.exists()


def test_the_stream_section_becomes_one_stream_config_that_the_run_is_given(tmp_path, monkeypatch):
    """The YAML's stream section is turned into a StreamConfig once, when the config is
    checked (the plan of the run included); the run and its training arguments use that one."""
    from layerstream.commands import train_config as train

    made = []
    parse = train.config_from_settings
    monkeypatch.setattr(train, "config_from_settings", lambda *a, **k: made.append(parse(*a, **k)) or made[-1])
    recipe = DEFAULT.parent / "llama-3.1-8b-qlora-8gb.yaml"  # planned: it has a vram_budget
    config = load(str(recipe), [f"training.output_dir={tmp_path / 'never'}", "stream.device=cpu"])
    assert len(made) == 1 and train.stream_config(config) is made[0]
    assert train.training_arguments(config)["use_cpu"] is True and len(made) == 1
    train.parse_stream_section(config)  # negative control: each conversion is counted
    assert len(made) == 2


def test_good_values_in_the_same_keys_still_validate(tmp_path):
    """The negative control: the spellings YAML makes easy (no for save_strategy, 1e-4 as a
    string), names that exist, -1 steps with epochs and a dataset with some empty texts pass."""
    data = tmp_path / "data.jsonl"
    data.write_text('{"text": ""}\n{"text": "Q: hi\\nA: hello"}\n{"text": "more"}\n')
    out = tmp_path / "never"
    config = load(
        str(DEFAULT),
        [
            f"training.output_dir={out}",
            "stream.device=cpu",
            "training.save_strategy=no",
            "training.eval_strategy=no",
            "training.learning_rate=1e-4",
            "training.max_steps=-1",
            "training.num_train_epochs=1",
            "lora.target_modules=[q_proj, v_proj]",
            "lora.dropout=0.05",
            f"data.path={data}",
            "data.eval_rows=1",
        ],
    )
    assert config["training"]["save_strategy"] == "no" and config["training"]["eval_strategy"] == "no"
    assert config["training"]["learning_rate"] == 1e-4
    assert len(config["rows"]) == 3
    load(str(DEFAULT), [f"training.output_dir={out}", "stream.device=cpu", r"lora.target_modules='.*\.(q|v)_proj'"])
    assert not out.exists()


RECIPE_8GB = DEFAULT.parent / "llama-3.1-8b-qlora-8gb.yaml"


def _trains_until_the_tokenizer(path, monkeypatch, caplog, *overrides):
    """Run ``layerstream train`` as far as loading the tokenizer (the first download); what it said."""
    import logging

    import torch
    import transformers

    from layerstream.commands.train import run

    def offline(*args, **kwargs):
        raise RuntimeError("stopped at the download")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", offline)
    config = load(str(path), ["training.output_dir=unused", *overrides])
    with (
        caplog.at_level(logging.WARNING, logger="layerstream.commands.train"),
        pytest.raises(RuntimeError, match="stopped"),
    ):
        run(config)
    return caplog.text


def test_a_gpu_recipe_on_a_machine_without_cuda_says_it_trains_on_the_cpu_before_loading(monkeypatch, caplog):
    said = _trains_until_the_tokenizer(RECIPE_8GB, monkeypatch, caplog)
    assert "no CUDA device is visible, so this run trains on the CPU" in said
    assert "meta-llama/Llama-3.1-8B on the CPU is far slower" in said


def test_a_run_told_to_use_the_cpu_is_not_warned_about_it(monkeypatch, caplog):
    """Negative control: stream.device: cpu is a choice, not a surprise."""
    assert "trains on the CPU" not in _trains_until_the_tokenizer(RECIPE_8GB, monkeypatch, caplog, "stream.device=cpu")


def _adapters_after_one_step(tmp_path, name, seed=0):
    """One step of `layerstream train` on a tiny Llama checkpoint; the adapters it saved."""
    from safetensors.torch import load_file

    from clients import checkpoints, data, harness

    model = tmp_path / "model"
    if not model.exists():
        checkpoints.write("llama", model)
        data.write(tmp_path / "data")
    out = tmp_path / name
    overrides = [f"model.name={model}", f"data.path={tmp_path / 'data' / 'sft.jsonl'}", f"training.output_dir={out}"]
    overrides += ["training.max_steps=1", "training.save_strategy=no", f"training.seed={seed}", "stream.device=cpu"]
    assert cli.main(["train", str(harness.TRAIN_CONFIG)] + [a for o in overrides for a in ("--set", o)]) == 0
    return load_file(out / "adapter_model.safetensors")


def test_a_checkpoints_adapters_are_drawn_from_the_training_seed(tmp_path):
    """Two runs of one config in one process train the same adapters, whatever the process's
    generator held before each (a plain script seeds before get_peft_model); another
    training.seed gives others (the control)."""
    import torch

    torch.manual_seed(1)
    first = _adapters_after_one_step(tmp_path, "first")
    torch.manual_seed(2)
    second = _adapters_after_one_step(tmp_path, "second")
    other = _adapters_after_one_step(tmp_path, "other", seed=1)
    assert first.keys() == second.keys() and first
    assert all(torch.equal(first[key], second[key]) for key in first)
    assert not all(torch.equal(first[key], other[key]) for key in first)
