"""The planner's decode term: one token step's copies and copy bound, and the batch from
which the frozen layers' compute hides them, pinned against hand computations."""

import json
import math
from pathlib import Path

import pytest
import torch
from model_shapes import LLAMA3_8B, LLAMA3_8B_LAYER_BF16, config_of, write_config

import layerstream
from layerstream.commands import cli
from layerstream.plan import layer_bytes, layer_shapes
from layerstream.plan.decode import active_params, decode_term

from tiny import stream, tiny_model

# Llama-3-8B bf16: 32 layers of 436,224,000 bytes, 218,103,808 linear parameters each
LAYER_LINEAR_PARAMS = 218_103_808


def test_a_token_step_copies_every_layer_once_for_the_whole_batch():
    sizes = [LLAMA3_8B_LAYER_BF16] * 32
    term = decode_term(sizes, slots=3, bandwidth_gbps=55, params=32 * LAYER_LINEAR_PARAMS, tflops=400)
    assert term.layers_copied == 32 and term.copy_bytes == 32 * LLAMA3_8B_LAYER_BF16
    assert term.copy_seconds == 32 * LLAMA3_8B_LAYER_BF16 / 55e9  # 0.254 s
    per_sequence = 2 * 32 * LAYER_LINEAR_PARAMS / 400e12  # 34.9 microseconds
    assert term.compute_bound_batch == math.ceil(term.copy_seconds / per_sequence) == 7274  # 7,273.2 rounded up


def test_every_layer_is_copied_unless_the_slots_hold_them_all_and_no_tflops_gives_no_batch():
    term = decode_term([10, 30, 20, 40], slots=2, bandwidth_gbps=1, params=1)
    assert term.copy_bytes == 100 and term.layers_copied == 4 and term.compute_bound_batch is None
    assert decode_term([10, 20], slots=3, bandwidth_gbps=1, params=1).layers_copied == 0


@pytest.mark.parametrize("slots", [2, 3, 6])
def test_the_planned_copies_of_a_token_step_are_the_runtimes(slots):
    """A forward pass over the layers, as a token step makes one, loads what the plan says."""
    model = tiny_model("llama", layers=6)
    stream(model, slots=slots, prefetch=slots - 1)
    runtime = layerstream.get_runtime(model)
    ids = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        model(ids)
        loads = runtime.stats()["layer_loads"]
        model(ids)
    planned = decode_term([1] * 6, slots=slots, bandwidth_gbps=1, params=1).layers_copied
    assert runtime.stats()["layer_loads"] - loads == planned


def test_layers_the_window_keeps_are_not_copied_and_the_rest_stream_as_before():
    sizes = [10, 30, 20, 40, 50]
    term = decode_term(sizes, slots=2, bandwidth_gbps=1, params=1, kept={1, 3})
    assert term.layers_copied == 3 and term.copy_bytes == 10 + 20 + 50
    assert decode_term(sizes, slots=3, bandwidth_gbps=1, params=1, kept={1, 3}).layers_copied == 0, (
        "the three left fit the slots"
    )
    assert decode_term(sizes, slots=2, bandwidth_gbps=1, params=1).copy_bytes == sum(sizes), "control: no window"


@pytest.mark.parametrize("kept", [[1, 4], [0, 2, 5], [2, 3, 4, 5]])
def test_the_planned_copies_of_a_token_step_with_a_window_are_the_runtimes(kept):
    """With layers in the resident window, a token step loads what the plan says of the rest."""
    model = tiny_model("llama", layers=6)
    stream(model, slots=2, prefetch=1)
    runtime = layerstream.get_runtime(model)
    runtime.set_window(kept)
    ids = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        model(ids)
        loads = runtime.stats()["layer_loads"]
        model(ids)
    planned = decode_term([1] * 6, slots=2, bandwidth_gbps=1, params=1, kept=set(kept)).layers_copied
    assert runtime.stats()["layer_loads"] - loads == planned
    assert planned == (6 - len(kept) if 6 - len(kept) > 2 else 0)


def test_plan_prints_generations_copies_with_the_window_it_keeps(tmp_path, capsys):
    """70B NF4 under 24 GiB at batch 8: the window the plan keeps (``plan.window_layers``,
    the layers ``spread_resident`` picks) copies the other layers per token step."""
    from layerstream.decisions.schedule import spread_resident

    shape = str(Path(__file__).resolve().parents[2] / "configs" / "shapes" / "llama-3.1-70b.json")
    args = ["plan", "--model", shape, "--quantization", "nf4", "--vram-budget", "24GiB", "--batch", "8", "--seq", "256"]
    cli.main(args)
    out = capsys.readouterr().out
    window = int(out.split("the resident window keeps ")[1].split(" of 80 layers on the GPU")[0])
    assert 0 < window < 80
    sizes = layer_bytes(config_of(json.loads(Path(shape).read_text())), "nf4", torch.bfloat16)
    kept = set(spread_resident(80, window))
    term = decode_term(sizes, slots=3, bandwidth_gbps=55, params=1, kept=kept)
    said = " ".join(out.split("the resident window keeps")[-1].split())
    assert f"{window} of 80 layers for generation too" in said
    assert f"{term.layers_copied} layer copies" in said and f"{term.copy_seconds * 1e3:.1f} ms" in said
    assert term.layers_copied == 80 - window
    cli.main([*args[:6], "4GiB", *args[7:]])  # control: no room for a window, no line
    assert "for generation too" not in capsys.readouterr().out


