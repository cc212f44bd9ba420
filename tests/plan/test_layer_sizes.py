"""The planner's layer sizes: bf16, fp32 and NF4 layers of every family, mixtures of
experts, against the host store's layout and bitsandbytes' quantiser.

Expected numbers are derived by hand in the comments (or counted from real objects:
the engine's own host-store layout, PEFT's adapters, bitsandbytes' quant state), never
by calling the function under test.
"""

import math

import pytest
import torch
from model_shapes import (
    FAMILIES,
    LLAMA3_8B,
    LLAMA3_8B_LAYER_BF16,
    LLAMA3_8B_LAYER_PARAMS,
    MIXTRAL_8X7B,
    QWEN3_MOE_SMALL,
    SHAPES,
    config_of,
    tiny,
)
from transformers import AutoModelForCausalLM

from layerstream.modules.discovery import find_decoder_layers
from layerstream.plan import (
    GiB,
    PlanRequest,
    layer_bytes,
    load_config,
    make_plan,
    nf4_weight_bytes,
)
from layerstream.tiers.store import HostStore

from tiny import save_model_of


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
