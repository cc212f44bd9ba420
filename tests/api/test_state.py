"""Streaming changes no name, key, value or saved file, and moves only the resident part."""

import copy

import pytest
import torch
from peft import PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

import layerstream
from layerstream.tiers.pool import TIMED_COPY_EVERY

from tiny import assert_traces_equal, lora_config, peft_pair, stream, tiny_model, train_steps


def _state_equal(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb), "state_dict keys or their order changed"
    for key in sa:
        assert torch.equal(sa[key].cpu(), sb[key].cpu()), key


def test_state_dict_and_parameter_names_are_unchanged(device):
    streamed, resident = peft_pair("qwen2", layers=4)
    names = [n for n, _ in streamed.named_parameters()]
    params = [p for p in streamed.parameters()]
    stream(streamed, device, slots=2)
    assert [n for n, _ in streamed.named_parameters()] == names
    assert all(a is b for a, b in zip(streamed.parameters(), params)), "Parameter objects replaced"
    _state_equal(streamed, resident)


def test_move_applies_only_to_the_resident_part():
    streamed, _ = peft_pair("llama", layers=3)
    stream(streamed, "cpu", slots=2)
    runtime = layerstream.get_runtime(streamed)
    streamed_ids = {id(v) for r in runtime.records for v in r.host_values}
    before = {n: p.data_ptr() for n, p in streamed.named_parameters()}
    order = list(streamed.state_dict())
    streamed._apply(lambda t: t.clone())  # what .to() does, with a visible effect
    for name, param in streamed.named_parameters():
        moved = param.data_ptr() != before[name]
        assert moved == (id(param) not in streamed_ids), name
    assert list(streamed.state_dict()) == order


def test_casting_streamed_weights_is_refused():
    streamed, _ = peft_pair("llama", layers=3)
    stream(streamed, "cpu", slots=2)
    streamed.to(torch.float32)  # no change: allowed
    with pytest.raises(layerstream.StreamingError, match="cast streamed weights") as refused:
        streamed.half()
    # under `layerstream run` the user never calls stream_model: the dtype goes to from_pretrained
    assert "load the model in torch.float16 (from_pretrained(..., dtype=torch.float16)" in str(refused.value)


def test_save_pretrained_writes_the_plain_model(tmp_path):
    model = tiny_model("llama", layers=4)
    reference = copy.deepcopy(model)
    layerstream.stream_model(model, slots=2, device="cpu")
    model.save_pretrained(tmp_path / "streamed")
    reference.save_pretrained(tmp_path / "plain")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "streamed")
    _state_equal(loaded, reference)
    assert sorted(p.name for p in (tmp_path / "streamed").iterdir()) == sorted(
        p.name for p in (tmp_path / "plain").iterdir()
    )


def test_adapters_save_and_load_like_the_plain_model(tmp_path):
    streamed, resident = peft_pair("llama", layers=4)
    stream(streamed, "cpu", slots=2)
    train_steps(streamed, 2)
    streamed.save_pretrained(tmp_path / "adapter")
    reloaded = PeftModel.from_pretrained(tiny_model("llama", layers=4), tmp_path / "adapter")
    layerstream.stream_model(reloaded, slots=3, device="cpu")
    for (name, a), (_, b) in zip(streamed.named_parameters(), reloaded.named_parameters()):
        if "lora_" in name:
            assert torch.equal(a, b), name
    ids = torch.randint(3, 90, (1, 8))
    with torch.no_grad():
        assert torch.equal(streamed(input_ids=ids).logits, reloaded(input_ids=ids).logits)


def test_peft_applied_after_streaming_matches_resident():
    base = tiny_model("mistral", layers=5)
    resident = get_peft_model(copy.deepcopy(base), lora_config())
    layerstream.stream_model(base, slots=2, device="cpu")
    streamed = get_peft_model(base, lora_config())
    streamed.load_state_dict(resident.state_dict())
    assert_traces_equal(train_steps(streamed, 10), train_steps(resident, 10))


def test_unstream_restores_the_plain_model(device):
    streamed, resident = peft_pair("gemma", layers=4)
    layer_types = [type(layer) for layer in streamed.base_model.model.model.layers]
    stream(streamed, device, slots=2)
    resident.to(device)
    train_steps(streamed, 2, device)
    train_steps(resident, 2, device)
    layerstream.unstream_model(streamed)
    assert not layerstream.is_streamed(streamed)
    assert [type(layer) for layer in streamed.base_model.model.model.layers] == layer_types
    assert all(p.device.type == device for p in streamed.parameters())
    _state_equal(streamed, resident)
    assert_traces_equal(train_steps(streamed, 2, device), train_steps(resident, 2, device))


def test_tied_embeddings_stay_tied_and_resident(device):
    streamed, _ = peft_pair("gemma", layers=3)  # gemma ties input and output embeddings
    stream(streamed, device, slots=2)
    inner = streamed.base_model.model
    assert inner.lm_head.weight is inner.model.embed_tokens.weight
    assert inner.lm_head.weight.device.type == device


def test_user_gradient_checkpointing_flag_is_accepted(device):
    streamed, resident = peft_pair("llama", layers=4)
    stream(streamed, device, slots=2)
    resident.to(device)
    streamed.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert_traces_equal(train_steps(streamed, 3, device), train_steps(resident, 3, device))


