"""The memory planner: layer sizes, resident and LoRA memory, slots, advice, parsing, CLI.

Expected numbers are derived by hand in the comments (or counted from real objects:
the engine's own host-store layout, PEFT's adapters, bitsandbytes' quant state), never
by calling the function under test.
"""

import json
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from layerstream.commands import cli
from layerstream.commands import plan as plan_command
from layerstream.commands import run as run_command
from layerstream.decisions.schedule import Phase, PrefetchSchedule
from layerstream.modules.discovery import find_decoder_layers
from layerstream.plan import (
    BACKWARD_SLOTS_MAX,
    GiB,
    PlanRequest,
    backward_slot_count,
    format_plan,
    layer_bytes,
    load_config,
    make_plan,
    nf4_weight_bytes,
    parse_bytes,
    resident_bytes,
    speed_hints,
)
from layerstream.tiers.store import HostStore

from tiny import save_model_of

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"

SHAPES = Path(__file__).resolve().parents[2] / "configs" / "shapes"


def shipped_shape(name: str) -> dict:
    """A real model's config values as configs/shapes ships them (what `layerstream plan
    --model configs/shapes/<name>.json` reads)."""
    return json.loads((SHAPES / f"{name}.json").read_text())


# Llama-3.1-8B: Llama-3-8B's layers, embeddings and head (only the context is longer,
# which no planned size depends on)
LLAMA3_8B = shipped_shape("llama-3.1-8b")
MIXTRAL_8X7B = shipped_shape("mixtral-8x7b")
MISTRAL_7B = shipped_shape("mistral-7b-v0.3")
# a small Qwen3-MoE: layer 0 dense (mlp_only_layers), then sparse every 2nd layer
QWEN3_MOE_SMALL = dict(
    model_type="qwen3_moe",
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=48,
    mlp_only_layers=[0],
    decoder_sparse_step=2,
)

# Llama-3-8B, one layer, by hand:
#   q 4096*4096 = 16,777,216   k = v = 4096*1024 = 4,194,304   o = 16,777,216
#   gate = up = down = 4096*14336 = 58,720,256
#   linear weights: 2*16,777,216 + 2*4,194,304 + 3*58,720,256 = 218,103,808
#   two RMSNorms: 2*4096 = 8,192  ->  218,112,000 parameters (the norms included)
LLAMA3_8B_LAYER_PARAMS = 218_103_808 + 8_192
LLAMA3_8B_LAYER_BF16 = 436_224_000  # x2 bytes; every tensor is a multiple of 512 bytes
# embeddings and head: 128256*4096 = 525,336,576 each, plus the final norm (4096), bf16;
# plus the rotary embedding's buffers, inv_freq and original_inv_freq: 2 x 64 float32
LLAMA3_8B_ROTARY = 2 * 64 * 4
LLAMA3_8B_RESIDENT = (2 * 525_336_576 + 4_096) * 2 + LLAMA3_8B_ROTARY  # 2,101,355,008
# LoRA r=16 on all seven linears: 16*((4096+4096)*2 + (4096+1024)*2 + (4096+14336)*3)
#   = 16*81,920 = 1,310,720 per layer, 41,943,040 for 32 layers
LLAMA3_8B_LORA_PARAMS = 41_943_040


def config_of(values: dict):
    values = dict(values)
    return AutoConfig.for_model(values.pop("model_type"), **values)


def write_config(directory: Path, values: dict, name: str = "config.json") -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_text(json.dumps(values))
    return path


# -- layer sizes -----------------------------------------------------------------------
def test_llama3_8b_layer_bytes_bf16():
    assert LLAMA3_8B_LAYER_PARAMS == 218_112_000
    sizes = layer_bytes(config_of(LLAMA3_8B), "none", torch.bfloat16)
    assert sizes == [LLAMA3_8B_LAYER_PARAMS * 2] * 32
    assert sizes[0] == LLAMA3_8B_LAYER_BF16
    assert layer_bytes(config_of(LLAMA3_8B), "none", torch.float32)[0] == LLAMA3_8B_LAYER_PARAMS * 4


