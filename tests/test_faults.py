"""After an error inside a streamed layer (forward, backward recompute, or an interrupt),
slots, owners and the planner stay consistent and the next steps give the same result
as a run that never failed."""

import pytest
import torch

import layerstream
from tiny import assert_traces_equal, batch, peft_pair, stream, train_steps


class Injected(Exception):
    pass


def _fail_once(monkeypatch, layer, exc, when):
    original = type(layer).forward
    fired = []

    def forward(self, *args, **kwargs):
        if self is layer and not fired and when():
            fired.append(True)
            raise exc
        return original(self, *args, **kwargs)

    monkeypatch.setattr(type(layer), "forward", forward)
    return fired


def _in_backward():
    return torch._C._current_graph_task_id() >= 0


@pytest.mark.parametrize("exc,when", [
    (Injected("forward"), lambda: not _in_backward()),
    (Injected("recompute"), _in_backward),
    (KeyboardInterrupt(), lambda: not _in_backward()),
], ids=["forward", "backward-recompute", "interrupt"])
def test_a_failed_step_leaves_the_next_steps_exact(monkeypatch, exc, when):
    streamed, resident = peft_pair("llama", layers=5)
    stream(streamed, "cpu", slots=2, prefetch=1)
    assert_traces_equal(train_steps(streamed, 2), train_steps(resident, 2))
    layer = streamed.base_model.model.model.layers[2]
    fired = _fail_once(monkeypatch, layer, exc, when)
    ids = batch(96)
    with pytest.raises(type(exc)):
        streamed(input_ids=ids, labels=ids).loss.backward()
    assert fired
    streamed.zero_grad(set_to_none=True)
    runtime = layerstream.get_runtime(streamed)
    assert runtime.planner.owner == runtime.pool.owner, "planner and pool must agree on slot owners"
    for entry, host in zip(runtime.records[2].entries, runtime.records[2].host_values):
        if entry.bound:
            assert entry.table[entry.name] is host, "host tensors must be bound back after the error"
    assert_traces_equal(train_steps(streamed, 3), train_steps(resident, 3))
