"""Families beyond the client matrix's, streamed: recent dense models and the routed-expert
designs of the 100B-class mixtures people bring to a small GPU (GLM-4.5-Air's glm4_moe,
DeepSeek-V3's shared experts and latent attention, Llama-4-Scout's interleaved experts,
Qwen3-Next's linear attention, ERNIE-4.5's and AFMoE's experts). Each trains two steps with LoRA, streamed through two slots,
and greedy-decodes with its KV cache; losses, logits, every LoRA gradient and the tokens
equal the resident model's bit for bit. Their default dropout (Seed-OSS: attention and
residual 0.1) is left on: the recompute draws the forward's masks."""

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model

import layerstream

from tiny import assert_traces_equal, peft_pair, routed_design, stream, train_steps

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
# family -> (config values that give it its design at a tiny size, LoRA targets or None: all-linear)
CASES = {
    "glm4": ({}, None),
    **{family: (routed_design(family, 4), None) for family in ("glm4_moe", "deepseek_v3", "qwen3_next")},
    "dots1": (dict(routed_design("dots1", 4), first_k_dense_replace=1), None),  # a dense first layer
    "qwen2_moe": (
        dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32),
        None,
    ),
    # PEFT's all-linear on Llama-4's experts fails on the plain model too: LoRA on attention
    "llama4_text": (
        dict(num_local_experts=4, num_experts_per_tok=1, intermediate_size_mlp=64, interleave_moe_layer_step=2),
        ATTENTION,
    ),
    "olmoe": (dict(num_experts=4, num_experts_per_tok=2), None),
    "granitemoe": (routed_design("granitemoe", 4), None),
    "ernie4_5_moe": (routed_design("ernie4_5_moe", 4), None),
    # AFMoE and Laguna freeze an expert bias when built: the layers stream all the same
    "afmoe": (dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, num_dense_layers=1), None),
    "laguna": (dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32), None),
    "exaone4": (dict(sliding_window=8), None),
    "seed_oss": ({}, None),
    "apertus": ({}, None),
}


def _pair(family):
    overrides, targets = CASES[family]
    lora = None if targets is None else dict(target_modules=targets)
    return peft_pair(family, layers=5, lora=lora, **overrides)


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("family", sorted(CASES))
def test_streamed_training_and_greedy_decoding_equal_resident(family):
    streamed, resident = _pair(family)
    stream(streamed)
    torch.manual_seed(5)
    expected = train_steps(resident, 2)
    torch.manual_seed(5)
    assert_traces_equal(train_steps(streamed, 2), expected)
    ids = torch.randint(3, resident.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(2))
    settings = dict(max_new_tokens=5, do_sample=False, pad_token_id=0, use_cache=True)
    for model in (resident, streamed):
        model.eval()
    with torch.no_grad():
        assert torch.equal(streamed.generate(input_ids=ids, **settings), resident.generate(input_ids=ids, **settings))


def test_a_changed_streamed_weight_is_caught():
    """Control: one weight of one streamed layer changed by a little must turn parity red."""
    streamed, resident = _pair("glm4_moe")
    with torch.no_grad():
        next(p for n, p in streamed.named_parameters() if "layers.2." in n and "experts" in n).mul_(1.001)
    stream(streamed)
    torch.manual_seed(5)
    expected = train_steps(resident, 1)
    torch.manual_seed(5)
    with pytest.raises(AssertionError):
        assert_traces_equal(train_steps(streamed, 1), expected)


def test_qwen3_next_streamed_equals_the_plain_model_without_a_training_cache(tmp_path):
    """Given a cache in a training forward, Qwen3-Next's linear attention takes another path
    in some transformers releases (5.18 and 5.25 take one path either way; a release the
    project's tests ran on took two);
    streamed layers keep no cache under autograd (as transformers' gradient checkpointing),
    so a streamed step equals the plain step with use_cache=False, whichever the release.
    Control: one linear-attention weight of the streamed copy changed by a little turns it
    red. (The client matrix, whose plain runs train with transformers' default
    use_cache=True, has no Qwen3-Next cell for the releases that differ.)"""
    from transformers import AutoModelForCausalLM

    from tiny import save_model_of, tiny_config

    # the client matrix's checkpoint of it, loaded from disk
    config = tiny_config(
        "qwen3_next", 4, **dict(CASES["qwen3_next"][0], num_experts=16, vocab_size=259, max_position_embeddings=256)
    )
    base = AutoModelForCausalLM.from_pretrained(save_model_of(config, tmp_path / "qwen3_next"))

    def gradients(model, **kwargs):
        torch.manual_seed(0)
        lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
        model = get_peft_model(model, lora)
        model.train()
        ids = torch.randint(3, 90, (2, 16), generator=torch.Generator().manual_seed(3))
        model(input_ids=ids, labels=ids, **kwargs).loss.backward()
        return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}

    def streamed_gradients(change=None):
        model = copy.deepcopy(base)
        if change is not None:
            with torch.no_grad():
                model.get_parameter(change).mul_(1.001)
        layerstream.stream_model(model, slots=2, vram_budget=None, device="cpu")
        return gradients(model, use_cache=True)

    without_cache = gradients(copy.deepcopy(base), use_cache=False)
    got = streamed_gradients()
    assert all(torch.equal(got[name], without_cache[name]) for name in got)
    linear_attention = next(n for n, _ in base.named_parameters() if "linear_attn.in_proj_qkvz" in n)
    changed = streamed_gradients(linear_attention)
    assert any(not torch.equal(changed[name], without_cache[name]) for name in changed)
