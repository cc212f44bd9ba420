"""Packed experts beside the rest of layerstream and its clients: the plan, the disk tier,
save_pretrained and state dicts, copies, parameter counts and adapters aimed at the stacks."""

import copy
import json

import pytest
import torch
from packed_models import CPU, ROOT, dequantised_model, logits_of, lora_step_results, packed_model
from peft import get_peft_model

import layerstream
from layerstream import plan
from layerstream.checkpoints import mxfp4
from layerstream.modules import packed_experts

from tiny import lora_config


def test_the_plan_sizes_packed_layers_as_the_store_holds_them(checkpoint):
    model = packed_model(checkpoint)
    stored = [record.nbytes for record in layerstream.get_runtime(model).records]
    assert plan.layer_bytes(model.config, "none", torch.bfloat16) == stored
    shape = plan.layer_shapes(model.config)[0]
    assert shape.dequantised == packed_experts.dequantised_bytes(model) > 0
    assert {p.name for p in shape.params} >= {"mlp.experts.gate_up_proj", "mlp.experts.down_proj"}
    assert shape.sparse  # still a mixture of experts to the plan


def test_the_decode_plan_counts_packed_experts_at_their_packed_bytes(checkpoint):
    from layerstream.plan.decode import decode_term, routed_bytes

    model = packed_model(checkpoint)
    record = layerstream.get_runtime(model).records[0]
    packed = sum(e.nbytes for e in record.entries if e.name.endswith(("_blocks", "_scales")))
    shapes = plan.layer_shapes(model.config)
    assert routed_bytes(shapes, 2)[0] == (packed, 2, 4)
    term = decode_term(plan.layer_bytes(model.config, "none"), 2, 55.0, 0, routed=routed_bytes(shapes, 2))
    assert 0 < term.copy_bytes <= sum(r.nbytes for r in layerstream.get_runtime(model).records)


def test_the_plan_of_gpt_oss_as_published_keeps_its_experts_packed():
    """gpt-oss-120b's config as published (quant_method "mxfp4"): the plan's layers are the
    files' bytes, not bf16's (5.9 GiB a layer), unless the config asks to dequantise."""
    from transformers import AutoConfig

    raw = json.loads((ROOT / "configs" / "shapes" / "gpt-oss-120b.json").read_text())
    raw.setdefault("quantization_config", {"quant_method": "mxfp4"})
    config = AutoConfig.for_model(**raw)
    packed = max(plan.layer_bytes(config, "none", torch.bfloat16))
    config.quantization_config = {**config.quantization_config, "dequantize": True}
    dequantised = max(plan.layer_bytes(config, "none", torch.bfloat16))
    assert 1.5 * 2**30 < packed < 1.7 * 2**30 < 5.8 * 2**30 < dequantised


def test_the_disk_tier_reads_packed_layers_straight_from_the_files(checkpoint):
    reference = dequantised_model(checkpoint)
    stream = layerstream.StreamConfig(device="cpu", slots=2, host_budget="200KiB")
    model = layerstream.from_pretrained(checkpoint, dtype=torch.bfloat16, stream=stream)
    assert layerstream.get_runtime(model).disk is not None
    assert torch.equal(logits_of(model), logits_of(reference))


def test_nf4_with_packed_experts_reads_its_disk_layers_from_the_layer_cache(checkpoint, tmp_path):
    """QLoRA of gpt-oss with a host budget: the attention in NF4, the experts packed, the layers
    beyond the budget written once to the NF4 layer cache and read from there: the same logits
    as with every layer in host RAM."""
    in_ram = layerstream.from_pretrained(checkpoint, quantization="nf4", dtype=torch.bfloat16, stream=CPU)
    stream = layerstream.StreamConfig(device="cpu", slots=2, host_budget="200KiB", disk_cache_dir=str(tmp_path))
    for _ in range(2):  # written, then read back
        model = layerstream.from_pretrained(checkpoint, quantization="nf4", dtype=torch.bfloat16, stream=stream)
        assert layerstream.get_runtime(model).disk is not None
        assert torch.equal(logits_of(model), logits_of(in_ram))
    assert any(tmp_path.rglob("*")), "the layer cache was written"


