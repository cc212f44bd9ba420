"""The memory plan: its terms, the measured peaks it matches, copies, slots, advice,
streamed embedding and head, the window and speed hints.

Expected numbers are derived by hand in the comments (or counted from real objects:
the engine's own host-store layout, PEFT's adapters, bitsandbytes' quant state), never
by calling the function under test.
"""

import json

import pytest
import torch
from model_shapes import (
    LLAMA3_8B,
    LLAMA3_8B_LAYER_BF16,
    LLAMA3_8B_LORA_PARAMS,
    LLAMA3_8B_RESIDENT,
    LLAMA3_8B_ROTARY,
    MISTRAL_7B,
    QWEN3_MOE_SMALL,
    RESULTS,
    config_of,
    tiny,
)
from transformers import AutoConfig, AutoModelForCausalLM

from layerstream.decisions.schedule import Phase, PrefetchSchedule
from layerstream.plan import (
    BACKWARD_SLOTS_MAX,
    GiB,
    PlanRequest,
    backward_slot_count,
    format_plan,
    make_plan,
    speed_hints,
)

# -- the plan ----------------------------------------------------------------------------
# Llama-3-8B, seq 2048, batch 1, bf16, LoRA r=16 all-linear, by hand:
#   boundary states: 32 x 2048 x 4096 x 2           =   536,870,912
#   loss: 3 x 2048 x 128256 x 4 (fp32 logits)       = 3,152,019,456
#   one layer's working set, the larger of its two phases (plan/working_set.py), per token:
#     attention's saved tensors: fp32 norm inputs 8x4096 + q,k,v,out (2x4096+2x1024)x2 +
#       LoRA fp32 inputs of q,k,v,o 4x4x4096 = 118,784
#     the MLP's phase: those + MLP input, its gradient, the incoming one 3x4096x2 + the MLP
#       (gate, up, activation, product) 4x14336x2 + LoRA fp32 inputs of gate, up, down
#       4x(4096+4096+14336) = 143,360 + 204,800 = 348,160 -> x2048 = 713,031,680
#     attention's phase: 118,784 - the second norm's 4x4096 - o_proj's LoRA input 4x4096 +
#       attention's backward (fp32 dq 4x4096, dq/d_out/dk/dv (2x4096+2x1024)x2, GQA-wide
#       dk/dv 2x4096x2) 53,248 + the residual's gradient 4096x2 = 147,456 (smaller)
#   LoRA weights + grads + AdamW: 41,943,040 x 16      =   671,088,640
#   everything but the slots: 2,101,355,008 + 671,088,640 + 536,870,912 + 3,152,019,456
LLAMA3_8B_FIXED = 6_461_334_016


def test_llama3_8b_plan_terms():
    plan = make_plan(PlanRequest(config_of(LLAMA3_8B), 2048, 1, 80 * GiB, slots=2))
    assert plan.boundary_bytes == 536_870_912
    assert plan.loss_bytes == 3_152_019_456
    assert plan.layer_working_bytes == 713_031_680
    assert plan.peak_vram_bytes == LLAMA3_8B_FIXED + 2 * LLAMA3_8B_LAYER_BF16
    assert plan.host_store_bytes == 32 * LLAMA3_8B_LAYER_BF16
    # stream_model fills its arenas layer by layer (freeing each loaded layer) and pins
    # afterwards: store + one loaded layer + resident part + the fp32 adapters
    assert plan.host_ram_bytes == (33 * LLAMA3_8B_LAYER_BF16 + LLAMA3_8B_RESIDENT + LLAMA3_8B_LORA_PARAMS * 4)
    assert plan.host_steady_bytes == 32 * LLAMA3_8B_LAYER_BF16
    # layerstream.from_pretrained: arenas of two whole 436,224,000 B layers (1 GiB holds
    # two), so no gap: 32 x 436,224,000 = 13,959,168,000. Peak: + resident + one layer
    assert plan.loader_store_bytes == 13_959_168_000
    assert plan.loader_ram_bytes == 13_959_168_000 + LLAMA3_8B_RESIDENT + LLAMA3_8B_LAYER_BF16


