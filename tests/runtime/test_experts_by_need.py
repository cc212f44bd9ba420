"""Copies by need: a streamed mixture-of-experts layer copies only the experts its router
chose when a pass carries few tokens, whole stacks otherwise, and computes the resident
model's numbers bit for bit either way."""

import copy

import pytest
import torch
from peft import get_peft_model

import layerstream
from layerstream.runtime import experts as by_need

from tiny import assert_traces_equal, lora_config, peft_pair, routed_design, stream, tiny_model, train_steps

# 16 experts, 2 per token: a pass of up to 5 tokens copies by need, longer ones whole
_NEWER = ("glm4_moe", "deepseek_v3", "dots1", "qwen3_next", "granitemoe", "ernie4_5_moe")
ROUTED = {
    "qwen3_moe": dict(num_experts=16, num_experts_per_tok=2),
    "mixtral": dict(num_local_experts=16, num_experts_per_tok=2),
    "gpt_oss": dict(num_local_experts=16, num_experts_per_tok=2, sliding_window=8),
    **{family: routed_design(family, 16) for family in _NEWER},
}
LAYERS, EXPERTS = 5, 16
ATTENTION_ONLY = dict(target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])


def _pair(family, device="cpu"):
    """A model to stream on ``device`` and its resident copy already there."""
    model = tiny_model(family, layers=LAYERS, **ROUTED[family])
    return model, copy.deepcopy(model).to(device)


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("family", sorted(ROUTED))
def test_a_short_pass_copies_only_the_chosen_experts_and_equals_resident(family, device):
    streamed, resident = _pair(family, device)
    stream(streamed, device)
    ids = torch.tensor([[5, 7]], device=device)
    assert torch.equal(_logits(streamed, ids), _logits(resident, ids))
    stats = layerstream.get_runtime(streamed).stats()
    assert stats["expert_visits"] == LAYERS
    assert 0 < stats["experts_copied"] <= LAYERS * 2 * 2  # at most top_k per token per layer
    assert stats["experts_copied"] < LAYERS * EXPERTS


@pytest.mark.parametrize("family", sorted(ROUTED))
def test_a_long_pass_copies_whole_stacks_and_equals_resident(family):
    streamed, resident = _pair(family)
    stream(streamed)
    ids = torch.randint(3, 90, (2, 30), generator=torch.Generator().manual_seed(0))
    assert torch.equal(_logits(streamed, ids), _logits(resident, ids))
    assert layerstream.get_runtime(streamed).experts.by_need is False
    assert layerstream.get_runtime(streamed).stats()["experts_copied"] >= LAYERS * EXPERTS


def test_a_wrongly_skipped_expert_is_caught(monkeypatch, device):
    """Negative control: one chosen expert left out of each copy computes with another
    layer's bytes, and the logits say so."""
    streamed, resident = _pair("qwen3_moe", device)
    stream(streamed, device)
    chosen = by_need._chosen_rows
    monkeypatch.setattr(by_need, "_chosen_rows", lambda *a: chosen(*a)[1:])
    ids = torch.tensor([[5, 7]], device=device)
    assert not torch.equal(_logits(streamed, ids), _logits(resident, ids))


@pytest.mark.parametrize("family", sorted(ROUTED))
def test_greedy_generation_copies_by_need_and_equals_resident(family, device):
    streamed, resident = _pair(family, device)
    stream(streamed, device)
    prompt = torch.tensor([[5, 7, 9]], device=device)
    out = streamed.generate(prompt, max_new_tokens=10, do_sample=False)
    assert torch.equal(out, resident.generate(prompt, max_new_tokens=10, do_sample=False))
    stats = layerstream.get_runtime(streamed).stats()
    assert stats["experts_copied"] < stats["expert_visits"] * EXPERTS / 2


def test_a_slot_kept_into_the_next_pass_is_completed_with_the_rows_that_pass_chooses():
    """Layers stay in their slots from one pass to the next (as many slots as layers):
    the second input routes to other experts, which are copied into the kept slots."""
    model = tiny_model("qwen3_moe", layers=2, **ROUTED["qwen3_moe"])
    resident = copy.deepcopy(model)
    stream(model, slots=2)
    runtime = layerstream.get_runtime(model)
    for ids in (torch.tensor([[5, 7]]), torch.tensor([[60, 61]]), torch.tensor([[11, 40]])):
        loads = runtime.pool.loads
        assert torch.equal(_logits(model, ids), _logits(resident, ids))
    assert runtime.pool.loads == loads, "the last pass ran in the kept slots"
    assert runtime.stats()["experts_copied"] > 0


