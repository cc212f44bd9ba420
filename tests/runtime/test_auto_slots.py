"""slots and prefetch left to "auto": what they resolve to, how a budget changes them,
and that the choice is shown and survives replace()."""

import layerstream
from layerstream import StreamConfig
from layerstream.config import AUTO_SLOTS

from tiny import peft_pair


def test_auto_is_three_slots_copying_as_far_ahead_as_they_allow():
    config = StreamConfig(device="cpu")
    assert (config.slots, config.prefetch) == (AUTO_SLOTS, AUTO_SLOTS - 1) == (3, 2)
    assert config.automatic == {"slots", "prefetch", "backward_slots"}


def test_explicit_values_are_kept_and_auto_prefetch_follows_slots():
    assert StreamConfig(device="cpu", slots=5, prefetch=1, backward_slots=0).automatic == set()
    config = StreamConfig(device="cpu", slots=5, backward_slots=2)
    assert (config.slots, config.prefetch, config.automatic) == (5, 4, {"prefetch"})
    # replace() chooses automatic fields again: prefetch follows the new slot count
    assert config.replace(slots=2).prefetch == 1


def test_a_budget_that_holds_only_two_layers_gets_two_slots():
    streamed, _ = peft_pair("llama", layers=5)
    layer_bytes = sum(
        p.numel() * p.element_size() for n, p in streamed.named_parameters() if ".layers.0." in n and "lora" not in n
    )
    layerstream.stream_model(streamed, device="cpu", vram_budget=int(2.5 * layer_bytes))
    runtime = layerstream.get_runtime(streamed)
    assert (runtime.config.slots, runtime.config.prefetch) == (2, 1)
    assert "2 slots (auto)" in runtime.summary() and "ahead (auto)" in runtime.summary()


def test_a_roomy_budget_keeps_three_slots_and_explicit_slots_are_not_lowered():
    streamed, _ = peft_pair("llama", layers=5)
    layerstream.stream_model(streamed, device="cpu", vram_budget="1GiB")
    assert layerstream.get_runtime(streamed).config.slots == 3
    streamed, _ = peft_pair("llama", layers=5)
    layerstream.stream_model(streamed, device="cpu", slots=4, prefetch=1)
    runtime = layerstream.get_runtime(streamed)
    assert (runtime.config.slots, runtime.config.prefetch) == (4, 1)
    lines = {line.split()[0]: line for line in runtime.summary().splitlines()[1:]}
    assert "(auto)" not in lines["device"] and "(auto)" not in lines["prefetch"]
