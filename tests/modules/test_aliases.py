"""Tensors outside the model that share a streamed weight's memory (taken before
stream_model) are named once: the streamed model computes from its own copy from then on."""

import copy

import torch

from tiny import peft_pair, stream


def _streamed_with(caplog, hold):
    model, resident = peft_pair("llama", layers=3)
    held = hold(model)
    with caplog.at_level("WARNING", logger="layerstream"):
        stream(model, "cpu")
    return model, resident, held


def test_a_state_dict_taken_before_streaming_is_said_and_writes_through_it_do_not_reach_the_model(caplog):
    model, resident, held = _streamed_with(caplog, lambda m: m.state_dict())
    assert "share their memory with tensors held outside the model" in caplog.text
    assert "layers.0.self_attn.q_proj.base_layer.weight" in caplog.text
    ids = torch.randint(3, 90, (1, 6), generator=torch.Generator().manual_seed(0))
    before = model(input_ids=ids).logits.detach()
    name = next(n for n in held if n.endswith("layers.1.mlp.up_proj.base_layer.weight"))
    with torch.no_grad():
        held[name].mul_(2)
    assert torch.equal(model(input_ids=ids).logits.detach(), before), "the write did not reach the streamed model"


def test_a_detached_weight_held_before_streaming_is_named(caplog):
    _streamed_with(caplog, lambda m: m.base_model.model.model.layers[2].mlp.down_proj.base_layer.weight.detach())
    assert "1 streamed layer tensor(s) (base_model.model.model.layers.2.mlp.down_proj.base_layer.weight)" in caplog.text


def test_nothing_is_said_where_only_the_model_holds_its_weights(caplog):
    """Control: a model and a deep copy of it (its own memory) stream without the warning."""
    _streamed_with(caplog, lambda m: copy.deepcopy(m.state_dict()))
    assert "held outside the model" not in caplog.text
