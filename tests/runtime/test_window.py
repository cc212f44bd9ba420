"""The resident window: layers kept on the device for good stream no more, everything
stays exact, and a VRAM budget picks how many layers the window holds."""

import pytest
import torch

import layerstream
from layerstream import plan
from layerstream.decisions.schedule import spread_resident

from tiny import assert_traces_equal, batch, nf4_pair, peft_pair, stream, train_steps, trainer_losses


def test_window_layers_are_not_copied_and_training_stays_exact(device):
    streamed, resident = peft_pair("llama", layers=6)
    stream(streamed, device, slots=2, prefetch=1)
    resident.to(device)
    runtime = layerstream.get_runtime(streamed)
    runtime.set_window([1, 3])
    assert runtime.window == [1, 3]
    assert_traces_equal(train_steps(streamed, 4, device), train_steps(resident, 4, device))
    before = runtime.stats()
    train_steps(streamed, 1, device)
    after = runtime.stats()
    assert after["window_layers"] == 2
    # 4 streamed layers, 2 slots: a steady step copies 2 x (4 - 2) layers, none of the window
    assert after["layer_loads"] - before["layer_loads"] == 4


def test_the_window_bytes_are_the_ones_computed_with():
    """Negative control: corrupting a window layer's device copy must change the results."""
    streamed, resident = peft_pair("llama", layers=6)
    stream(streamed, "cpu", slots=2, prefetch=1)
    runtime = layerstream.get_runtime(streamed)
    runtime.set_window([2])
    runtime.resident_window.buffers[2].zero_()
    with pytest.raises(AssertionError):
        assert_traces_equal(train_steps(streamed, 1), train_steps(resident, 1))


def test_window_generation_matches_resident(device):
    streamed, resident = peft_pair("llama", layers=5)
    stream(streamed, device, slots=2, prefetch=1)
    resident.to(device)
    layerstream.get_runtime(streamed).set_window([0, 4])
    ids = batch(96, size=2, seq=6, device=device)
    kwargs = dict(max_new_tokens=6, do_sample=False, attention_mask=torch.ones_like(ids), pad_token_id=0)
    assert torch.equal(streamed.generate(input_ids=ids, **kwargs), resident.generate(input_ids=ids, **kwargs))


def test_nf4_window_layers_stay_exact(tmp_path):
    streamed, resident = nf4_pair(tmp_path, layers=5)
    stream(streamed, "cpu", slots=2, prefetch=1)
    layerstream.get_runtime(streamed).set_window([1, 2])
    assert_traces_equal(train_steps(streamed, 3), train_steps(resident, 3))


def _budget_for(model, extra_layers, seq=12, batch_size=2, slots=2):
    """A budget whose room, beside the planned step and the window's margin, holds
    ``extra_layers`` layers and half a layer more."""
    from layerstream.decisions.window import margin_bytes

    memory = plan.plan_for_model(model, seq, batch_size, slots=slots)
    largest = layerstream.get_runtime(model).store.largest_layer_bytes
    need = memory.peak_vram_bytes + memory.reserve_bytes + extra_layers * largest + largest // 2
    budget = need + margin_bytes(need)
    while budget - margin_bytes(budget) < need:
        budget += largest // 4
    return budget


def _stream_with_window_room(model, extra_layers: int):
    """Stream ``model`` on the host under a budget with room for ``extra_layers`` window
    layers (``_budget_for``, which plans the model as it streams); returns its runtime."""
    stream(model, "cpu", slots=2, prefetch=1)
    budget = _budget_for(model, extra_layers=extra_layers)
    layerstream.unstream_model(model)
    stream(model, "cpu", slots=2, prefetch=1, vram_budget=budget)
    return layerstream.get_runtime(model)