def test_llama3_8b_layer_bytes_nf4():
    # Per NF4 weight of n values (blocksize 64, double quantisation): packed codes n/2,
    # uint8 absmax n/64, float32 nested absmax per 256 blocks, plus the quant state the
    # engine streams with it: 16-entry float32 code (64 B), float32 offset (4 B) and the
    # 256-entry float32 nested code (1024 B), each rounded up to 512 B -> 2048 B.
    #   q, o (n = 16,777,216): 8,388,608 + 262,144 + 1,024*4 + 2,048 = 8,656,896
    #   k, v (n = 4,194,304):  2,097,152 +  65,536 +   256*4 + 2,048 = 2,165,760
    #   MLP  (n = 58,720,256): 29,360,128 + 917,504 + 3,584*4 + 2,048 = 30,294,016
    #   norms stay bf16: 16,384
    double = 2 * 8_656_896 + 2 * 2_165_760 + 3 * 30_294_016 + 16_384
    assert double == 112_543_744
    assert layer_bytes(config_of(LLAMA3_8B), "nf4", torch.bfloat16) == [double] * 32
    # single quantisation: float32 absmax per block, code table (512 B aligned) only
    #   q, o: 8,388,608 + 1,048,576 + 512;  k, v: 2,097,152 + 262,144 + 512
    #   MLP: 29,360,128 + 3,670,016 + 512
    single = 2 * 9_437_696 + 2 * 2_359_808 + 3 * 33_030_656 + 16_384
    assert layer_bytes(config_of(LLAMA3_8B), "nf4", torch.bfloat16, double_quant=False) == [single] * 32