def test_nf4_working_set_counts_the_dequantised_weights_autograd_keeps():
    import bitsandbytes as bnb

    from layerstream.modules import nf4

    # what a streamed NF4 projection keeps for backward at training sizes: the
    # dequantised weight, in the compute dtype
    weight = bnb.nn.Params4bit(
        torch.randn(512, 256, dtype=torch.bfloat16), requires_grad=False, quant_type="nf4", compress_statistics=True
    ).to("cpu")
    x = torch.randn(64, 256, dtype=torch.bfloat16, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        nf4.dequantized_linear(x, weight.data.view(-1, 1), weight.quant_state, None)
    assert (
        sum(t.numel() * t.element_size() for t in saved if t.dtype == torch.bfloat16 and sorted(t.shape) == [256, 512])
        == 512 * 256 * 2
    )
    # and the plan counts one layer's linear weights in bf16 for it
    bf16 = make_plan(PlanRequest(config_of(LLAMA3_8B), 2048, 1, 80 * GiB, slots=2))
    quantised = make_plan(PlanRequest(config_of(LLAMA3_8B), 2048, 1, 80 * GiB, slots=2, quantization="nf4"))
    assert quantised.layer_working_bytes - bf16.layer_working_bytes == 218_103_808 * 2


def test_plan_matches_the_measured_h200_peak():
    """docs/performance.md: Llama-3-8B shape, bf16, seq 2048, r=16 all-linear, AdamW,
    torch.cuda.max_memory_allocated after warm-up, slots 2/3/4."""
    result = json.loads((RESULTS / "throughput/throughput-llama3-8b-seq2048.json").read_text())
    checked = set()
    for row in result["rows"]:
        # measured before backward slots existed: the copies of a ring alone
        plan = make_plan(PlanRequest(config_of(LLAMA3_8B), 2048, 1, 140 * GiB, slots=row["slots"], backward_slots=0))
        predicted = plan.peak_vram_bytes / GiB
        assert abs(predicted - row["peak_gib"]) / row["peak_gib"] < 0.02, (row["slots"], predicted, row["peak_gib"])
        # bytes per step were averaged over warm-up steps too (cold slots): within 1%
        assert abs(plan.copy_bytes_per_step - row["bytes_per_step"]) / row["bytes_per_step"] < 0.01
        checked.add(row["slots"])
    assert checked == {2, 3, 4}


@pytest.mark.parametrize("seq", [512, 2048])
def test_plan_matches_the_measured_nf4_peak_where_a_layer_not_the_loss_sets_it(seq):
    """A 32k vocabulary makes the loss small, so the NF4 layer's recompute + backward,
    with its dequantised weights, sets the peak (H200, benchmarks/results)."""
    result = json.loads((RESULTS / "throughput" / f"throughput-mistral-7b-nf4-peak-seq{seq}.json").read_text())
    row = result["rows"][0]
    plan = make_plan(PlanRequest(config_of(MISTRAL_7B), seq, 1, 140 * GiB, slots=row["slots"], quantization="nf4"))
    assert plan.layer_working_bytes > plan.loss_bytes
    predicted = plan.peak_vram_bytes / GiB
    assert abs(predicted - row["peak_gib"]) / row["peak_gib"] < 0.03, (predicted, row["peak_gib"])


def test_copies_per_step_and_time():
    plan = make_plan(
        PlanRequest(config_of(LLAMA3_8B), 2048, 1, 80 * GiB, slots=3, bandwidth_gbps=55.0, backward_slots=0)
    )
    assert plan.layers_copied_per_step == 58  # 2 x (32 - 3)
    assert plan.copy_bytes_per_step == 58 * 436_224_000 == 25_300_992_000
    assert plan.copy_seconds_per_step == pytest.approx(25_300_992_000 / 55e9)
    assert make_plan(
        PlanRequest(config_of(LLAMA3_8B), 2048, 1, 80 * GiB, slots=3, bandwidth_gbps=7.0, backward_slots=0)
    ).copy_seconds_per_step == pytest.approx(25_300_992_000 / 7e9)


def test_backward_slots_fill_the_loss_memory_outside_the_loss():
    """Llama-3-8B at 2048 tokens: the fp32 logits (2.94 GiB) less a layer's recompute and
    backward and three adapter-sized tensors leave room for four 0.41 GiB layers (the cap),
    which stay across the step boundary: 4 copies fewer. At 512 tokens the loss leaves
    room for none, and where a layer's working set sets the peak there is none either."""
    plan = make_plan(PlanRequest(config_of(LLAMA3_8B), 2048, 1, 80 * GiB, slots=3, backward_slots="auto"))
    room = plan.loss_bytes - plan.layer_working_bytes - 3 * plan.lora_bytes
    assert room // LLAMA3_8B_LAYER_BF16 >= BACKWARD_SLOTS_MAX == plan.backward_slots == 4
    assert plan.layers_copied_per_step == (32 - 3 - 4) + (32 - 3) == 54
    assert (
        plan.peak_vram_bytes
        == make_plan(PlanRequest(config_of(LLAMA3_8B), 2048, 1, 80 * GiB, slots=3, backward_slots=0)).peak_vram_bytes
    )
    assert (
        make_plan(PlanRequest(config_of(LLAMA3_8B), 512, 1, 80 * GiB, slots=3, backward_slots="auto")).backward_slots
        == 0
    )
    mistral = make_plan(
        PlanRequest(config_of(MISTRAL_7B), 2048, 1, 80 * GiB, slots=3, quantization="nf4", backward_slots="auto")
    )
    assert mistral.layer_working_bytes > mistral.loss_bytes and mistral.backward_slots == 0
    # at most the layers beyond twice the ring (the ring keeps the last ones)
    assert (
        make_plan(
            PlanRequest(
                config_of(dict(LLAMA3_8B, num_hidden_layers=7)), 2048, 1, 80 * GiB, slots=3, backward_slots="auto"
            )
        ).backward_slots
        == 1
    )
    # the default plan has none (the runtime takes them only with expandable segments),
    # and its speed hints say what they would save
    default = make_plan(PlanRequest(config_of(LLAMA3_8B), 2048, 1, 80 * GiB, slots=3))
    assert default.backward_slots == 0 and default.layers_copied_per_step == 58
    assert any(
        "expandable_segments:True, 4 backward slots" in hint and "4 layer copies fewer" in hint
        for hint in speed_hints(default)
    )
    assert backward_slot_count(10 * GiB, GiB, 0, GiB, streamed_layers=32, slots=3) == BACKWARD_SLOTS_MAX
    assert backward_slot_count(GiB, 2 * GiB, 0, GiB, streamed_layers=32, slots=3) == 0


@pytest.mark.parametrize("slots,backward", [(2, 0), (3, 0), (2, 1)])
def test_copies_follow_the_prefetch_planner(slots, backward):
    """Layers of different sizes: the bytes a steady training step copies, as the
    engine's own planner issues them (forward, then backward recompute in reverse)."""
    config = config_of(QWEN3_MOE_SMALL)
    sizes = [63_488, 100_864, 63_488, 100_864]  # test_moe_layers_sized_per_layer
    planner = PrefetchSchedule(len(sizes), slots, prefetch=1, backward_slots=backward)
    loaded = []
    for _ in range(3):
        loaded = []
        for layer in range(len(sizes)):
            loaded += [copied for copied, _ in planner.visit(layer, Phase.TRAIN_FORWARD).loads]
        for layer in reversed(range(len(sizes))):
            loaded += [copied for copied, _ in planner.visit(layer, Phase.BACKWARD).loads]
    plan = make_plan(PlanRequest(config, 16, 1, GiB, slots=slots, backward_slots=backward))
    # backward slots keep layers beyond twice the ring only: none of 4 layers with 2 slots
    kept = min(backward, max(0, len(sizes) - 2 * slots))
    assert plan.layers_copied_per_step == len(loaded) == 2 * (len(sizes) - slots) - kept
    assert plan.copy_bytes_per_step == sum(sizes[copied] for copied in loaded)


def test_slots_auto_selection():
    reserve = GiB
    # auto is what StreamConfig takes: 3 slots, or 2 when the room the budget leaves them
    # (budget - reserve - everything else: 7,535,075,328 here) holds fewer than 3 x 436,224,000
    plan = make_plan(PlanRequest(config_of(LLAMA3_8B), 2048, 1, 9_800_000_000, reserve_bytes=reserve))
    assert (plan.slots, plan.slots_auto, plan.fits) == (3, True, True)
    assert plan.slot_bytes == 3 * LLAMA3_8B_LAYER_BF16
    assert make_plan(PlanRequest(config_of(LLAMA3_8B), 2048, 1, 100 * GiB)).slots == 3  # more memory goes to the window
    two = make_plan(
        PlanRequest(config_of(LLAMA3_8B), 2048, 1, 7_535_075_328 + 3 * 436_224_000 - 1, reserve_bytes=reserve)
    )
    assert (two.slots, two.fits) == (2, True)
    # 2 slots need 8,407,523,328: nothing fits, the plan keeps 2 and says so
    tight = make_plan(PlanRequest(config_of(LLAMA3_8B), 2048, 1, 8_000_000_000, reserve_bytes=reserve))
    assert (tight.slots, tight.fits) == (2, False)
    one = make_plan(PlanRequest(config_of(dict(LLAMA3_8B, num_hidden_layers=1)), 2048, 1, 100 * GiB))
    assert (one.slots, one.layers_copied_per_step, one.copy_bytes_per_step) == (3, 0, 0)


def test_a_plan_that_does_not_fit_gives_advice():
    # seq 8192: boundary 32x8192x4096x2 = 2,147,483,648; loss 3x8192x128256x4 =
    # 12,608,077,824; peak with 2 slots: 2,101,355,008 + 671,088,640 + 2,147,483,648 +
    # 12,608,077,824 + 872,448,000 = 18,400,453,120; + 1 GiB reserve - 16 GiB = 2.14 GiB short
    plan = make_plan(PlanRequest(config_of(LLAMA3_8B), 8192, 1, 16 * GiB))
    assert plan.peak_vram_bytes == 18_400_453_120
    assert not plan.fits and plan.slots == 2
    text = "\n".join(plan.advice)
    assert "short by 2.14 GiB" in plan.advice[0]
    assert "--quantization nf4" in text
    # activations are 1,801,216 B per token; room for them: 15 GiB - 3,644,891,648 B of
    # the rest = 12,461,235,712 B -> 6918 tokens
    assert "reduce --seq to 6918 or less" in text
    assert make_plan(PlanRequest(config_of(LLAMA3_8B), 6918, 1, 16 * GiB, slots=2)).fits
    assert not make_plan(PlanRequest(config_of(LLAMA3_8B), 6919, 1, 16 * GiB, slots=2)).fits
    assert "--slots" not in text  # already at 2 slots


def test_advice_names_fewer_slots_and_smaller_batches():
    plan = make_plan(PlanRequest(config_of(LLAMA3_8B), 2048, 4, 16 * GiB, slots=6))
    assert not plan.fits
    text = "\n".join(plan.advice)
    assert "--slots 2 saves 1.63 GiB" in text  # 4 x 436,224,000 B = 1.6251 GiB
    assert "reduce --batch to" in text
    batch = int(text.split("reduce --batch to ")[1].split()[0])
    assert make_plan(PlanRequest(config_of(LLAMA3_8B), 2048, batch, 16 * GiB, slots=6)).fits
    assert not make_plan(PlanRequest(config_of(LLAMA3_8B), 2048, batch + 1, 16 * GiB, slots=6)).fits


def test_a_plan_that_fits_gives_no_advice():
    plan = make_plan(PlanRequest(config_of(LLAMA3_8B), 2048, 1, 24 * GiB))
    assert plan.fits and plan.advice == [] and plan.headroom_bytes > 0


def test_nf4_shrinks_slots_and_store_but_not_the_resident_part():
    none = make_plan(PlanRequest(config_of(LLAMA3_8B), 2048, 1, 80 * GiB, slots=3))
    nf4 = make_plan(PlanRequest(config_of(LLAMA3_8B), 2048, 1, 80 * GiB, slots=3, quantization="nf4"))
    assert nf4.max_layer_bytes == 112_543_744
    assert nf4.host_store_bytes == 32 * 112_543_744
    assert nf4.resident_bytes == none.resident_bytes
    assert none.peak_vram_bytes - nf4.peak_vram_bytes == 3 * (436_224_000 - 112_543_744)


@pytest.mark.parametrize("family", ["gpt_neox", "phi3", "gemma3_text"])
def test_a_family_unlike_llama_is_planned_from_its_own_modules_without_a_note(family):
    plan = make_plan(PlanRequest(tiny(family), 16, 1, GiB))
    assert plan.notes == []
    # negative control: a plan that has something to say says it
    assert make_plan(PlanRequest(tiny(family), 16, 1, GiB, quantization="nf4")).notes


def test_planning_leaves_the_config_as_it_was():
    from layerstream.modules.meta import meta_model

    config = tiny("llama")
    before = config.to_json_string(use_diff=False)
    make_plan(PlanRequest(config, 16, 1, GiB, dtype=torch.float32, quantization="nf4"))
    assert config.to_json_string(use_diff=False) == before
    # negative control: transformers' from_config writes the dtype into the config it gets
    meta_model(config, torch.float32)
    assert config.to_json_string(use_diff=False) != before


def test_a_config_transformers_builds_no_causal_lm_for_is_refused():
    config = AutoConfig.for_model("t5", vocab_size=96, d_model=64, num_layers=2, num_heads=4)
    with pytest.raises(ValueError, match="no causal LM for model_type 't5'"):
        make_plan(PlanRequest(config, 16, 1, GiB))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(slots=1), "at least 2 slots"),
        (dict(stream_embeddings="yes"), "stream_embeddings must be True or False"),
        (dict(seq=0), "seq"),
        (dict(batch=-1), "batch"),
        (dict(quantization="int8"), "quantization"),
        (dict(dtype="int8"), "dtype"),
        (dict(vram_bytes=0), "vram"),
        (dict(bandwidth_gbps=0), "bandwidth"),
    ],
)
def test_bad_arguments_are_refused(kwargs, match):
    request = PlanRequest(config=config_of(LLAMA3_8B), seq=2048, batch=1, vram_bytes=16 * GiB)
    with pytest.raises(ValueError, match=match):
        make_plan(request.replace(**kwargs))