def test_a_vram_budget_keeps_as_many_layers_as_fit(caplog):
    """The first step runs with no window; from what it used (on the host: the planner's
    stand-in for a measurement), the window takes the layers that fit."""
    streamed, resident = peft_pair("llama", layers=6)
    runtime = _stream_with_window_room(streamed, extra_layers=3)
    with caplog.at_level("WARNING", logger="layerstream"):
        assert_traces_equal(train_steps(streamed, 1), train_steps(resident, 1))
        assert runtime.window == []
        assert_traces_equal(train_steps(streamed, 3), train_steps(resident, 3))
    assert len(runtime.window) == 3 and "resident window 0 -> 3 of 6 layers" in caplog.text
    assert runtime.window == spread_resident(6, 3)
    assert runtime.stats()["window_changes"] == 1


def test_a_larger_batch_shape_shrinks_the_window_and_stays_exact():
    streamed, resident = peft_pair("llama", layers=6)
    runtime = _stream_with_window_room(streamed, extra_layers=4)
    assert_traces_equal(train_steps(streamed, 2), train_steps(resident, 2))
    first = len(runtime.window)
    assert first == 4
    assert_traces_equal(train_steps(streamed, 2, batch_size=4), train_steps(resident, 2, batch_size=4))
    assert 0 < len(runtime.window) < first
    assert_traces_equal(train_steps(streamed, 1), train_steps(resident, 1))
    assert 0 < len(runtime.window) < first, "a smaller shape later must not grow the window again"


def test_no_budget_streams_every_layer():
    streamed, resident = peft_pair("llama", layers=6)
    stream(streamed, "cpu", slots=2, prefetch=1, vram_budget=None)
    assert_traces_equal(train_steps(streamed, 3), train_steps(resident, 3))
    assert layerstream.get_runtime(streamed).window == []