def test_training_with_adapters_on_attention_equals_resident_and_copies_by_need(device):
    streamed, resident = peft_pair("qwen3_moe", layers=LAYERS, lora=ATTENTION_ONLY, **ROUTED["qwen3_moe"])
    stream(streamed, device)
    resident.to(device)
    trace = train_steps(streamed, steps=3, device=device, seq=2, batch_size=1)
    assert_traces_equal(trace, train_steps(resident, steps=3, device=device, seq=2, batch_size=1))
    stats = layerstream.get_runtime(streamed).stats()
    assert stats["experts_copied"] < stats["expert_visits"] * EXPERTS / 2


@pytest.mark.parametrize("when", ["before streaming", "after streaming"])
def test_adapters_on_the_expert_stacks_read_every_row_so_every_row_is_copied(when):
    """PEFT puts LoRA on the fused expert stacks (all-linear on qwen3_moe) and merges the
    whole stack on each call, reading the rows the router did not choose too: those layers
    copy whole stacks (every row of every expert, never some of them)."""
    lora = lora_config(target_modules="all-linear", lora_dropout=0.0)
    base = tiny_model("qwen3_moe", layers=LAYERS, **ROUTED["qwen3_moe"])
    resident = get_peft_model(copy.deepcopy(base), lora)
    if when == "before streaming":
        streamed = get_peft_model(base, lora)
        streamed.load_state_dict(resident.state_dict())
        stream(streamed)
    else:
        stream(base)
        streamed = get_peft_model(base, lora)
        streamed.load_state_dict(resident.state_dict())
    trace = train_steps(streamed, steps=2, seq=2, batch_size=1)
    assert_traces_equal(trace, train_steps(resident, steps=2, seq=2, batch_size=1))
    stats = layerstream.get_runtime(streamed).stats()
    assert stats["experts_copied"] > 0 and stats["experts_copied"] % EXPERTS == 0


def test_debug_checksums_copy_whole_layers():
    streamed, resident = _pair("qwen3_moe")
    stream(streamed, checksum=True)
    ids = torch.tensor([[5, 7]])
    assert torch.equal(_logits(streamed, ids), _logits(resident, ids))
    runtime = layerstream.get_runtime(streamed)
    assert runtime.experts.by_need is False
    assert runtime.stats()["experts_copied"] % EXPERTS == 0


def _qlora_pair(tmp_path):
    """Two QLoRA models loaded from the same files (LoRA on attention, same adapters):
    bitsandbytes packs the attention's nn.Linear weights; the expert stacks stay in the
    compute dtype (as in transformers' own 4-bit load) and are copied by need."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from tiny import save_tiny

    directory = save_tiny(tmp_path / "moe", "qwen3_moe", LAYERS, dtype=torch.bfloat16, wide=True, **ROUTED["qwen3_moe"])
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)

    def load():
        model = AutoModelForCausalLM.from_pretrained(
            directory, quantization_config=quant, dtype=torch.bfloat16, device_map="cpu"
        )
        return get_peft_model(model, lora_config(**ATTENTION_ONLY))

    resident, streamed = load(), load()
    streamed.load_state_dict({k: v for k, v in resident.state_dict().items() if "lora_" in k}, strict=False)
    return streamed, resident


def _assert_copied_by_need_and_packed(streamed):
    stats = layerstream.get_runtime(streamed).stats()
    assert 0 < stats["experts_copied"] < stats["expert_visits"] * EXPERTS / 2
    packed = stats["nf4_function_calls"] + stats["nf4_dequant_calls"] + stats["nf4_inference_calls"]
    assert packed > 0, "the attention streamed packed"


def test_a_qlora_model_copies_its_experts_by_need_and_equals_resident(tmp_path):
    from tiny import portable_cpu_nf4

    streamed, resident = (portable_cpu_nf4(model) for model in _qlora_pair(tmp_path))
    stream(streamed)
    prompt = torch.tensor([[5, 7, 9]])
    out = streamed.generate(prompt, max_new_tokens=6, do_sample=False)
    assert torch.equal(out, resident.generate(prompt, max_new_tokens=6, do_sample=False))
    _assert_copied_by_need_and_packed(streamed)


@pytest.mark.gpu
def test_a_qlora_model_on_the_gpu_generates_and_trains_like_resident_copying_by_need(tmp_path):
    """On CUDA, bitsandbytes' own kernels on both sides: greedy tokens, then three training
    steps (losses, logits, every LoRA gradient) equal the resident QLoRA model's."""
    streamed, resident = _qlora_pair(tmp_path)
    resident.to("cuda")
    stream(streamed, "cuda")
    prompt = torch.tensor([[5, 7, 9]], device="cuda")
    out = streamed.generate(prompt, max_new_tokens=8, do_sample=False)
    assert torch.equal(out, resident.generate(prompt, max_new_tokens=8, do_sample=False))
    trace = train_steps(streamed, steps=3, device="cuda", seq=2, batch_size=1)
    assert_traces_equal(trace, train_steps(resident, steps=3, device="cuda", seq=2, batch_size=1))
    _assert_copied_by_need_and_packed(streamed)