def test_format_plan_is_one_screen():
    plan = make_plan(PlanRequest(config_of(LLAMA3_8B), 2048, 1, 16 * GiB, slots=3))
    text = format_plan(plan)
    lines = text.splitlines()
    assert len(lines) <= 30 and max(len(line) for line in lines) <= 100
    assert "32 layers" in text and "slots: 3 x 0.41 GiB" in text
    assert "predicted peak VRAM" in text and "7.24 GiB" in text  # (6,461,333,504 + 3 x 436,224,000) / 2^30
    assert "host RAM needed: transformers load + stream_model" in text and "15.52 GiB" in text
    assert "host RAM needed: layerstream.from_pretrained" in text and "15.36 GiB" in text
    assert "58 layer copies" in text and "0.460 s at 55 GB/s" in text
    with_backward = format_plan(
        make_plan(PlanRequest(config_of(LLAMA3_8B), 2048, 1, 16 * GiB, slots=3, backward_slots="auto"))
    )
    assert "54 layer copies (32 - 7 + 32 - 3)" in with_backward and "0.428 s at 55 GB/s" in with_backward
    assert "backward slots: 4 x 0.41 GiB (not at the peak)" in with_backward
    assert max(len(line) for line in with_backward.splitlines()) <= 100


# -- streamed embedding and head ----------------------------------------------------------
# Llama-3-8B, bf16: one vocab x hidden matrix is 128,256 x 4,096 x 2 = 1,050,673,152 B
# (a multiple of the store's 512-byte alignment); the final norm is 4,096 x 2 = 8,192 B.
LLAMA3_8B_MATRIX = 1_050_673_152


