"""The slot pool (pool.SlotPool) on the host: owners, loads, backward slots."""

import pytest
import torch

from layerstream.errors import SlotOwnerError
from layerstream.tiers.pool import SlotPool
from layerstream.tiers.store import HostStore

from tiny import tiny_model


def _records(layers=3):
    model = tiny_model("llama", layers=layers)
    records = [
        HostStore.plan_layer(i, f"layers.{i}", layer, lambda t: True) for i, layer in enumerate(model.model.layers)
    ]
    store = HostStore(1 << 20, pin=False)
    store.build(records)
    return records


def test_a_load_copies_the_region_and_acquire_checks_the_owner():
    records = _records()
    pool = SlotPool(torch.device("cpu"), 2, max(r.nbytes for r in records))
    pool.load(records[1], 0)
    assert pool.owns(0, 1) and torch.equal(pool.buffers[0][: records[1].nbytes], records[1].host_region)
    pool.acquire(0, 1)
    with pytest.raises(SlotOwnerError, match="holds layer 1"):
        pool.acquire(0, 2)
    assert pool.loads == 1 and pool.h2d_bytes == records[1].nbytes


def test_slot_of_pointer_finds_the_slot_an_address_is_in():
    records = _records()
    pool = SlotPool(torch.device("cpu"), 2, max(r.nbytes for r in records))
    assert pool.slot_of_pointer(pool.buffers[1].data_ptr() + 8) == 1
    assert pool.slot_of_pointer(records[0].host_region.data_ptr()) is None


def test_backward_slots_hold_memory_only_between_allocate_and_free():
    records = _records()
    pool = SlotPool(torch.device("cpu"), 2, max(r.nbytes for r in records), backward_slots=1)
    assert not pool.allocated(2) and pool.total_bytes == pool.ring_bytes
    pool.allocate(2)
    pool.load(records[2], 2)
    assert pool.allocated(2) and pool.borrowed_peak_bytes == pool.slot_bytes
    pool.free(2)
    assert not pool.allocated(2) and pool.owner[2] is None
    with pytest.raises(ValueError, match="ring slot"):
        pool.free(0)


def test_forget_empties_every_slot_and_gives_backward_slots_back():
    records = _records()
    pool = SlotPool(torch.device("cpu"), 2, max(r.nbytes for r in records), backward_slots=1)
    pool.load(records[0], 0)
    pool.allocate(2)
    pool.load(records[1], 2)
    pool.forget()
    assert pool.owner == [None, None, None] and not pool.allocated(2)