def test_a_mixture_of_experts_computes_with_the_experts_a_token_is_routed_to():
    qwen3_moe = dict(
        model_type="qwen3_moe",
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=256,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
    shapes = layer_shapes(config_of(qwen3_moe))
    attention = (64 * 64 + 2 * 64 * 32 + 64 * 64) * 2  # q, k, v, o in both layers
    router = 8 * 64 * 2
    experts = (8 * 64 * 64 + 8 * 32 * 64) * 2  # gate_up and down stacks, both layers
    assert active_params(shapes) == attention + router + experts * 2 // 8


def test_plan_prints_the_decode_step(tmp_path, capsys):
    path = write_config(tmp_path, LLAMA3_8B)
    assert layer_bytes(config_of(LLAMA3_8B), "none", __import__("torch").bfloat16)[0] == LLAMA3_8B_LAYER_BF16
    cli.main(
        ["plan", "--model", str(path), "--vram-budget", "80GiB", "--seq", "2048", "--slots", "3", "--tflops", "400"]
    )
    out = capsys.readouterr().out
    assert "Generation: one token step of decoding" in out
    assert "32 layer copies (every layer, each step)" in out and "253.8 ms at 55 GB/s" in out
    assert "compute-bound from batch 7274" in out
    cli.main(["plan", "--model", str(path), "--vram-budget", "80GiB", "--seq", "2048", "--slots", "3"])
    assert "--tflops T: the batch from which decoding is compute-bound" in capsys.readouterr().out


def test_a_routed_layer_copies_its_shared_part_and_the_expected_share_of_its_experts():
    """128 experts, 8 per token: one sequence chooses 8 (6.25%); eight are expected to choose
    1 - (120/128)^8 of them (40.3%); 64 copy whole layers."""
    shared, stacks = 1_000_000, 128_000_000
    sizes, routed = [shared + stacks] * 4, [(stacks, 8, 128)] * 4
    one = decode_term(sizes, slots=2, bandwidth_gbps=1, params=1, routed=routed, batch=1)
    assert one.copy_bytes == 4 * (shared + math.ceil(stacks * 8 / 128))
    eight = decode_term(sizes, slots=2, bandwidth_gbps=1, params=1, routed=routed, batch=8)
    assert eight.copy_bytes == 4 * (shared + math.ceil(stacks * (1 - (120 / 128) ** 8)))
    assert decode_term(sizes, slots=2, bandwidth_gbps=1, params=1, routed=routed, batch=64).copy_bytes == 4 * sizes[0]
    assert decode_term(sizes, slots=2, bandwidth_gbps=1, params=1, batch=1).copy_bytes == 4 * sizes[0]


def test_the_compute_bound_batch_counts_the_copies_of_that_batch():
    """Three routed layers copied per token step, 1,000 shared bytes and 128,000 of experts
    (128, 8 per token) each, at 1,000 GB/s; 10,000 parameters at 1 TFLOP/s take 20 ns per
    sequence. By need, batch B copies the shared bytes and the share 1 - (120/128)^B of the
    experts: 157,920 bytes (158 ns) at batch 8, under its 160 ns of compute, and more than
    the compute below it. Whole layers (387,000 bytes, 387 ns) would need 20 sequences."""
    sizes, routed = [1_000 + 128_000] * 3, [(128_000, 8, 128)] * 3
    by_need = decode_term(sizes, slots=1, bandwidth_gbps=1e3, params=10_000, tflops=1, routed=routed)
    assert by_need.copy_bytes == 3 * (1_000 + 8_000) and by_need.compute_bound_batch == 8
    whole = decode_term(sizes, slots=1, bandwidth_gbps=1e3, params=10_000, tflops=1)
    assert whole.compute_bound_batch == 20


def test_the_documented_moe_decode_figures_are_the_tools(capsys):
    """docs/plan.md quotes Qwen3-30B-A3B's token step at batch 1 against whole layers."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    shape = str(root / "configs" / "shapes" / "qwen3-30b-a3b.json")
    common = ["plan", "--model", shape, "--quantization", "nf4", "--vram-budget", "8GiB", "--seq", "2048"]
    figures = []
    for batch in ("1", "64"):
        cli.main(common + ["--batch", batch])
        generation = capsys.readouterr().out.split("Generation:", 1)[1]
        line = next(x for x in generation.splitlines() if "layer copies (" in x)
        figures.append(line.split("GiB")[0].split()[-1])
    page = (root / "docs" / "plan.md").read_text()
    assert f"{figures[0]} GiB per token step where whole layers are {figures[1]} GiB" in page