def test_stream_embeddings_takes_the_embedding_and_head_off_the_gpu():
    plan = make_plan(
        PlanRequest(config_of(LLAMA3_8B), 2048, 1, 80 * GiB, slots=2, stream_embeddings=True, backward_slots=0)
    )
    assert plan.stream_embeddings and plan.resident_bytes == 8_192 + LLAMA3_8B_ROTARY
    # the loss phase is the peak at seq 2048 and now holds one transient head copy:
    # both matrices leave the resident part, one comes back for the loss
    assert plan.head_copy_bytes == LLAMA3_8B_MATRIX
    assert plan.peak_vram_bytes == LLAMA3_8B_FIXED - LLAMA3_8B_MATRIX + 2 * LLAMA3_8B_LAYER_BF16
    # the host keeps both matrices in a store of their own
    assert plan.ends_host_bytes == 2 * LLAMA3_8B_MATRIX
    assert plan.host_steady_bytes == 32 * LLAMA3_8B_LAYER_BF16 + 2 * LLAMA3_8B_MATRIX
    # a step copies 2 x (32 - 2) layers, the head twice and 2048 embedding rows of 8,192 B
    assert plan.ends_copy_bytes_per_step == 2 * LLAMA3_8B_MATRIX + 2048 * 8_192
    assert plan.copy_bytes_per_step == 60 * LLAMA3_8B_LAYER_BF16 + 2 * LLAMA3_8B_MATRIX + 2048 * 8_192
    assert plan.layers_copied_per_step == 60
    resident = make_plan(PlanRequest(config_of(LLAMA3_8B), 2048, 1, 80 * GiB, slots=2))
    assert (resident.head_copy_bytes, resident.ends_host_bytes, resident.ends_copy_bytes_per_step) == (0, 0, 0)


