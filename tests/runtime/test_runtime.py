"""The runtime (runtime.StreamRuntime): visits, copies, the window, and changed layers."""

import torch

import layerstream
from layerstream.modules import swap

from tiny import assert_traces_equal, batch, peft_pair, stream, train_steps


def _streamed(layers=6):
    streamed, resident = peft_pair("llama", layers=layers)
    stream(streamed, "cpu", slots=2, prefetch=1)
    return streamed, resident, layerstream.get_runtime(streamed)


def test_a_training_step_visits_each_layer_twice_and_copies_the_rest_of_the_turnarounds():
    streamed, _, runtime = _streamed()
    train_steps(streamed, 1)
    before = runtime.stats()
    train_steps(streamed, 1)
    after = runtime.stats()
    assert after["visits"] - before["visits"] == 2 * 6
    assert after["layer_loads"] - before["layer_loads"] == 2 * (6 - 2)  # 2 slots kept at each turnaround
    assert after["demand_loads"] == before["demand_loads"]


def test_set_window_keeps_those_layers_on_the_device_and_streams_the_rest():
    streamed, resident, runtime = _streamed()
    runtime.set_window([0, 5])
    assert runtime.window == [0, 5] and runtime.prefetch.num_layers == 4
    assert_traces_equal(train_steps(streamed, 2), train_steps(resident, 2))


def test_a_changed_layer_leaves_its_slot_and_is_copied_again_at_its_visit():
    streamed, resident, runtime = _streamed()
    train_steps(streamed, 1), train_steps(resident, 1)
    held = next(iter(runtime.prefetch.slot_of))  # a layer still in a slot after the step
    for model in (streamed, resident):
        with torch.no_grad():
            model.base_model.model.model.layers[held].mlp.up_proj.base_layer.weight.add_(0.5)
    before = runtime.stats()
    ids = batch(96)
    with torch.no_grad():
        assert torch.equal(streamed(input_ids=ids).logits, resident(input_ids=ids).logits)
    assert runtime.stats()["refreshed_layers"] == before["refreshed_layers"] + 1


def test_moving_to_the_device_it_streams_to_changes_nothing():
    streamed, resident, runtime = _streamed()
    pool = runtime.pool
    runtime.move_to("cpu")
    assert runtime.pool is pool
    assert_traces_equal(train_steps(streamed, 1), train_steps(resident, 1))


def test_a_streamed_layer_runs_its_class_forward_not_one_wrapped_again():
    """transformers >= 5.23 wraps the forward of every subclass of a decoder layer for
    gradient checkpointing; the streamed layer's class (a subclass made by layerstream) keeps
    the original class's forward, so each visit calls it once, unwrapped again."""
    streamed, resident = peft_pair("llama", layers=3)
    layer = streamed.base_model.model.model.layers[0]
    original = type(layer).forward
    stream(streamed, "cpu", slots=2)
    assert swap.original_class(layer) is not type(layer)  # streaming swapped its class
    assert type(layer).forward is original
    assert_traces_equal(train_steps(streamed, steps=2), train_steps(resident, steps=2))
