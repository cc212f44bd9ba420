"""The TRL recipes in configs/trl/: config files for TRL's own scripts, run unchanged behind
``layerstream run``. Each names only keys its script knows, and the GRPO recipe, with the
tiny model, the shipped prompts and a reward that needs nothing installed in place of its
model, data and reward (and on the CPU: no 4-bit, full precision, short completions), trains
under ``layerstream run`` exactly as the plain script does."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from layerstream.integrations import launch

from clients import checkpoints, data
from clients.harness import Client, assert_same_runs

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted((ROOT / "configs" / "trl").glob("*.yaml"))
ON_THE_CPU = ["--bf16", "false", "--use_cpu", "true"]


@pytest.fixture(autouse=True)
def _auto_streaming_off():
    yield
    launch.disable()


def _script(recipe: Path) -> str:
    """The TRL script a recipe is for: the first word of its file name (grpo-...yaml)."""
    return recipe.name.split("-", 1)[0]


def test_there_are_trl_recipes_and_each_names_its_command():
    assert RECIPES, "configs/trl/ holds no recipe"
    for recipe in RECIPES:
        command = f"layerstream run -m trl.scripts.{_script(recipe)} --config configs/trl/{recipe.name}"
        assert command in recipe.read_text(), f"{recipe.name}'s header does not give its command"


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_each_recipe_names_only_keys_its_script_knows(recipe):
    import importlib

    parser = importlib.import_module(f"trl.scripts.{_script(recipe)}").make_parser()
    parser.parse_args_and_config(args=["--config", str(recipe), *ON_THE_CPU], fail_with_unknown_args=True)


def test_the_grpo_recipe_trains_behind_the_launcher_as_the_plain_script_does(tmp_path):
    (recipe,) = [r for r in RECIPES if _script(r) == "grpo"]
    model = checkpoints.write("llama", tmp_path / "model")
    data_dir = data.write(tmp_path / "data")
    client = Client("script", "grpo")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: two threads on a busy 2-core runner wait on each other

    def argv(out: Path) -> list:
        # the harness's arguments (model, data, 3 steps of 2 completions of 8 tokens, a
        # reward with no dependency) after the recipe: the command line wins over the file
        given = client.argv(model, data_dir, out, "lora", (), "cpu")
        return ["--config", str(recipe), *given, "--load_in_4bit", "false", "--bf16", "false"]

    try:
        client.run_plain(argv(tmp_path / "plain"))
        client.run_streamed(argv(tmp_path / "streamed"))
    finally:
        torch.set_num_threads(threads)
    assert_same_runs(tmp_path / "plain", tmp_path / "streamed")
