"""decode_host_cost.py on the CPU: both models decode the same tokens, and the figures it
writes are the ones docs/workloads.md quotes."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import decode_host_cost  # noqa: E402


def test_a_small_run_writes_equal_tokens_and_the_extra_python_calls(tmp_path):
    out = tmp_path / "cost.json"
    argv = ["--layers", "3", "--hidden", "32", "--new-tokens", "3", "--rounds", "1", "--out", str(out)]
    assert decode_host_cost.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["same_tokens"] is True
    assert set(result["median_token_step_ms"]) == {"resident", "streamed"}
    # the streamed model's runtime runs Python of its own at every layer visit
    assert result["extra_python_calls_per_layer_visit"] > 0
    assert result["settings"]["lora"] and result["settings"]["train"]
    assert result["layer_loads_per_call"] == 0  # every layer in the window: nothing copied


def test_nf4_layers_decode_the_same_tokens_streamed_as_bitsandbytes_resident(tmp_path):
    out = tmp_path / "cost.json"
    argv = ["--nf4", "--layers", "3", "--hidden", "64", "--new-tokens", "3", "--rounds", "1", "--out", str(out)]
    assert decode_host_cost.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["same_tokens"] is True and result["settings"]["nf4"]
    assert result["layer_loads_per_call"] == 0
    assert result["extra_python_calls_per_layer_visit"] > 0


def test_a_smaller_window_copies_the_other_layers_each_token_step(tmp_path):
    out = tmp_path / "cost.json"
    # 5 streamed layers through the runtime's 3 slots: each forward copies them in again
    argv = ["--layers", "6", "--hidden", "32", "--new-tokens", "3", "--rounds", "1", "--window", "1"]
    assert decode_host_cost.main([*argv, "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["same_tokens"] is True
    # the profiled call makes 4 new tokens: 4 forwards (the prefill and 3 token steps), each
    # copying the 5 streamed layers in
    assert result["layer_loads_per_call"] == 5 * 4


@pytest.mark.parametrize("name", ["cpu-lora-train.json", "cpu-nf4-lora-train.json"])
def test_the_committed_cpu_result_is_one_this_script_writes(name):
    committed = json.loads((ROOT / "benchmarks/results/decode-host-cost" / name).read_text())
    assert committed["same_tokens"] is True
    assert set(committed) >= {"token_step_ms", "streamed_over_resident", "python_calls_per_call"}


def test_a_window_outside_the_stack_is_refused():
    for window in ("-1", "4"):
        with pytest.raises(SystemExit):
            decode_host_cost.main(["--layers", "3", "--window", window])