def test_an_auto_budget_leaves_out_memory_other_processes_hold(monkeypatch, caplog):
    from layerstream import config as config_mod

    gib = 2**30
    # a 24 GiB card: 20 GiB free, 2 GiB reserved by this run's allocator, so 2 GiB are
    # held elsewhere (a display, another job)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (20 * gib, 24 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 2 * gib)
    monkeypatch.setattr(config_mod, "per_process_fraction", lambda device: 1.0)
    monkeypatch.setattr(config_mod, "_warned_foreign_memory", set())
    with caplog.at_level("WARNING", logger="layerstream"):
        assert config_mod.gpu_memory_for_run(torch.device("cuda", 0)) == 22 * gib
    assert "vram_budget='auto' is 22.00 GiB, not the GPU's 24.00 GiB" in caplog.text
    # said once per device: a YAML run resolves its budget more than once
    caplog.clear()
    with caplog.at_level("WARNING", logger="layerstream"):
        assert config_mod.gpu_memory_for_run(torch.device("cuda", 0)) == 22 * gib
    assert caplog.text == ""
    # an idle card: all of it, and no warning
    caplog.clear()
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (23.6 * gib, 24 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    with caplog.at_level("WARNING", logger="layerstream"):
        assert config_mod.gpu_memory_for_run(torch.device("cuda", 0)) == 23.6 * gib
    assert caplog.text == ""
    # a per-process memory fraction (a smaller card stood in for) caps it
    monkeypatch.setattr(config_mod, "per_process_fraction", lambda device: 0.5)
    assert config_mod.gpu_memory_for_run(torch.device("cuda", 0)) == 12 * gib


def test_stream_config_and_yaml_resolve_an_auto_budget_the_same_way(monkeypatch):
    from layerstream import config as config_mod
    from layerstream.commands import train_config as train

    monkeypatch.setattr(config_mod, "gpu_memory_for_run", lambda device: 7 * 2**30)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    config = config_mod.StreamConfig(device="cuda:0")
    assert config.vram_budget == "auto" and config.budget_bytes() == 7 * 2**30
    yaml_config = {"stream": {"vram_budget": "auto", "device": "cuda:0"}}
    monkeypatch.setattr(train, "_device", lambda config: torch.device("cuda", 0))
    assert train.parse_stream_section(yaml_config, "run.yaml").budget_bytes() == 7 * 2**30
    assert config_mod.StreamConfig(device="cpu").vram_budget is None, "auto means no budget on the host"


@pytest.mark.gpu
def test_an_auto_budget_on_cuda_is_what_the_driver_reports_free_for_this_run():
    from layerstream.config import StreamConfig, per_process_fraction

    held = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")  # this run's own memory
    free, total = torch.cuda.mem_get_info()
    budget = StreamConfig(device="cuda", vram_budget="auto").budget_bytes()
    # what the allocator holds (at least the 256 MiB above) counts; nothing beyond the card
    assert free + held.numel() <= budget <= total
    cap = int(per_process_fraction(torch.device("cuda", torch.cuda.current_device())) * total)
    assert budget == min(total, free + torch.cuda.memory_reserved(), cap)


@pytest.mark.parametrize("accumulation", [1, 2])
def test_a_step_that_runs_out_of_memory_is_run_again_with_a_smaller_window_and_stays_exact(
    tmp_path, caplog, accumulation
):
    """The memory a measured step used is no promise for the next: when a step runs out of
    memory with a window (here in the backward of the fourth micro-batch, after later layers'
    gradients accumulated), the window shrinks and the step runs again from the same
    gradients and random state; the losses are the uninterrupted run's (LoRA dropout on)."""
    streamed, resident = peft_pair("llama", layers=6, lora={"lora_dropout": 0.1})
    plain = trainer_losses(resident, tmp_path / "plain", accumulation=accumulation)
    runtime = _stream_with_window_room(streamed, extra_layers=4)
    layer = streamed.base_model.model.model.layers[1]
    calls = {"n": 0, "raised": False}

    def out_of_memory_in_a_backward(module, args):
        calls["n"] += 1
        if runtime.window and not calls["raised"] and calls["n"] == 8:  # the recompute of micro-batch 4
            calls["raised"] = True
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB")

    layer.register_forward_pre_hook(out_of_memory_in_a_backward)
    with caplog.at_level("WARNING", logger="layerstream"):
        got = trainer_losses(streamed, tmp_path / "streamed", accumulation=accumulation)
    assert calls["raised"] and runtime.stats()["oom_retries"] == 1
    assert "runs again from where it started" in caplog.text
    assert got == plain


def test_a_step_that_runs_out_of_memory_after_an_unseen_new_parameter_is_not_run_again(tmp_path):
    """A trainable parameter put into the model without a registration (``_parameters[...] =``)
    is not in the step state: its gradient could not be put back, so a step that runs out of
    memory stops with the explained error instead of running again with a wrong gradient."""
    from transformers import TrainerCallback

    streamed, _ = peft_pair("llama", layers=6)
    runtime = _stream_with_window_room(streamed, extra_layers=4)
    head = streamed.base_model.model.lm_head
    raised = []

    class NewBias(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 3:  # after a step with a window read the parameters
                head._parameters["bias"] = torch.nn.Parameter(torch.zeros(head.out_features))

    def out_of_memory(module, args):
        if runtime.window and head._parameters.get("bias") is not None and not raised and torch.is_grad_enabled():
            raised.append(True)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB")

    streamed.base_model.model.model.layers[1].register_forward_pre_hook(out_of_memory)
    with pytest.raises(torch.OutOfMemoryError, match="layerstream: the GPU ran out of memory"):
        trainer_losses(streamed, tmp_path / "streamed", steps=5, callbacks=[NewBias()])
    assert raised and runtime.stats()["oom_retries"] == 0


def test_the_parameters_a_step_restores_are_walked_again_only_after_a_registration():
    """The retry's step state reads the model's parameters at every step; the walk over every
    module is kept until a parameter is registered anywhere, or the model is another."""
    from types import SimpleNamespace

    from layerstream.integrations.trainer import _parameters

    model, other = torch.nn.Sequential(torch.nn.Linear(2, 2)), torch.nn.Linear(2, 2)
    trainer = SimpleNamespace()
    first = _parameters(trainer, model)
    assert [id(p) for p in first] == [id(p) for p in model.parameters()]
    walks = []
    model.parameters = lambda *a, **k: walks.append(1) or torch.nn.Module.parameters(model, *a, **k)
    assert [id(p) for p in _parameters(trainer, model)] == [id(p) for p in first] and not walks
    del model.parameters
    model[0].extra = torch.nn.Parameter(torch.zeros(1))
    assert [id(p) for p in _parameters(trainer, model)] == [id(p) for p in model.parameters()]
    assert [id(p) for p in _parameters(trainer, other)] == [id(p) for p in other.parameters()]


def test_an_out_of_memory_error_without_a_window_is_explained_and_raised(tmp_path):
    streamed, _ = peft_pair("llama", layers=4)
    stream(streamed, "cpu", slots=2, prefetch=1, vram_budget=None)

    def out_of_memory(module, args):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB")

    streamed.base_model.model.model.layers[2].register_forward_pre_hook(out_of_memory)
    with pytest.raises(torch.OutOfMemoryError, match="layerstream: the GPU ran out of memory"):
        trainer_losses(streamed, tmp_path / "streamed", steps=1)


@pytest.mark.gpu
def test_on_cuda_the_window_is_sized_from_measured_memory_and_stays_exact():
    """vram_budget="auto" (the default): the first step streams every layer; what it used,
    measured, leaves room for the whole tiny model, which then stays on the GPU."""
    streamed, resident = peft_pair("llama", layers=6)
    layerstream.stream_model(streamed, slots=2, prefetch=1)
    streamed.cuda(), resident.cuda()
    runtime = layerstream.get_runtime(streamed)
    assert runtime.config.vram_budget == "auto"
    assert_traces_equal(train_steps(streamed, 1, "cuda"), train_steps(resident, 1, "cuda"))
    assert runtime.window == []
    assert_traces_equal(train_steps(streamed, 3, "cuda"), train_steps(resident, 3, "cuda"))
    assert runtime.window == list(range(6)) and runtime.resident_window.sizer.reference.peak_reserved > 0
    before = runtime.stats()["layer_loads"]
    train_steps(streamed, 1, "cuda")
    assert runtime.stats()["layer_loads"] == before, "window layers are not copied"


def test_the_window_is_sized_only_after_a_backward_and_not_before_an_optimizer_step(monkeypatch):
    """Two forwards before one backward (a custom loss), or a forward with no backward, are
    one step still under way: the window is not read or resized in between. And it does not
    grow while gradients are only accumulated: the optimizer's state is not there yet."""
    streamed, _ = peft_pair("llama", layers=6)
    runtime = _stream_with_window_room(streamed, extra_layers=3)
    readings = []
    real = runtime.resident_window.sizer.record
    monkeypatch.setattr(
        runtime.resident_window.sizer, "record", lambda reading: readings.append(reading) or real(reading)
    )
    params = [p for p in streamed.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    streamed.train()
    ids = batch(96, size=2, seq=10, seed=0)
    first = streamed(input_ids=ids, labels=ids).loss
    second = streamed(input_ids=ids, labels=ids).loss
    assert readings == [], "no reading between two forwards of one step"
    (first + second).backward()
    streamed(input_ids=ids, labels=ids).loss.backward()  # accumulating: gradients kept
    assert len(readings) == 1 and readings[0].grads_at_end
    assert runtime.window == [], "no growth before an optimizer step was read"
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    streamed(input_ids=ids, labels=ids)  # read here; its own backward never comes
    assert len(readings) == 2 and not readings[-1].grads_at_end
    assert len(runtime.window) == 3, "grown once the optimizer stepped"
    streamed(input_ids=ids, labels=ids).loss.backward()
    assert len(readings) == 2, "the forward without a backward was no step of its own"


def test_a_model_the_planner_cannot_describe_trains_under_a_budget_on_the_host_without_a_window(caplog):
    """On the host the planner stands in for the measurement; adapters it cannot describe
    (a regex of target modules) leave the budget unchecked, said once, and no window grows
    on a guess: the run trains as the resident model does."""
    streamed, resident = peft_pair("llama", layers=4, lora={"target_modules": r".*\.(q_proj|v_proj)"})
    stream(streamed, "cpu", slots=2, vram_budget="2GiB")
    with caplog.at_level("WARNING", logger="layerstream"):
        assert_traces_equal(train_steps(streamed, 3), train_steps(resident, 3))
    assert layerstream.get_runtime(streamed).window == []
    assert "vram_budget is not checked for this model" in caplog.text