def test_a_tied_head_streams_from_one_host_copy():
    tied = config_of(dict(LLAMA3_8B, tie_word_embeddings=True))
    resident = make_plan(PlanRequest(tied, 2048, 1, 80 * GiB, slots=2))
    streamed = make_plan(PlanRequest(tied, 2048, 1, 80 * GiB, slots=2, stream_embeddings=True))
    assert streamed.ends_host_bytes == LLAMA3_8B_MATRIX
    assert streamed.resident_bytes == 8_192 + LLAMA3_8B_ROTARY
    # the one matrix leaves the GPU but comes back for the loss, which is the peak
    assert streamed.peak_vram_bytes == resident.peak_vram_bytes


def test_the_planned_embedding_and_head_match_the_engine():
    import layerstream
    from layerstream.plan import plan_for_model

    for tied in (False, True):
        model = AutoModelForCausalLM.from_config(tiny("llama", tie_word_embeddings=tied))
        layerstream.stream_model(model, device="cpu", slots=2, stream_embeddings=True)
        plan = plan_for_model(model, 16, 1, slots=2, stream_embeddings=True)
        runtime = layerstream.get_runtime(model)
        assert runtime.embeddings.host_bytes == plan.ends_host_bytes
        rotary = sum(b.numel() * b.element_size() for b in model.model.rotary_emb.buffers())
        assert plan.resident_bytes == model.model.norm.weight.numel() * 4 + rotary
        assert plan.head_copy_bytes == model.lm_head.weight.numel() * 4