def test_qwen2_biases_and_alignment():
    # h=64, 4 heads, 2 kv heads (head_dim 16), MLP 96; q/k/v have biases, o has none.
    # q 4096 params -> 8192 B, its bias 64 -> 128 B -> 512 aligned; k, v 2048 -> 4096 B,
    # bias 32 -> 64 B -> 512; o 8192 B; norms 2 x (128 B -> 512); MLP 3 x 12,288 B
    values = dict(
        model_type="qwen2",
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    expected = (8192 + 512) + 2 * (4096 + 512) + 8192 + 2 * 512 + 3 * 12_288
    assert expected == 64_000
    assert layer_bytes(config_of(values)) == [64_000, 64_000]


def test_moe_layers_sized_per_layer():
    # Mixtral-8x7B, one layer: attention 41,943,040 params; experts (fused 3-D
    # Parameters) 8 x 3 x 4096 x 14336 = 1,409,286,144; router 8 x 4096 = 32,768; norms 8,192
    params = 41_943_040 + 1_409_286_144 + 32_768 + 8_192
    assert layer_bytes(config_of(MIXTRAL_8X7B)) == [params * 2] * 32
    # NF4 quantises nn.Linear only: attention as in Llama-3-8B (q, o 8,656,896; k, v
    # 2,165,760), experts, router and norms stay bf16
    nf4 = 2 * 8_656_896 + 2 * 2_165_760 + 1_409_286_144 * 2 + 32_768 * 2 + 8_192 * 2
    assert layer_bytes(config_of(MIXTRAL_8X7B), "nf4") == [nf4] * 32
    # Qwen3-MoE with mlp_only_layers=[0], decoder_sparse_step=2: layers 1 and 3 are sparse.
    # attention (bf16): q 8192 + k 4096 + v 4096 + o 8192 = 24,576 B
    # norms: 2 x 64 (128 B) + q_norm, k_norm 16 (32 B), each aligned to 512 -> 2,048 B
    # dense MLP: 3 x 64 x 96 x 2 = 36,864 B
    # sparse MLP: router 4x64 (512 B), gate_up 4x96x64 (49,152 B), down 4x64x48 (24,576 B)
    dense, sparse = 24_576 + 2_048 + 36_864, 24_576 + 2_048 + 512 + 49_152 + 24_576
    assert layer_bytes(config_of(QWEN3_MOE_SMALL)) == [dense, sparse, dense, sparse]


FAMILIES = {
    "llama": dict(model_type="llama"),
    "llama-biases": dict(model_type="llama", attention_bias=True, mlp_bias=True),
    "mistral": dict(model_type="mistral"),
    "qwen2": dict(model_type="qwen2"),
    "qwen3": dict(model_type="qwen3", head_dim=24),
    "mixtral": dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(
        model_type="qwen2_moe",
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        shared_expert_intermediate_size=80,
        mlp_only_layers=[1],
    ),
    "qwen3_moe": dict(QWEN3_MOE_SMALL),
    # families whose layers differ from Llama's: four norms (gemma2), per-head q/k norms
    # too (gemma3_text, olmo2), fused q/k/v and gate/up projections (phi3), LayerNorms with
    # biases and biased fused projections (gpt_neox), Conv1D projections (gpt2)
    "gemma": dict(model_type="gemma", head_dim=16),
    "gemma2": dict(model_type="gemma2", head_dim=16),
    "gemma3_text": dict(model_type="gemma3_text", head_dim=16),
    "olmo2": dict(model_type="olmo2"),
    "phi3": dict(model_type="phi3", pad_token_id=None),
    "gpt_neox": dict(model_type="gpt_neox"),
    "gpt2": dict(model_type="gpt2"),
}


def tiny(family: str, **overrides):
    values = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    values.update(FAMILIES[family])
    values.update(overrides)
    return config_of(values)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_layer_bytes_equal_the_host_store_layout(family, dtype):
    """The planned slot size is what HostStore lays out for the real layer (built on the CPU)."""
    config = tiny(family)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    engine = [
        HostStore.plan_layer(i, f"layers.{i}", layer, lambda t: True).nbytes
        for i, layer in enumerate(find_decoder_layers(model)[1])
    ]
    assert layer_bytes(config, "none", dtype) == engine


def test_nf4_weight_bytes_match_bitsandbytes():
    import bitsandbytes.functional as functional

    for shape in [(100, 100), (96, 64), (1000, 4096)]:
        weight = torch.randn(shape, dtype=torch.bfloat16)
        for nested in (True, False):
            packed, state = functional.quantize_4bit(weight, blocksize=64, compress_statistics=nested, quant_type="nf4")
            tensors = [packed, state.absmax, state.code]
            if nested:
                tensors += [state.state2.absmax, state.offset.reshape(1), state.state2.code]
            real = sorted(t.numel() * t.element_size() for t in tensors)
            assert sorted(nf4_weight_bytes(math.prod(shape), nested)) == real, (shape, nested)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("skip", [None, ["q_proj", "down_proj"]], ids=["default", "skip-list"])
def test_the_modules_nf4_packs_are_the_ones_transformers_quantizer_swaps(family, skip):
    """nf4.quantised_on_load reads transformers' own skip list and matching: on a meta
    model it names exactly the modules the bitsandbytes quantizer turns into Linear4bit."""
    import bitsandbytes as bnb
    from transformers import BitsAndBytesConfig
    from transformers.quantizers import AutoHfQuantizer

    from layerstream.modules import nf4

    config = tiny(family)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    predicted = set(nf4.quantised_on_load(model, skip))
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", llm_int8_skip_modules=skip)
    AutoHfQuantizer.from_config(quant, pre_quantized=False).preprocess_model(
        model, device_map=None, dtype=torch.bfloat16
    )
    swapped = {name for name, module in model.named_modules() if isinstance(module, bnb.nn.Linear4bit)}
    assert predicted == swapped and swapped
    if skip is None:
        assert "lm_head" not in swapped
    else:  # the skip list replaces the default one, which kept the head out
        assert "lm_head" in swapped and not any(name.endswith(("q_proj", "down_proj")) for name in swapped)


# -- resident, LoRA ----------------------------------------------------------------------
def test_tied_and_untied_embeddings():
    assert resident_bytes(config_of(LLAMA3_8B), torch.bfloat16) == LLAMA3_8B_RESIDENT == 2_101_355_008
    tied = config_of(dict(LLAMA3_8B, tie_word_embeddings=True))
    assert resident_bytes(tied, torch.bfloat16) == (525_336_576 + 4_096) * 2 + LLAMA3_8B_ROTARY
    untied = make_plan(PlanRequest(config_of(LLAMA3_8B), 2048, 1, 80 * GiB, slots=2))
    assert (
        untied.resident_bytes - make_plan(PlanRequest(tied, 2048, 1, 80 * GiB, slots=2)).resident_bytes
        == 525_336_576 * 2
    )


def test_llama3_8b_lora_memory():
    plan = make_plan(PlanRequest(config_of(LLAMA3_8B), 2048, 1, 80 * GiB, slots=2))
    assert plan.lora_params == LLAMA3_8B_LORA_PARAMS
    assert plan.lora_bytes == plan.lora_grad_bytes == LLAMA3_8B_LORA_PARAMS * 4  # fp32 adapters
    assert plan.optimizer_bytes == LLAMA3_8B_LORA_PARAMS * 8  # AdamW: two fp32 states
    # attention only: 16*((4096+4096)*2 + (4096+1024)*2) = 425,984 per layer
    attention = make_plan(
        PlanRequest(config_of(LLAMA3_8B), 2048, 1, 80 * GiB, slots=2, lora_targets="q_proj,k_proj,v_proj,o_proj")
    )
    assert attention.lora_params == 425_984 * 32
    assert make_plan(PlanRequest(config_of(LLAMA3_8B), 2048, 1, 80 * GiB, lora_rank=0)).lora_params == 0


def test_mixtral_all_linear_adapts_the_experts_as_peft_does():
    # PEFT 0.21 maps Mixtral's expert/router names onto the fused Parameters: per layer
    # attention 425,984; router 16*(4096+8) = 65,664; gate_up (rank 2r for w1+w3)
    # 32*8*(4096+28672) = 8,388,608; down 16*8*(14336+4096) = 2,359,296
    plan = make_plan(PlanRequest(config_of(MIXTRAL_8X7B), 1024, 1, 200 * GiB, slots=2))
    assert plan.lora_params == (425_984 + 65_664 + 8_388_608 + 2_359_296) * 32
    assert any("experts" in note for note in plan.notes)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("targets", ["all-linear", "q_proj,v_proj"])
def test_lora_params_equal_peft(family, targets):
    """Counted on a real model PEFT adapts; where PEFT refuses the targets, so does the plan."""
    from peft import LoraConfig, get_peft_model

    config = tiny(family)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    wanted = targets if targets == "all-linear" else targets.split(",")
    try:
        model = get_peft_model(model, LoraConfig(r=4, target_modules=wanted))
    except ValueError:
        with pytest.raises(ValueError, match="matches nothing"):
            make_plan(PlanRequest(config, 16, 1, GiB, lora_rank=4, lora_targets=targets))
        return
    counted = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert make_plan(PlanRequest(config, 16, 1, GiB, lora_rank=4, lora_targets=targets)).lora_params == counted


def test_unknown_lora_target_is_refused():
    with pytest.raises(ValueError, match="matches nothing"):
        make_plan(PlanRequest(config_of(LLAMA3_8B), 2048, 1, 80 * GiB, lora_targets="query_key_value"))
    with pytest.raises(ValueError, match="up_proj"):  # PEFT refuses half of a fused stack
        make_plan(PlanRequest(tiny("qwen3_moe"), 16, 1, GiB, lora_targets="q_proj,gate_proj"))


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


@pytest.mark.parametrize("quantization, double_quant", [("none", True), ("nf4", True), ("nf4", False)])
def test_layers_and_arenas_match_from_pretrained(tmp_path, quantization, double_quant):
    """Slot sizes (NF4 quant state included) and the host arenas as
    layerstream.from_pretrained really lays them out (1 MiB arenas: three full, one not)."""
    import layerstream

    config = config_of(
        dict(
            model_type="llama",
            vocab_size=96,
            hidden_size=128,
            intermediate_size=352,
            num_hidden_layers=7,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    )
    save_model_of(config, tmp_path, dtype=torch.bfloat16)
    model = layerstream.from_pretrained(
        tmp_path,
        quantization=None if quantization == "none" else "nf4",
        torch_dtype=torch.bfloat16,
        bnb_4bit_use_double_quant=double_quant,
        stream=layerstream.StreamConfig(device="cpu", arena_bytes=1 << 20),
    )
    runtime = layerstream.get_runtime(model)
    plan = make_plan(
        PlanRequest(config, 16, 1, GiB, quantization=quantization, double_quant=double_quant, arena_bytes=1 << 20)
    )
    assert [record.nbytes for record in runtime.records] == plan.layer_bytes
    assert runtime.store.host_bytes == plan.loader_store_bytes


@pytest.mark.parametrize("family", ["qwen2", "qwen3_moe", "gemma2", "gemma3_text", "phi3", "gpt_neox"])
def test_nf4_layers_match_the_host_store_layout(tmp_path, family):
    """A model transformers loads with BitsAndBytesConfig (NF4, double quantisation) on
    the CPU: packed weights, quant state and the MoE experts it leaves in bf16."""
    from transformers import BitsAndBytesConfig

    config = tiny(family)
    save_model_of(config, tmp_path, dtype=torch.bfloat16)
    quant = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )
    model = AutoModelForCausalLM.from_pretrained(
        tmp_path, quantization_config=quant, dtype=torch.bfloat16, device_map="cpu"
    )
    engine = [
        HostStore.plan_layer(i, f"layers.{i}", layer, lambda t: True).nbytes
        for i, layer in enumerate(find_decoder_layers(model)[1])
    ]
    assert layer_bytes(config, "nf4", torch.bfloat16) == engine


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


def test_cli_plan_stream_embeddings(tmp_path, capsys):
    write_config(tmp_path, LLAMA3_8B)
    code = cli.main(
        ["plan", "--model", str(tmp_path), "--vram-budget", "16GiB", "--seq", "2048", "--stream-embeddings"]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "final norm (embeddings and head stream)" in out and "head weight copied in for the loss" in out
    # (6,461,333,504 - 1,050,673,152 + 3 x 436,224,000) / 2^30 = 6.26
    assert "predicted peak VRAM" in out and "6.26 GiB" in out
    assert "embeddings and head (--stream-embeddings)" in out and "1.96 GiB" in out
    assert "2 head copies (forward, backward), embedding rows" in out and "all copies" in out


def test_cli_plan_backward_slots(tmp_path, capsys):
    """--backward-slots N plans N; auto (the default) plans what a run's auto takes under
    its vram_budget: none (the budget goes to the resident window), and the speed hint
    says how many auto would take without a budget."""
    write_config(tmp_path, LLAMA3_8B)
    argv = ["plan", "--model", str(tmp_path), "--vram-budget", "16GiB", "--seq", "2048", "--slots", "3"]
    assert cli.main(argv + ["--backward-slots", "4"]) == 0
    out = capsys.readouterr().out
    assert "backward slots: 4 x 0.41 GiB (not at the peak)" in out and "54 layer copies" in out
    assert cli.main(argv + ["--backward-slots", "2"]) == 0
    assert "56 layer copies (32 - 5 + 32 - 3)" in capsys.readouterr().out
    for given in (["--backward-slots", "auto"], []):
        assert cli.main(argv + given) == 0
        out = capsys.readouterr().out
        assert "backward slots:" not in out and "58 layer copies" in out
        assert "4 backward slots\n       (StreamConfig(backward_slots='auto') with vram_budget=None)" in out


def _setting_flag_mismatches(parser, names) -> list:
    """Each StreamConfig setting of ``names`` whose flag on ``parser`` is not the setting's:
    missing, or with another destination, default or help."""
    from layerstream.config import argparse_help, setting_default_text, settings

    actions = {option: action for action in parser._actions for option in action.option_strings}
    problems = []
    for setting in settings():
        if setting.name not in names:
            continue
        flag = "--" + setting.name.replace("_", "-")
        action = actions.get(flag)
        if action is None:
            problems.append(f"{flag}: missing")
            continue
        if action.dest != setting.name:
            problems.append(f"{flag}: dest {action.dest}")
        if action.default != setting_default_text(setting):
            problems.append(f"{flag}: default {action.default!r}")
        if argparse_help(setting) not in (action.help or ""):
            problems.append(f"{flag}: help")
    return problems


def _command_parser(name: str):
    import argparse

    sub = argparse.ArgumentParser(prog="layerstream").add_subparsers()
    parser = {"plan": plan_command.add_parser, "run": run_command.add_parser}[name](sub)
    {"plan": plan_command.add_arguments, "run": run_command.add_arguments}[name](parser)
    return parser


def test_the_plan_commands_setting_flags_are_stream_configs():
    """`layerstream plan`'s flags for StreamConfig settings have the settings' names, help
    and defaults, as `layerstream run`'s have; every setting a plan request takes has one."""
    import argparse

    from layerstream.plan.request import PLAN_SETTINGS, REQUEST_SETTINGS

    plan_parser, run_parser = _command_parser("plan"), _command_parser("run")
    assert set(REQUEST_SETTINGS) <= set(PLAN_SETTINGS)
    assert _setting_flag_mismatches(plan_parser, PLAN_SETTINGS) == []
    assert _setting_flag_mismatches(run_parser, PLAN_SETTINGS) == []
    # negative control: flags spelled by hand, with names and defaults of their own
    by_hand = argparse.ArgumentParser()
    by_hand.add_argument("--vram", help="GPU memory budget")
    by_hand.add_argument("--backward-slots", default=0, help="extra slots used only outside the loss")
    by_hand.add_argument("--slots", type=int, default=None, help="GPU slots")
    problems = _setting_flag_mismatches(by_hand, PLAN_SETTINGS)
    assert {"--vram-budget: missing", "--backward-slots: default 0", "--slots: default None"} <= set(problems)
    assert "--slots: help" in problems and "--host-budget: missing" in problems


def test_a_runs_settings_are_planned_as_the_run_takes_them():
    """request_for: "auto" stays for the plan to decide as the run does, but backward slots,
    which a run under a vram_budget does not take; values given are planned as given."""
    from layerstream.config import StreamConfig
    from layerstream.plan import request_for, settings_of

    shape = dict(config=config_of(LLAMA3_8B), seq=8192, batch=1)
    request = request_for(settings_of(StreamConfig(device="cpu")), 16 * GiB, **shape)
    assert (request.slots, request.backward_slots, request.loss_chunk_tokens) == ("auto", 0, "auto")
    plan = make_plan(request)
    assert plan.fits and plan.slots_auto and plan.backward_slots == 0 and plan.loss_chunk_tokens == 512
    assert not make_plan(request.replace(loss_chunk_tokens=None, slots=3)).fits, "auto made it fit"
    given = StreamConfig(device="cpu", slots=4, backward_slots=2, loss_chunk_tokens=0, offload_activations=True)
    request = request_for(settings_of(given), 16 * GiB, **shape)
    assert (request.slots, request.backward_slots, request.loss_chunk_tokens) == (4, 2, None)
    assert request.offload_activations is True and request.vram_bytes == 16 * GiB


def test_the_plan_command_takes_a_size_for_the_vram_budget(tmp_path, capsys):
    write_config(tmp_path, LLAMA3_8B)
    for budget in ([], ["--vram-budget", "auto"], ["--vram-budget", "none"]):
        with pytest.raises(SystemExit) as exit_info:
            cli.main(["plan", "--model", str(tmp_path), "--seq", "2048"] + budget)
        assert exit_info.value.code == 2 and "give the GPU memory to plan for" in capsys.readouterr().err
    assert cli.main(["plan", "--model", str(tmp_path), "--seq", "2048", "--vram-budget", "16GiB"]) == 0


# -- parsing ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text, expected",
    [
        ("16GiB", 16 * 2**30),
        ("24GB", 24 * 10**9),
        ("1.5GiB", 3 * 2**29),
        ("16000000000", 16 * 10**9),
        ("512 MiB", 512 * 2**20),
        ("2tib", 2 * 2**40),
        ("80gb", 80 * 10**9),
        (".5GiB", 2**29),
        ("100B", 100),
        (4096, 4096),
    ],
)
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize(
    "text, match",
    [
        ("", "not a size"),
        ("abc", "not a size"),
        ("GiB", "not a size"),
        ("-1GiB", "not a size"),
        ("16G", "ambiguous"),
        ("16 furlongs", "unknown unit"),
        ("1.5", "whole number"),
        (-5, "negative"),
        ("1,5GiB", "not a size"),
    ],
)
def test_parse_bytes_errors(text, match):
    with pytest.raises(ValueError, match=match):
        parse_bytes(text)


def test_load_config_from_file_directory_and_errors(tmp_path):
    path = write_config(tmp_path / "a", LLAMA3_8B, name="llama3-8b.json")  # any file name
    config = load_config(path)
    assert (config.model_type, config.num_key_value_heads, config.vocab_size) == ("llama", 8, 128256)
    write_config(tmp_path / "b", LLAMA3_8B)
    assert load_config(tmp_path / "b").intermediate_size == 14336
    assert load_config(str(tmp_path / "b" / "config.json")).hidden_size == 4096
    with pytest.raises(FileNotFoundError):
        load_config(tmp_path / "missing" / "config.json")
    with pytest.raises(ValueError, match="model_type"):
        load_config(write_config(tmp_path / "c", {"hidden_size": 8}))
    with pytest.raises(ValueError, match="no config.json"):
        load_config(tmp_path / "a")


# -- the command --------------------------------------------------------------------------
def test_cli_plan_fits(tmp_path, capsys):
    path = write_config(tmp_path, LLAMA3_8B)
    code = cli.main(["plan", "--model", str(path), "--vram-budget", "16GiB", "--seq", "2048"])
    out = capsys.readouterr().out
    assert code == 0
    assert "32 layers" in out
    assert "slots: 3 x 0.41 GiB (auto)" in out  # as StreamConfig(slots="auto") takes them
    assert "predicted peak VRAM" in out and "7.24 GiB" in out  # (6,461,333,504 + 3 x 436,224,000) / 2^30
    assert "host RAM needed" in out and "15.52 GiB" in out
    assert "fits" in out and "To make it fit" not in out


def test_cli_plan_does_not_fit(tmp_path, capsys):
    write_config(tmp_path, LLAMA3_8B)
    argv = ["plan", "--model", str(tmp_path), "--vram-budget", "16GiB", "--seq", "8192", "--slots", "2"]
    off = ["--offload-activations", "false", "--loss-chunk-tokens", "none", "--mlp-tile-tokens", "none"]
    code = cli.main(argv + off + ["--bandwidth", "7"])
    out = capsys.readouterr().out
    assert code == 1
    assert "DOES NOT FIT, short by 2.14 GiB" in out
    assert "--quantization nf4" in out and "reduce --seq to 6918" in out
    assert "at 7 GB/s" in out
    # the settings' default, auto, plans what a run turns on at this length: a chunked loss
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "chunks of 512 tokens" in out and "auto (a run's default) at batch 1 x 8192 tokens turns on" in out


def test_cli_plan_options_reach_the_plan(tmp_path, capsys):
    write_config(tmp_path, LLAMA3_8B)
    code = cli.main(
        [
            "plan",
            "--model",
            str(tmp_path),
            "--vram-budget",
            "80GB",
            "--seq",
            "1024",
            "--batch",
            "2",
            "--quantization",
            "nf4",
            "--dtype",
            "float16",
            "--lora-rank",
            "8",
            "--lora-targets",
            "q_proj,v_proj",
            "--slots",
            "4",
            "--reserve",
            "2GiB",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "seq 1024 x batch 2, float16, NF4, r=8 on q_proj,v_proj" in out
    assert "slots: 4 x 0.10 GiB (--slots)" in out
    assert "2.00 GiB" in out  # the reserve


@pytest.mark.parametrize(
    "argv",
    [
        ["--vram-budget", "16G", "--seq", "2048"],
        ["--vram-budget", "16GiB", "--seq", "2048", "--slots", "1"],
        ["--vram-budget", "16GiB", "--seq", "2048", "--unknown"],
    ],
)
def test_cli_plan_bad_input_exits_2(tmp_path, capsys, argv):
    write_config(tmp_path, LLAMA3_8B)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["plan", "--model", str(tmp_path)] + argv)
    assert exit_info.value.code == 2
    assert "error" in capsys.readouterr().err


def test_cli_demo_still_receives_its_arguments(monkeypatch):
    from layerstream.commands import demo

    seen = []
    monkeypatch.setattr(demo, "main", lambda argv: seen.append(argv))
    assert cli.main(["demo", "--steps", "3", "--device", "cpu"]) == 0
    assert seen == [["--steps", "3", "--device", "cpu"]]


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


@pytest.mark.parametrize("shape, eager", [("gpt-oss-20b", True), ("llama-3.1-8b", False)])
def test_a_plan_says_where_attention_runs_eager_and_what_its_scores_take(shape, eager):
    """transformers has no SDPA path for gpt-oss (its attention sinks): each layer keeps its
    scores, batch x heads x seq^2 in float32 and the compute dtype, which the plan names."""
    config = load_config(SHAPES / f"{shape}.json")
    memory = make_plan(PlanRequest(config, seq=2048, batch=1, vram_bytes=24 * GiB, quantization="nf4"))
    said = [note for note in memory.notes if "runs eager" in note]
    assert bool(said) is eager
    if eager:
        assert f"{64 * 2048 * 2048 * 6 / GiB:.2f} GiB at batch 1 x 2048 tokens" in said[0]
