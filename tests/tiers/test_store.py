"""The host store (store.HostStore): layout, the model's tensors pointing into it, taking in
changes, and its inverse."""

import pytest
import torch

from layerstream.tiers.store import LAYOUT, SAME, VALUES, HostStore
from layerstream.units import ALIGN, arena_sizes

from tiny import tiny_model


def _store(layers=3, arena_bytes=1 << 20):
    model = tiny_model("llama", layers=layers)
    stack = model.model.layers
    records = [HostStore.plan_layer(i, f"layers.{i}", layer, lambda t: True) for i, layer in enumerate(stack)]
    values = [{n: t.detach().clone() for n, t in layer.state_dict().items()} for layer in stack]
    store = HostStore(arena_bytes, pin=False)
    store.build(records)
    return model, store, records, values


def test_each_tensor_starts_at_an_aligned_offset_in_one_region_per_layer():
    _, store, records, _ = _store()
    for record in records:
        assert all(e.offset % ALIGN == 0 for e in record.entries)
        assert record.host_region.numel() == record.nbytes
        assert max(e.offset + e.nbytes for e in record.entries) <= record.nbytes
    assert store.host_bytes >= sum(r.nbytes for r in records)


def test_the_models_parameters_keep_their_identity_values_and_point_into_the_arena():
    model, _, records, values = _store()
    for record, before in zip(records, values):
        layer = model.model.layers[record.index]
        region = (record.host_region.data_ptr(), record.host_region.data_ptr() + record.nbytes)
        for name, tensor in layer.state_dict(keep_vars=True).items():
            assert torch.equal(tensor, before[name]), name
            assert region[0] <= tensor.data_ptr() < region[1], name
        assert record.host_values[0] is record.entries[0].table[record.entries[0].name]


def test_sync_finds_nothing_new_values_a_new_tensor_or_a_new_layout():
    model, store, records, _ = _store()
    record = records[1]
    weight = model.model.layers[1].self_attn.q_proj.weight
    assert store.sync(record) == SAME
    with torch.no_grad():
        weight.mul_(2)  # in place: the region has it already
    assert store.sync(record) == VALUES and store.sync(record) == SAME
    replacement = torch.nn.Parameter(torch.ones_like(weight), requires_grad=False)
    model.model.layers[1].self_attn.q_proj.weight = replacement
    assert store.sync(record) == VALUES
    region = record.host_region.data_ptr()
    assert region <= replacement.data_ptr() < region + record.nbytes and torch.all(replacement == 1)
    model.model.layers[1].input_layernorm.weight.data = torch.ones(32, dtype=torch.float64)
    assert store.sync(record) == LAYOUT


def test_repack_lays_the_layer_out_again_for_what_the_model_holds():
    model, store, records, _ = _store()
    norm = model.model.layers[0].input_layernorm.weight
    norm.data = norm.data.to(torch.float64)
    store.repack(records[0])
    entry = next(e for e in records[0].entries if e.module is model.model.layers[0].input_layernorm)
    assert entry.dtype == torch.float64
    assert store.sync(records[0]) == SAME and norm.dtype == torch.float64


def test_copies_out_and_restore_give_every_tensor_memory_of_its_own_with_the_same_values():
    model, store, records, values = _store()
    for record in records:
        HostStore.restore(record, store.copies_out(record, torch.device("cpu")))
    store.release()
    for layer, before in zip(model.model.layers, values):
        for name, tensor in layer.state_dict().items():
            assert torch.equal(tensor, before[name]), name


@pytest.mark.parametrize(
    "sizes,arena,expected",
    [
        ([1000, 1000, 1000, 1000], 2500, [2000, 2000]),  # whole layers only: equal layers leave no gap
        ([1000, 1000, 1000], 10000, [3000]),  # never larger than what is left to store
        ([6000, 1000], 2500, [6000, 1000]),  # a layer larger than the arena gets one of its own
    ],
)
def test_arenas_hold_whole_layers_and_no_more_than_is_left(sizes, arena, expected):
    assert arena_sizes(sizes, arena) == [max(size, ALIGN) for size in expected]