def test_advice_suggests_streaming_the_embedding_and_head():
    # Llama-3-8B at seq 8192 in 16 GiB is 2,294,325,248 B (2.14 GiB) short
    # (test_a_plan_that_does_not_fit_gives_advice); streaming saves one matrix at the peak,
    # 1,050,673,152 B = 0.98 GiB, leaving 1,243,652,096 B = 1.16 GiB
    plan = make_plan(PlanRequest(config_of(LLAMA3_8B), 8192, 1, 16 * GiB))
    text = " ".join(plan.advice)
    assert (
        "use --stream-embeddings (StreamConfig(stream_embeddings=True)): the input embedding and head "
        "(1.96 GiB) stay in host memory, saving 0.98 GiB (not enough alone, still 1.16 GiB short)"
    ) in text
    streamed = make_plan(PlanRequest(config_of(LLAMA3_8B), 8192, 1, 16 * GiB, stream_embeddings=True))
    assert not streamed.fits and "stream-embeddings" not in " ".join(streamed.advice)
    # tied: nothing saved at the peak, nothing suggested
    tied = make_plan(PlanRequest(config_of(dict(LLAMA3_8B, tie_word_embeddings=True)), 8192, 1, 16 * GiB))
    assert not tied.fits and "stream-embeddings" not in " ".join(tied.advice)
    # a small vocabulary (2 x 8,000 x 4,096 x 2 = 131 MB, under 10% of what stays on the
    # GPU): not worth suggesting
    small = make_plan(PlanRequest(config_of(dict(LLAMA3_8B, vocab_size=8000)), 8192, 1, 4 * GiB))
    assert not small.fits and "stream-embeddings" not in " ".join(small.advice)


