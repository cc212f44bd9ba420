"""Debug checksums: on, they leave training exact; a slot with the wrong bytes after its
copy, or bytes changed between the copy and the use, stops at once with layer and slot."""

import pytest

import layerstream

from tiny import assert_traces_equal, batch, corrupt_copies, peft_pair, stream, train_steps


def _checked_pair(device, layers=5):
    streamed, resident = peft_pair("llama", layers=layers)
    stream(streamed, device, slots=2, prefetch=1, checksum=True)
    return streamed, resident.to(device)


def test_checksums_leave_training_exact_and_check_every_copy_and_visit(device):
    streamed, resident = _checked_pair(device)
    assert_traces_equal(train_steps(streamed, 3, device), train_steps(resident, 3, device))
    stats = layerstream.get_runtime(streamed).stats()
    assert stats["checksum_checks"] == stats["layer_loads"] + stats["visits"]


def test_wrong_bytes_after_a_copy_name_the_layer_and_slot(device):
    streamed, _ = _checked_pair(device)
    runtime = layerstream.get_runtime(streamed)
    other = runtime.records[0].host_region
    corrupt_copies(runtime, lambda layer, slot: other if layer == 3 else None)
    ids = batch(96, device=device)
    with pytest.raises(
        layerstream.SlotChecksumError, match=r"slot \d does not hold .*layers\.3 \(layer 3\) after its copy"
    ):
        streamed(input_ids=ids, labels=ids).loss.backward()


def test_bytes_changed_between_copy_and_use_are_caught_before_use(device):
    streamed, _ = _checked_pair(device)
    runtime = layerstream.get_runtime(streamed)
    pool = runtime.pool
    original = pool.acquire

    def acquire_after_corrupting(slot, layer, compute=None):
        if layer == 2:
            pool.buffers[slot][:64].add_(1)
        return original(slot, layer, compute)

    pool.acquire = acquire_after_corrupting
    ids = batch(96, device=device)
    with pytest.raises(layerstream.SlotChecksumError, match=r"\(layer 2\) before use"):
        streamed(input_ids=ids, labels=ids).loss.backward()


def test_the_environment_variable_turns_checksums_on(monkeypatch):
    monkeypatch.setenv("LAYERSTREAM_CHECKSUM", "1")
    assert layerstream.StreamConfig(device="cpu").checksum is True
    monkeypatch.delenv("LAYERSTREAM_CHECKSUM")
    assert layerstream.StreamConfig(device="cpu").checksum is False