def test_save_pretrained_writes_a_checkpoint_that_loads_back_packed_or_dequantised(checkpoint, tmp_path):
    """The saved checkpoint is gpt-oss's format: blocks, scales and an MXFP4 quantization_config,
    so transformers (dequantising) and layerstream (packed) both load the same model back."""
    reference, model = dequantised_model(checkpoint), packed_model(checkpoint)
    model.save_pretrained(tmp_path / "saved")
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert saved["quantization_config"]["quant_method"] == "mxfp4" and "layerstream_packed_experts" not in saved
    assert getattr(model.config, "quantization_config", None) is None  # the model's own config as it was
    assert torch.equal(logits_of(dequantised_model(tmp_path / "saved")), logits_of(reference))
    assert torch.equal(logits_of(packed_model(tmp_path / "saved")), logits_of(reference))
    layerstream.unstream_model(model)  # a streamed model refuses to be copied
    twin = copy.deepcopy(model)  # a copy saves itself, not the model it was copied from
    with torch.no_grad():
        twin.model.layers[0].self_attn.q_proj.weight.mul_(2)
    twin.save_pretrained(tmp_path / "twin")
    assert not torch.equal(logits_of(dequantised_model(tmp_path / "twin")), logits_of(reference))


def test_save_pretrained_of_packed_experts_beside_nf4_attention_is_refused(checkpoint, tmp_path):
    model = layerstream.from_pretrained(checkpoint, quantization="nf4", dtype=torch.bfloat16, stream=CPU)
    with pytest.raises(packed_experts.PackedExpertsError, match="Save the adapters"):
        model.save_pretrained(tmp_path / "saved")
    assert not (tmp_path / "saved" / "config.json").exists()


@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
def test_a_copy_of_a_model_no_longer_streamed_computes_counts_and_saves_as_its_original(checkpoint, tmp_path, how):
    """The packed experts' forward, ``num_parameters`` and ``save_pretrained`` are set on the
    objects themselves: a deep copy or a pickled and loaded copy has them, bound to itself
    (the copy's experts dequantise the copy's blocks), and gives the reference's logits."""
    reference, model = dequantised_model(checkpoint), packed_model(checkpoint)
    layerstream.unstream_model(model)
    if how == "deepcopy":
        again = copy.deepcopy(model)
    else:
        torch.save(model, tmp_path / "model.pt")
        again = torch.load(tmp_path / "model.pt", weights_only=False)
    experts = again.model.layers[0].mlp.experts
    assert experts.forward.owner is experts and again.save_pretrained.owner is again
    assert torch.equal(logits_of(again), logits_of(reference))
    assert again.num_parameters() == reference.num_parameters()
    with torch.no_grad():
        experts.gate_up_proj_scales.add_(1)  # the copy's own blocks: the original is untouched
    assert not torch.equal(logits_of(again), logits_of(reference)) and torch.equal(
        logits_of(model), logits_of(reference)
    )
    again.save_pretrained(tmp_path / "saved")
    assert (
        json.loads((tmp_path / "saved" / "config.json").read_text())["quantization_config"]["quant_method"] == "mxfp4"
    )


@pytest.mark.parametrize("strict", [True, False])
def test_a_dequantised_state_dict_is_refused_before_anything_loads(checkpoint, strict):
    """The dequantised model's state dict names expert stacks this model keeps packed: torch
    would load every other tensor, then raise for them (or, not strict, skip them without a
    word). Refused first, with what to load; the model computes as before. Control: the
    model's own state dict, with one attention weight changed, loads and is used."""
    reference, model = dequantised_model(checkpoint), packed_model(checkpoint)
    state = {name: value + 1 if value.is_floating_point() else value for name, value in reference.state_dict().items()}
    before = logits_of(model)
    with pytest.raises(packed_experts.PackedExpertsError, match=r"nothing was loaded.*Mxfp4Config\(dequantize=True\)"):
        model.load_state_dict(state, strict=strict)
    assert torch.equal(logits_of(model), before)
    own = model.state_dict()
    own["model.layers.1.self_attn.q_proj.weight"] = own["model.layers.1.self_attn.q_proj.weight"] * 2
    model.load_state_dict(own, strict=strict)
    assert not torch.equal(logits_of(model), before)


def test_the_parameter_count_is_the_dequantised_models(checkpoint):
    """``num_parameters`` (and with it the Trainer's ``total_flos``) and PEFT's own count count
    what the packed stacks stand for, as transformers' dequantised model counts its
    Parameters; trainable ones after PEFT alike. Control: the class's own count, which misses
    the experts."""
    reference, model = dequantised_model(checkpoint), packed_model(checkpoint)
    for kwargs in ({}, {"exclude_embeddings": True}):
        assert model.num_parameters(**kwargs) == reference.num_parameters(**kwargs)
    assert type(model).num_parameters(model) < reference.num_parameters()
    config = lora_config(target_modules=["q_proj", "v_proj"])
    peft, plain = get_peft_model(model, config), get_peft_model(reference, copy.deepcopy(config))
    assert peft.num_parameters(only_trainable=True) == plain.num_parameters(only_trainable=True) > 0
    # what the Trainer's floating_point_ops reads, through PEFT's model
    assert peft.num_parameters(exclude_embeddings=True) == plain.num_parameters(exclude_embeddings=True)
    # what PEFT's print_trainable_parameters prints
    assert peft.get_nb_trainable_parameters() == plain.get_nb_trainable_parameters()