def test_the_planned_window_is_the_one_the_runtime_keeps():
    """plan.window_layers mirrors how the runtime sizes the window when a step uses what
    the plan predicts (on the host the planner stands in for the measurement): a budget the
    size of the plan's keeps exactly that many layers, and the copies the plan predicts
    are the ones made."""
    import layerstream

    from tiny import peft_pair, train_steps

    streamed, _ = peft_pair("llama", layers=8)
    from layerstream.decisions.window import margin_bytes
    from layerstream.plan import plan_for_model

    probe = plan_for_model(streamed, 12, 2, slots=2)  # no budget: the peak alone
    budget = probe.needed_bytes + 3 * probe.max_layer_bytes + probe.max_layer_bytes // 2
    budget += margin_bytes(budget)  # a tiny model: the margin is its floor, whatever the budget
    planned = plan_for_model(streamed, 12, 2, slots=2, vram_bytes=budget)
    assert planned.window_layers == 3
    layerstream.stream_model(streamed, device="cpu", slots=2, prefetch=1, vram_budget=budget)
    runtime = layerstream.get_runtime(streamed)
    train_steps(streamed, 2)
    assert len(runtime.window) == planned.window_layers
    before = runtime.stats()["layer_loads"]
    train_steps(streamed, 1)
    assert runtime.stats()["layer_loads"] - before == planned.window_copies()[0] == 2 * (8 - 3 - 2)


def test_speed_hints_name_the_window_and_a_larger_batch_when_they_help():
    roomy = make_plan(PlanRequest(config_of(LLAMA3_8B), 2048, 1, 16 * GiB, slots=3))
    hints = "\n".join(speed_hints(roomy))
    assert f"keeps {roomy.window_layers} of 32 layers" in hints and roomy.window_layers > 0
    assert f"batch {roomy.largest_batch} fits at seq 2048" in hints and roomy.largest_batch > 1
    assert "per_device_train_batch_size before gradient_accumulation_steps" in hints
    # the largest batch is the largest that fits
    assert make_plan(PlanRequest(config_of(LLAMA3_8B), 2048, roomy.largest_batch, 16 * GiB, slots=3)).fits
    assert not make_plan(PlanRequest(config_of(LLAMA3_8B), 2048, roomy.largest_batch + 1, 16 * GiB, slots=3)).fits
    # everything fits: nothing streams
    assert "nothing is copied per step" in "\n".join(
        speed_hints(make_plan(PlanRequest(config_of(LLAMA3_8B), 2048, 1, 40 * GiB, slots=3)))
    )
    # a plan that does not fit gets advice, not speed hints
    assert speed_hints(make_plan(PlanRequest(config_of(LLAMA3_8B), 8192, 1, 16 * GiB))) == []
    assert "speed: " in format_plan(roomy)