def test_a_merge_undone_inside_the_layers_call_reads_and_writes_whole_stacks():
    """PEFT undoes a merged adapter on an expert stack inside the layer's call (a forward
    with the adapter disabled): the slot is made whole before PEFT reads it, so the logits
    and, after unstreaming, every weight are the resident model's (copied by need, rows the
    router did not choose would hold another layer's bytes and be written to the host)."""
    stacks = dict(r=4, lora_alpha=8, init_lora_weights=False, target_modules=[])
    lora = lora_config(**stacks, target_parameters=["mlp.experts.gate_up_proj"])
    base, resident_base = _pair("qwen3_moe")
    stream(base)
    torch.manual_seed(0)
    streamed = get_peft_model(base, lora)
    torch.manual_seed(0)
    resident = get_peft_model(resident_base, lora)
    ids = torch.tensor([[5, 7]])
    for model in (streamed, resident):
        model.merge_adapter()
    with streamed.disable_adapter(), resident.disable_adapter():
        assert torch.equal(_logits(streamed, ids), _logits(resident, ids))
    layerstream.unstream_model(streamed)
    for (name, mine), (_, theirs) in zip(streamed.named_parameters(), resident.named_parameters()):
        assert torch.equal(mine, theirs), name


def test_each_experts_module_of_a_layer_keeps_its_own_rows():
    """PEFT's modules_to_save on the experts, loaded for inference: each layer holds two
    experts modules (the original and the saved copy), both streamed. A pass with the
    adapter and one without, in slots kept between them: the original's rows are its own."""
    saved = dict(r=4, target_modules=["q_proj"], modules_to_save=["experts"], init_lora_weights=False)
    base, resident_base = (tiny_model("qwen3_moe", layers=2, **ROUTED["qwen3_moe"]) for _ in range(2))
    resident_base.load_state_dict(base.state_dict())
    torch.manual_seed(0)
    streamed = get_peft_model(base, lora_config(**saved))
    torch.manual_seed(0)
    resident = get_peft_model(resident_base, lora_config(**saved))
    for model in (streamed, resident):
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "modules_to_save" in name:
                    param.mul_(1.25)  # the saved experts differ from the original ones
        model.requires_grad_(False)
    stream(streamed, slots=2)
    ids = torch.tensor([[5, 7]])
    assert torch.equal(_logits(streamed, ids), _logits(resident, ids))
    with streamed.disable_adapter(), resident.disable_adapter():
        assert torch.equal(_logits(streamed, ids), _logits(resident, ids))


def _send_to_the_last_two(module, args, kwargs):
    hidden, chosen, weights = args
    return (hidden, torch.full_like(chosen, EXPERTS - 2) + torch.arange(chosen.shape[-1]) % 2, weights), kwargs


def test_a_hook_added_after_streaming_that_changes_the_choice_gets_the_rows_it_chose():
    """A user's pre-hook on the experts (an ablation sending every token to two experts),
    registered after streaming, runs after layerstream's: the chosen rows are not known
    there, so every row is copied."""
    streamed, resident = _pair("qwen3_moe")
    stream(streamed)
    for model in (streamed, resident):
        for layer in model.model.layers:
            layer.mlp.experts.register_forward_pre_hook(_send_to_the_last_two, with_kwargs=True)
    ids = torch.tensor([[5, 7]])
    assert torch.equal(_logits(streamed, ids), _logits(resident, ids))