def test_a_gradient_checkpointing_flag_set_while_streamed_holds_once_unstreamed():
    """The layers checkpoint themselves while streamed and read False; the flag the script
    set meanwhile is the layers' own again after unstream_model, as on a model never streamed."""
    streamed, resident = peft_pair("llama", layers=4)
    stream(streamed, "cpu", slots=2)
    for model in (streamed, resident):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    layers = streamed.base_model.model.model.layers
    assert [layer.gradient_checkpointing for layer in layers] == [False] * 4
    layerstream.unstream_model(streamed)
    expected = [layer.gradient_checkpointing for layer in resident.base_model.model.model.layers]
    assert expected == [True] * 4 and [layer.gradient_checkpointing for layer in layers] == expected
    streamed.gradient_checkpointing_disable()
    assert [layer.gradient_checkpointing for layer in layers] == [False] * 4


def test_stats_report_the_required_counters(device):
    streamed, _ = peft_pair("llama", layers=5)
    stream(streamed, device, slots=3, prefetch=2)
    train_steps(streamed, 2, device)
    stats = layerstream.get_runtime(streamed).stats()
    for key in (
        "layer_loads",
        "h2d_bytes",
        "h2d_seconds",
        "stall_seconds",
        "peak_resident_layers",
        "slot_bytes",
        "host_bytes",
        "pinned",
    ):
        assert key in stats, key
    runtime = layerstream.get_runtime(streamed)
    assert stats["visits"] == 2 * 2 * 5
    assert stats["h2d_bytes"] == stats["layer_loads"] * runtime.records[0].nbytes
    assert stats["peak_resident_layers"] == 3
    assert stats["host_bytes"] >= sum(r.nbytes for r in runtime.records)
    assert stats["slot_bytes"] == 3 * runtime.pool.slot_bytes
    assert stats["h2d_seconds"] > 0


def test_copy_time_is_measured_on_one_copy_in_n_and_scaled_to_every_byte(device):
    """Timing a copy costs CUDA calls on the hot path, so one copy in TIMED_COPY_EVERY is
    timed (the first, then every n-th); h2d_seconds scales their time to all bytes copied,
    and h2d_gbps is their bandwidth."""
    streamed, _ = peft_pair("llama", layers=5)
    stream(streamed, device, slots=2, prefetch=1)
    train_steps(streamed, 8, device)
    runtime = layerstream.get_runtime(streamed)
    stats, pool = runtime.stats(), runtime.pool
    loads = stats["layer_loads"]
    assert loads > 2 * TIMED_COPY_EVERY
    assert pool._timed_bytes == -(-loads // TIMED_COPY_EVERY) * runtime.records[0].nbytes
    assert pool._timed_bytes < stats["h2d_bytes"]  # so the scaling below is not the identity
    assert stats["h2d_seconds"] == pytest.approx(pool._timed_seconds * stats["h2d_bytes"] / pool._timed_bytes)
    assert stats["h2d_seconds"] > pool._timed_seconds
    assert stats["h2d_gbps"] == pytest.approx(pool._timed_bytes / pool._timed_seconds / 1e9)


def _layer_tensors_streamed(model) -> int:
    return sum(len(record.entries) for record in layerstream.get_runtime(model).records)


def test_a_statistic_the_architecture_freezes_does_not_keep_the_layers_resident():
    """ERNIE-4.5-MoE freezes its expert-score correction bias, a one-row matrix, when it is
    built: fresh from from_pretrained, before PEFT, every layer tensor still streams (PEFT
    freezes them later), and the model then trains with LoRA as the resident one. Control:
    a weight matrix frozen by hand says what trains, and the trainable ones stay resident."""
    config = dict(moe_num_experts=4, moe_k=2, moe_intermediate_size=32, moe_layer_start_index=0)
    fresh = tiny_model("ernie4_5_moe", layers=4, **config)
    assert any(not p.requires_grad for p in fresh.parameters())  # the bias, frozen as built
    resident = get_peft_model(copy.deepcopy(fresh), lora_config())
    stream(fresh)
    every = sum(1 for layer in fresh.model.layers for _ in (*layer.parameters(), *layer.buffers()))
    assert _layer_tensors_streamed(fresh) == every
    streamed = get_peft_model(fresh, lora_config())
    streamed.load_state_dict(resident.state_dict())
    torch.manual_seed(0)
    expected = train_steps(resident, 2)
    torch.manual_seed(0)
    assert_traces_equal(train_steps(streamed, 2), expected)

    chosen = tiny_model("ernie4_5_moe", layers=4, **config)
    chosen.model.layers[0].self_attn.q_proj.weight.requires_grad_(False)
    stream(chosen)
    assert _layer_tensors_streamed(chosen) < every


def test_frozen_norms_say_what_trains_and_the_trained_matrices_stay_resident():
    """A user who froze the norms and trains every matrix chose what trains: the frozen norms
    stream, the matrices stay on the device, and the steps equal the resident model's."""
    model = tiny_model("llama", layers=3)
    for name, param in model.named_parameters():
        if "norm" in name:
            param.requires_grad_(False)
    resident = copy.deepcopy(model)
    stream(model)
    assert 0 < _layer_tensors_streamed(model) < sum(1 for _ in model.model.layers.parameters())
    torch.manual_seed(0)
    expected = train_steps(resident, 2)
    torch.manual_seed(0)
    assert_traces_equal(train_steps(model, 2), expected)
