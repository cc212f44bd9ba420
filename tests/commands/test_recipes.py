"""The recipes in configs/: each validates offline (planned from its shipped config.json,
no download), and the figures its header states are the planner's and the committed GPU
measurement's, so they cannot drift from either."""

import json
import re
from pathlib import Path

import pytest
import yaml

from layerstream import plan
from layerstream.commands.train_config import load, planned_run, stream_config
from layerstream.plan.long_settings import LONG_ORDER

ROOT = Path(__file__).resolve().parents[2]
ALL_RECIPES = sorted(p for p in (ROOT / "configs").glob("*.yaml") if p.name != "default.yaml")
# long-context recipes state no figures until benchmarks/long_context.py has measured them
LONG = [p for p in ALL_RECIPES if "-long-" in p.stem]
# recipes that state the plan's figures and no measured ones, until benchmarks/recipes.py runs them
UNMEASURED = [p for p in ALL_RECIPES if p not in LONG and "Not yet measured" in p.read_text()]
RECIPES = [p for p in ALL_RECIPES if p not in LONG and p not in UNMEASURED]
MEASURED = {r["recipe"]: r for r in json.loads((ROOT / "benchmarks/results/recipes.json").read_text())["rows"]}


def test_there_are_recipes_for_the_small_gpus_we_promise():
    names = {p.stem for p in RECIPES}
    assert {"llama-3.1-8b-qlora-8gb", "llama-3.1-70b-qlora-24gb", "qwen2.5-32b-lora-24gb"} <= names
    assert any("mistral" in n for n in names) and any("qwen3" in n for n in names)


def _assert_states_the_plan(name: str, text: str, planned) -> None:
    """The recipe's header states the plan's peak, host store and copy time, as planned."""
    assert planned.fits
    stated = re.search(r"peak VRAM ([\d.]+) GiB, host store ([\d.]+) GiB", text)
    assert stated, f"{name} must state the planned peak and host store"
    assert float(stated.group(1)) == round(planned.peak_vram_bytes / 2**30, 2)
    assert float(stated.group(2)) == round(planned.host_store_bytes / 2**30, 2)
    copies = re.search(r"copies ([\d.]+) s per step at 55 GB/s", text)
    assert copies and float(copies.group(1)) == round(planned.copy_seconds_per_step, 3)


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_recipe_validates_and_states_planned_and_measured_figures(path, tmp_path):
    config = load(str(path), [f"training.output_dir={tmp_path / 'never'}", "stream.device=cpu"])
    model, stream, training = config["model"], config["stream"], config["training"]
    assert model["name"] != "embedded-tiny" and Path(model["config"]).is_file()
    budget = plan.parse_bytes(stream["vram_budget"])
    predicted = plan.make_plan(
        plan.PlanRequest(
            plan.load_config(model["config"]),
            seq=training["max_length"],
            batch=training["per_device_train_batch_size"],
            vram_bytes=budget,
            quantization=model["quantization"],
            dtype=model["dtype"],
            lora_rank=config["lora"]["r"],
            slots=stream["slots"],
        )
    )
    text = path.read_text()
    _assert_states_the_plan(path.name, text, predicted)
    measured = MEASURED[path.stem]
    line = re.search(r"peak ([\d.]+) GiB allocated,\s*#\s*([\d.]+) s per step of (\d+) x (\d+) tokens", text)
    assert line, f"{path.name} must state the measured peak and step time"
    assert float(line.group(1)) == round(measured["peak_allocated_gib"], 2)
    assert float(line.group(2)) == round(measured["step_s"], 3)
    assert (int(line.group(3)), int(line.group(4))) == (measured["batch"], measured["seq"])
    assert (measured["slots"], measured["seq"], measured["quantization"]) == (
        stream["slots"],
        training["max_length"],
        model["quantization"],
    ), "measured with the recipe's settings"
    assert measured["peak_allocated_gib"] < budget / 2**30
    assert abs(measured["peak_allocated_gib"] - predicted.peak_vram_bytes / 2**30) < 0.05 * budget / 2**30, (
        "the plan and the GPU disagree by more than 5% of the budget"
    )


def _long_settings_in_effect(config) -> dict:
    """The long-sequence settings a recipe's steps of max_length run with: as given, or
    what "auto" decides for that length under its budget."""
    stream, training = stream_config(config), config["training"]
    args = plan.PlanRequest(
        config=plan.load_config(config["model"]["config"]),
        seq=training["max_length"],
        batch=training["per_device_train_batch_size"],
        vram_bytes=stream.vram_budget,
        quantization=config["model"]["quantization"],
        dtype=config["model"]["dtype"],
        lora_rank=config["lora"]["r"],
        slots=stream.slots,
        **{name: getattr(stream, name) for name in LONG_ORDER},
    )
    given = {name: getattr(args, name) for name in LONG_ORDER if getattr(args, name) not in (None, False, "auto")}
    return {**given, **dict(plan.decide_for(args, stream.vram_budget).on)}


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_a_measured_recipe_runs_as_measured_without_the_long_sequence_settings(path, tmp_path):
    config = load(str(path), [f"training.output_dir={tmp_path / 'never'}", "stream.device=cpu"])
    assert _long_settings_in_effect(config) == {}, "measured without them: set them off where auto would turn them on"


@pytest.mark.parametrize("path", LONG, ids=lambda p: p.stem)
def test_long_context_recipe_validates_and_claims_no_figure(path, tmp_path):
    config = load(str(path), [f"training.output_dir={tmp_path / 'never'}", "stream.device=cpu"])
    stream, lora = config["stream"], config["lora"]
    assert set(_long_settings_in_effect(config)) == set(LONG_ORDER), "given, or what auto turns on at max_length"
    # layerstream train runs TRL's SFTTrainer, whose fused log-prob head bypasses a loss chunk
    assert "loss_chunk_tokens" not in yaml.safe_load(path.read_text())["stream"]
    assert stream["vram_budget"] == "24GiB" and config["model"]["quantization"] == "nf4"
    assert (lora["r"], lora["target_modules"], lora["dropout"]) == (32, "all-linear", 0.0), "measured without dropout"
    text = path.read_text()
    assert "Not yet measured" in text and not re.search(r"GiB allocated|tokens/s|s per step", text)


def test_long_context_recipes_exist_for_8b_and_70b_on_24gb():
    assert {p.stem for p in LONG} >= {"llama-3.1-8b-qlora-long-24gb", "llama-3.1-70b-qlora-long-24gb"}


@pytest.mark.parametrize("path", UNMEASURED, ids=lambda p: p.stem)
def test_a_recipe_not_yet_measured_states_what_layerstream_train_plans_and_no_measurement(path, tmp_path):
    config = load(str(path), [f"training.output_dir={tmp_path / 'never'}", "stream.device=cpu"])
    planned = planned_run(config, stream_config(config))
    text = path.read_text()
    _assert_states_the_plan(path.name, text, planned)
    assert not re.search(r"GiB allocated|tokens/s|Measured on", text)
    assert path.stem not in MEASURED, "measured: state the measurement"


def test_there_is_a_mixture_of_experts_recipe_for_an_8gb_gpu():
    assert "qwen3-30b-a3b-qlora-8gb" in {p.stem for p in UNMEASURED + RECIPES}
