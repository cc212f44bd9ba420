"""decode_allocator_ab.py: its processes alternate the settings, and a process of either model
decodes the tokens the other does."""

import argparse
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import decode_allocator_ab  # noqa: E402


def test_each_model_runs_each_setting_first_in_turn():
    runs = decode_allocator_ab.order(2)
    for model in decode_allocator_ab.MODELS:
        settings = [setting for m, setting in runs if m == model]
        assert settings == ["default", "expandable", "expandable", "default"]


@pytest.mark.parametrize("as_trl", [False, True])
def test_the_streamed_process_decodes_the_resident_tokens(as_trl):
    args = argparse.Namespace(
        shape="tiny", device="cpu", batch=2, prompt_tokens=8, new_tokens=3, calls=1, setting="default", as_trl=as_trl
    )
    records = {
        model: decode_allocator_ab.child(argparse.Namespace(**vars(args), model=model))
        for model in ("resident", "streamed")
    }
    assert records["resident"]["tokens"] == records["streamed"]["tokens"]
    assert all(len(r["decode_ms_per_token_step"]) == 1 for r in records.values())
