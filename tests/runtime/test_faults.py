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


@pytest.mark.parametrize(
    "exc,when",
    [
        (Injected("forward"), lambda: not _in_backward()),
        (Injected("recompute"), _in_backward),
        (KeyboardInterrupt(), lambda: not _in_backward()),
        (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), lambda: not _in_backward()),
    ],
    ids=["forward", "backward-recompute", "interrupt", "out-of-memory"],
)
def test_a_failed_step_leaves_the_next_steps_exact(monkeypatch, exc, when):
    streamed, resident = peft_pair("llama", layers=5)
    stream(streamed, "cpu", slots=2, prefetch=1)
    assert_traces_equal(train_steps(streamed, 2), train_steps(resident, 2))
    layer = streamed.base_model.model.model.layers[2]
    fired = _fail_once(monkeypatch, layer, exc, when)
    ids = batch(96)
    with pytest.raises(type(exc)) as raised:
        streamed(input_ids=ids, labels=ids).loss.backward()
    assert fired
    if isinstance(exc, torch.OutOfMemoryError):
        message = str(raised.value)
        assert message.startswith("CUDA out of memory. Tried to allocate 2.00 GiB")
        assert "ran out of memory in streamed layer base_model.model.model.layers.2" in message
        assert "2 slots x" in message and "shorten sequences or the batch" in message
        assert "quantization='nf4'" in message and "layerstream plan" in message
    streamed.zero_grad(set_to_none=True)
    runtime = layerstream.get_runtime(streamed)
    assert runtime.prefetch.owner == runtime.pool.owner, "planner and pool must agree on slot owners"
    for entry, host in zip(runtime.records[2].entries, runtime.records[2].host_values):
        if entry.bound:
            assert entry.table[entry.name] is host, "host tensors must be bound back after the error"
    assert_traces_equal(train_steps(streamed, 3), train_steps(resident, 3))


def test_out_of_memory_in_a_streamed_step_outside_the_layers_names_the_budgets(tmp_path, monkeypatch):
    """An out-of-memory error anywhere in a Trainer step (here: the head) is explained once."""
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    model, _ = peft_pair("llama", layers=4)
    stream(model, "cpu", slots=3, prefetch=1)
    head = model.base_model.model.lm_head

    def forward(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB")

    monkeypatch.setattr(head, "forward", forward)
    data = Dataset.from_list([{"input_ids": [3, 4, 5, 6], "labels": [3, 4, 5, 6]}] * 4)
    args = TrainingArguments(
        output_dir=str(tmp_path),
        use_cpu=True,
        report_to=[],
        max_steps=1,
        per_device_train_batch_size=2,
        save_strategy="no",
    )
    with pytest.raises(torch.OutOfMemoryError) as raised:
        Trainer(model=model, args=args, train_dataset=data).train()
    message = str(raised.value)
    assert message.count("layerstream: the GPU ran out of memory") == 1
    assert "in a training step" in message and "StreamConfig(slots=2)" in message


def test_an_exception_in_a_trainer_callback_leaves_the_next_steps_exact(tmp_path):
    """A callback raising between backward and the optimizer step ends train(); the
    streamed model then trains exactly like a resident copy of the same weights."""
    from datasets import Dataset
    from transformers import Trainer, TrainerCallback, TrainingArguments

    class Failing(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            if state.global_step == 1:
                raise Injected("callback")

    streamed, resident = peft_pair("llama", layers=5)
    stream(streamed, "cpu", slots=2, prefetch=1)
    data = Dataset.from_list([{"input_ids": [3, 4, 5, 6, 7], "labels": [3, 4, 5, 6, 7]}] * 8)
    args = TrainingArguments(
        output_dir=str(tmp_path),
        use_cpu=True,
        report_to=[],
        max_steps=4,
        per_device_train_batch_size=2,
        save_strategy="no",
        learning_rate=1e-2,
    )
    with pytest.raises(Injected):
        Trainer(model=streamed, args=args, train_dataset=data, callbacks=[Failing()]).train()
    runtime = layerstream.get_runtime(streamed)
    assert runtime.prefetch.owner == runtime.pool.owner
    streamed.zero_grad(set_to_none=True)
    trained = {k: v for k, v in streamed.state_dict().items() if "lora_" in k}
    assert trained, "the adapters must be in the state dict"
    resident.load_state_dict(trained, strict=False)
    assert_traces_equal(train_steps(streamed, 3), train_steps(resident, 3))
