"""The planner's decode term: one token step's copies and copy bound, and the batch from
which the frozen layers' compute hides them, pinned against hand computations."""

import math

from test_plan import LLAMA3_8B, LLAMA3_8B_LAYER_BF16, config_of, write_config

from layerstream.commands import cli
from layerstream.plan import layer_bytes, layer_shapes
from layerstream.plan.decode import active_params, decode_term

# Llama-3-8B bf16: 32 layers of 436,224,000 bytes, 218,103,808 linear parameters each
LAYER_LINEAR_PARAMS = 218_103_808


def test_a_token_step_copies_every_layer_but_the_slots_once_for_the_whole_batch():
    sizes = [LLAMA3_8B_LAYER_BF16] * 32
    term = decode_term(sizes, slots=3, bandwidth_gbps=55, params=32 * LAYER_LINEAR_PARAMS, tflops=400)
    assert term.layers_copied == 29 and term.copy_bytes == 29 * LLAMA3_8B_LAYER_BF16
    assert term.copy_seconds == 29 * LLAMA3_8B_LAYER_BF16 / 55e9  # 0.230 s
    per_sequence = 2 * 32 * LAYER_LINEAR_PARAMS / 400e12  # 34.9 microseconds
    assert term.compute_bound_batch == math.ceil(term.copy_seconds / per_sequence) == 6592  # 6,591.3 rounded up


def test_uneven_layers_count_the_largest_as_copied_and_no_tflops_gives_no_batch():
    term = decode_term([10, 30, 20, 40], slots=2, bandwidth_gbps=1, params=1)
    assert term.copy_bytes == 30 + 40 and term.compute_bound_batch is None
    assert decode_term([10, 20], slots=3, bandwidth_gbps=1, params=1).layers_copied == 0


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
    assert "29 layer copies (32 - 3 slots)" in out and "230.0 ms at 55 GB/s" in out
    assert "compute-bound from batch 6592" in out
    cli.main(["plan", "--model", str(path), "--vram-budget", "80GiB", "--seq", "2048", "--slots", "3"])
    assert "--tflops T: the batch from which decoding is compute-bound" in capsys.readouterr().out


def test_a_routed_layer_copies_its_shared_part_and_the_expected_share_of_its_experts():
    """128 experts, 8 per token: one sequence chooses 8 (6.25%); eight are expected to choose
    1 - (120/128)^8 of them (40.3%); 64 copy whole layers."""
    shared, stacks = 1_000_000, 128_000_000
    sizes, routed = [shared + stacks] * 4, [(stacks, 8, 128)] * 4
    one = decode_term(sizes, slots=2, bandwidth_gbps=1, params=1, routed=routed, batch=1)
    assert one.copy_bytes == 2 * (shared + math.ceil(stacks * 8 / 128))
    eight = decode_term(sizes, slots=2, bandwidth_gbps=1, params=1, routed=routed, batch=8)
    assert eight.copy_bytes == 2 * (shared + math.ceil(stacks * (1 - (120 / 128) ** 8)))
    assert decode_term(sizes, slots=2, bandwidth_gbps=1, params=1, routed=routed, batch=64).copy_bytes == 2 * sizes[0]
    assert decode_term(sizes, slots=2, bandwidth_gbps=1, params=1, batch=1).copy_bytes == 2 * sizes[0]


def test_the_compute_bound_batch_counts_the_copies_of_that_batch():
    """Two routed layers copied per token step, 1,000 shared bytes and 128,000 of experts
    each, at 1,000 GB/s; 10,000 parameters at 1 TFLOP/s take 20 ns per sequence. By need
    one sequence copies 18,000 bytes (18 ns): compute-bound from batch 1. Whole layers
    (258,000 bytes, 258 ns) would need 13 sequences."""
    sizes, routed = [1_000 + 128_000] * 3, [(128_000, 8, 128)] * 3
    by_need = decode_term(sizes, slots=1, bandwidth_gbps=1e3, params=10_000, tflops=1, routed=routed)
    assert by_need.copy_bytes == 18_000 and by_need.compute_bound_batch == 1
    whole = decode_term(sizes, slots=1, bandwidth_gbps=1e3, params=10_000, tflops=1)
    assert whole.compute_bound_batch == 13


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