def test_adapters_aimed_at_packed_experts_are_refused_with_what_to_load(checkpoint, monkeypatch):
    """Refused as PEFT is asked; and, should an adapter get there another way (here: that
    check bypassed), at the first forward, before it computes."""
    from peft import LoraConfig

    from layerstream.integrations import peft as peft_integration

    aimed = LoraConfig(r=4, target_modules=["q_proj"], target_parameters=["mlp.experts.gate_up_proj"])
    with pytest.raises(packed_experts.PackedExpertsError, match=r"Mxfp4Config\(dequantize=True\)"):
        get_peft_model(packed_model(checkpoint), copy.deepcopy(aimed))
    monkeypatch.setattr(peft_integration, "refuse_untrainable_targets", lambda *args: None)
    peft = get_peft_model(packed_model(checkpoint), aimed)
    with pytest.raises(packed_experts.PackedExpertsError, match=r"Mxfp4Config\(dequantize=True\)"):
        logits_of(peft)
    attention_only = get_peft_model(packed_model(checkpoint), LoraConfig(r=4, target_modules=["q_proj"]))
    assert logits_of(attention_only).isfinite().all()  # the control: attention adapters compute


@pytest.mark.parametrize(
    "config",
    [
        dict(target_modules=[], target_parameters=["mlp.experts.gate_up_proj"]),
        dict(target_modules=["q_proj"], modules_to_save=["experts"]),
        dict(target_modules=["q_proj"], modules_to_save=["mlp"]),
    ],
    ids=["experts-only-target-parameters", "modules-to-save-experts", "modules-to-save-their-mlp"],
)
@pytest.mark.parametrize("streamed", [True, False], ids=["streamed", "no-longer-streamed"])
def test_a_peft_config_that_would_train_packed_stacks_is_refused_before_peft_changes_the_model(
    checkpoint, config, streamed
):
    """What would leave the packed stacks untrained (PEFT finds no Parameter to adapt; its
    modules_to_save copy has only biases to train) is refused as PEFT is asked, streamed or
    after ``unstream_model``, with what to load, and the model is as it was. Control: the
    router in modules_to_save trains, as on the dequantised model."""
    model = packed_model(checkpoint)
    if not streamed:
        layerstream.unstream_model(model)
    modules, before = {name for name, _ in model.named_modules()}, logits_of(model)
    match = "Mxfp4Config" if streamed is False or "target_parameters" in config else "modules_to_save"
    with pytest.raises((packed_experts.PackedExpertsError, layerstream.StreamingError), match=match):
        get_peft_model(model, lora_config(**config))
    assert {name for name, _ in model.named_modules()} == modules and torch.equal(logits_of(model), before)
    if not streamed:
        reference = dequantised_model(checkpoint)
        router = dict(target_modules=["q_proj"], modules_to_save=["router"])
        losses, grads = lora_step_results(model, config=router)
        reference_losses, reference_grads = lora_step_results(reference, config=router)
        assert [float(x) for x in losses] == [float(x) for x in reference_losses]
        assert any("router" in name for name in grads[0])
        assert all(torch.equal(grads[0][name], reference_grads[0][name]) for name in reference_grads[0])


def test_the_plan_holds_dequantised_experts_for_transformers_own_load(checkpoint):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(checkpoint)  # names MXFP4, as published
    request = plan.PlanRequest(config, 12, 1, 8 << 30, "none")
    memory = plan.make_plan(request)
    dequantised = plan.layer_bytes(mxfp4.dequantised_config(config), "none")
    assert memory.host_steady_bytes == sum(dequantised) and memory.loader_store_bytes < sum(dequantised)
    assert memory.host_store_bytes == sum(plan.layer_bytes(config, "none")) < sum(dequantised)


def test_the_plan_says_why_packed_experts_take_no_lora(checkpoint):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(checkpoint)
    with pytest.raises(ValueError, match="stay packed in MXFP4"):
        plan.make_plan(plan.PlanRequest(config, 12, 1, 8 << 30, "none", lora_targets="q_proj,gate_up_proj"))
    dequantised = mxfp4.dequantised_config(config)  # the control: the reason is the packing's alone
    with pytest.raises(ValueError, match="matches nothing") as refused:
        plan.make_plan(plan.PlanRequest(dequantised, 12, 1, 8 << 30, "none", lora_targets="q_proj,gate_up_proj"))
    assert "stay packed" not in str(refused.value)
