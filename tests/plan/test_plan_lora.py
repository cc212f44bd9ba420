"""The planner's resident part and LoRA adapters, counted against PEFT's own.

Expected numbers are derived by hand in the comments (or counted from real objects:
the engine's own host-store layout, PEFT's adapters, bitsandbytes' quant state), never
by calling the function under test.
"""

import pytest
import torch
from model_shapes import (
    FAMILIES,
    LLAMA3_8B,
    LLAMA3_8B_LORA_PARAMS,
    LLAMA3_8B_RESIDENT,
    LLAMA3_8B_ROTARY,
    MIXTRAL_8X7B,
    config_of,
    tiny,
)
from transformers import AutoModelForCausalLM

from layerstream.plan import (
    GiB,
    PlanRequest,
    make_plan,
    resident_bytes,
)


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


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_live_peft_models_adapters_are_planned_as_peft_made_them(family):
    """The plan of a live model reads its adapters from its PEFT config; for some families
    (Phi-3) PEFT writes "all-linear" there as the full names of every module it adapted
    (model.layers.1.mlp.down_proj), which the plan counts as the modules they name."""
    from peft import LoraConfig, get_peft_model

    from layerstream.plan import plan_for_model

    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_config(tiny(family)), LoraConfig(r=4, target_modules="all-linear"))
    counted = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert plan_for_model(model, seq=16, batch=1).lora_params == counted


def test_a_live_model_adapting_only_parameters_is_planned_with_those_alone():
    """PEFT's target_parameters without target_modules: the live config's modules are empty."""
    from peft import LoraConfig, get_peft_model

    from layerstream.plan import plan_for_model

    torch.manual_seed(0)
    lora = LoraConfig(r=4, target_parameters=["mlp.experts.gate_up_proj"])
    model = get_peft_model(AutoModelForCausalLM.from_config(tiny("qwen3_moe")), lora)
    counted = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert plan_for_model(model, seq=16, batch=1).lora_params == counted
