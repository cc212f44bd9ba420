"""Bad input fails early with a message that says what to do."""

import copy
import re

import pytest
import torch
from torch import nn

import layerstream
from layerstream import StreamConfig, StreamConfigError, units
from layerstream.units import GiB, MiB

from tiny import assert_traces_equal, batch, peft_pair, stream, tiny_model, train_steps


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(slots=1), "slots=1 is too few"),
        (dict(slots=3, prefetch=3), "prefetch must be >= 1 and < slots"),
        (dict(slots=3, prefetch=0), "prefetch must be >= 1.*Use prefetch from 1 to 2"),
        (dict(slots=3, prefetch=4), "Use prefetch <= 2 or raise slots to 5"),
        (dict(slots="3"), "slots must be an integer"),
        (dict(slots="many"), "slots must be an integer >= 2 or 'auto'"),
        (dict(prefetch="ahead"), "prefetch must be an integer >= 1 or 'auto'"),
        (dict(device="tpu"), "not a torch device|streams to CUDA devices"),
        (dict(device="cpu", pin=True), "pin=True needs a CUDA device"),
        (dict(arena_bytes=10), "arena_bytes"),
        (dict(vram_budget="12 gigs"), "vram_budget: unknown unit"),
        (dict(vram_budget=0), "vram_budget must be a positive size"),
    ],
)
def test_config_values_out_of_range(kwargs, match):
    kwargs.setdefault("device", "cpu")
    with pytest.raises(StreamConfigError, match=match):
        StreamConfig(**kwargs)


def test_unknown_config_field():
    with pytest.raises(StreamConfigError, match="unknown StreamConfig field"):
        StreamConfig(device="cpu").replace(slotz=3)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU default")
def test_default_device_without_cuda_says_what_to_pass():
    with pytest.raises(StreamConfigError, match="device='cpu'"):
        StreamConfig()


def test_streaming_twice():
    model = tiny_model(layers=3)
    layerstream.stream_model(model, device="cpu")
    with pytest.raises(layerstream.StreamingError, match="already streamed"):
        layerstream.stream_model(model, device="cpu")


def test_model_on_meta():
    with torch.device("meta"):
        model = tiny_model(layers=3)
    with pytest.raises(layerstream.StreamingError, match="meta device"):
        layerstream.stream_model(model, device="cpu")


@pytest.mark.gpu
def test_a_model_already_on_the_gpu_streams_from_there_and_frees_its_layers(caplog):
    from tiny import assert_traces_equal, peft_pair, train_steps

    streamed, resident = peft_pair("llama", layers=5)
    streamed.cuda(), resident.cuda()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    with caplog.at_level("WARNING", logger="layerstream"):
        layerstream.stream_model(streamed, slots=2, prefetch=1, vram_budget=None)
    runtime = layerstream.get_runtime(streamed)
    assert runtime.device.type == "cuda" and "moved into the host store" in caplog.text
    assert all(v.device.type == "cpu" for r in runtime.records for v in r.host_values)
    assert torch.cuda.memory_allocated() < before, "the layers' GPU memory was freed"
    assert_traces_equal(train_steps(streamed, 3, "cuda"), train_steps(resident, 3, "cuda"))


def test_model_without_a_decoder_stack():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with pytest.raises(layerstream.NoDecoderStackError, match="GradientCheckpointingLayer"):
        layerstream.stream_model(model, device="cpu")


def test_training_streamed_weights_without_freezing():
    model = tiny_model(layers=3)
    layerstream.stream_model(model, device="cpu")
    ids = torch.randint(3, 90, (1, 6))
    with pytest.raises(layerstream.StreamingError, match="requires grad.*Freeze"):
        model(input_ids=ids, labels=ids)


def test_input_left_on_another_device():
    model = tiny_model(layers=3)
    layerstream.stream_model(model, device="cpu")
    runtime = layerstream.get_runtime(model)
    runtime.device = torch.device("meta")  # stands in for "streams to cuda, input on cpu"
    with pytest.raises(layerstream.StreamingError, match=r"model.to\("):
        model(input_ids=torch.randint(3, 90, (1, 6)))


def test_torch_compile_of_a_streamed_model():
    streamed, _ = peft_pair("llama", layers=3)
    stream(streamed, "cpu")
    compiled = torch.compile(streamed, backend="eager", fullgraph=False)
    with pytest.raises(Exception, match="torch.compile cannot trace a streamed"):
        with torch.no_grad():
            compiled(input_ids=torch.randint(3, 90, (1, 6)))


@pytest.mark.gpu
def test_cuda_graph_capture_of_a_streamed_model():
    streamed, _ = peft_pair("llama", layers=3)
    stream(streamed, "cuda")
    ids = torch.randint(3, 90, (1, 6), device="cuda")
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(Exception, match="CUDA graph capture"):
        with torch.no_grad(), torch.cuda.graph(graph):
            streamed(input_ids=ids)


def test_moving_to_a_device_other_than_the_stream_device_is_refused():
    streamed, _ = peft_pair("llama", layers=3)
    stream(streamed, "cpu")

    class Probe:  # what t.to("cuda:7") would return, without needing eight GPUs
        def __init__(self, tensor):
            self.dtype, self.device = tensor.dtype, torch.device("cuda", 7)

    with pytest.raises(layerstream.StreamingError, match="moving it to cuda:7"):
        layerstream.get_runtime(streamed).check_apply(Probe)


def test_get_runtime_of_a_plain_model():
    with pytest.raises(layerstream.StreamingError, match="not streamed"):
        layerstream.get_runtime(tiny_model(layers=2))


def test_kv_cache_with_past_tokens_under_autograd():
    """Refused, and the cache stays usable: decoding from it under no_grad afterwards gives
    the resident model's logits."""
    streamed, resident = peft_pair("llama", layers=3)
    stream(streamed, "cpu")
    ids = torch.randint(3, 90, (1, 6))
    with torch.no_grad():
        cache = streamed(input_ids=ids, use_cache=True).past_key_values
        expected = resident(input_ids=ids, use_cache=True).past_key_values
    with pytest.raises(layerstream.StreamingError, match="torch.no_grad"):
        streamed(input_ids=ids[:, :1], past_key_values=cache, use_cache=True)
    with torch.no_grad():
        got = streamed(input_ids=ids[:, -1:], past_key_values=cache, use_cache=True).logits
        assert torch.equal(got, resident(input_ids=ids[:, -1:], past_key_values=expected, use_cache=True).logits)


def test_decoding_from_a_cache_a_forward_with_autograd_left_unfilled_is_refused():
    """An eval-mode forward with autograd on passes the model's new cache to layers that
    checkpoint and so do not fill it (one warning); a loop decoding from that cache would
    run without the prompt, so its next forward is refused. The same loop from a cache
    filled under no_grad decodes the resident model's tokens (control)."""
    streamed, resident = peft_pair("llama", layers=3)
    stream(streamed, "cpu")
    ids = torch.randint(3, 90, (1, 6), generator=torch.Generator().manual_seed(0))
    streamed.eval(), resident.eval()
    cache = streamed(input_ids=ids, use_cache=True).past_key_values
    with torch.no_grad(), pytest.raises(layerstream.StreamingError, match="did not fill it"):
        streamed(input_ids=ids[:, -1:], past_key_values=cache, use_cache=True)
    tokens = []
    for model in (streamed, resident):
        with torch.no_grad():
            out = model(input_ids=ids, use_cache=True)
            step = model(input_ids=out.logits[:, -1:].argmax(-1), past_key_values=out.past_key_values, use_cache=True)
        tokens.append(step.logits)
    assert torch.equal(*tokens)


def test_a_copy_of_a_cache_a_forward_with_autograd_left_unfilled_is_refused_too():
    """Copied (copy.deepcopy, as transformers' prompt-reuse recipe does), the unfilled cache
    is a new object: decoding from it is refused as from the original. Control: a copy of a
    cache filled under no_grad decodes the resident model's logits."""
    streamed, resident = peft_pair("llama", layers=3)
    stream(streamed, "cpu")
    ids = torch.randint(3, 90, (1, 6), generator=torch.Generator().manual_seed(0))
    streamed.eval(), resident.eval()
    cache = copy.deepcopy(streamed(input_ids=ids, use_cache=True).past_key_values)
    with torch.no_grad(), pytest.raises(layerstream.StreamingError, match="or the cache it was copied from"):
        streamed(input_ids=ids[:, -1:], past_key_values=cache, use_cache=True)
    logits = []
    for model in (streamed, resident):
        with torch.no_grad():
            filled = copy.deepcopy(model(input_ids=ids[:, :-1], use_cache=True).past_key_values)
            logits.append(model(input_ids=ids[:, -1:], past_key_values=filled, use_cache=True).logits)
    assert torch.equal(*logits)


def test_a_frozen_model_steered_by_a_hook_with_autograd_on_trains_its_input_as_the_resident_one():
    """Nothing of the model requires grad, and neither does any layer's input: a trainable
    vector outside the model enters layer 1's attention output through a forward hook (as
    activation steering and layer attribution do). Every visit with autograd on is
    checkpointed, so the vector's gradient and the logits equal the resident model's; a
    visit run as inference would let autograd keep slot memory later copies overwrite."""
    streamed = tiny_model(layers=5)
    streamed.requires_grad_(False)
    resident = copy.deepcopy(streamed)
    stream(streamed, "cpu", slots=2, prefetch=1)
    ids = torch.randint(3, 90, (2, 8), generator=torch.Generator().manual_seed(0))
    results = []
    for model in (streamed, resident):
        delta = torch.linspace(-0.5, 0.5, 32).requires_grad_(True)
        model.model.layers[1].self_attn.register_forward_hook(lambda m, i, o, d=delta: (o[0] + d, *o[1:]))
        out = model(input_ids=ids, use_cache=False, output_hidden_states=True)
        out.hidden_states[2].square().mean().backward()
        results.append((out.logits.detach(), delta.grad))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def test_slots_larger_than_the_vram_budget_are_refused_before_any_copy():
    streamed, _ = peft_pair("llama", layers=4)
    with pytest.raises(
        layerstream.StreamConfigError,
        match=r"3 slots of the largest layer \(37.00 KiB each\) need 111.00 KiB, more than vram_budget=100.00 KiB",
    ):
        layerstream.stream_model(streamed, device="cpu", slots=3, vram_budget="100KiB")
    assert not layerstream.is_streamed(streamed)


def test_a_step_that_cannot_fit_the_vram_budget_is_refused_before_it_computes():
    streamed, _ = peft_pair("llama", layers=4)
    stream(streamed, "cpu", slots=2, vram_budget="1GiB")  # the planner keeps a 1 GiB reserve
    ids = batch(96, size=2, seq=16)
    with pytest.raises(
        layerstream.StreamingError,
        match=r"batch 2 x 16 tokens does not fit vram_budget=1.00 GiB.*Nothing has been computed",
    ):
        streamed(input_ids=ids, labels=ids)
    assert layerstream.get_runtime(streamed).visits == 0


def test_sizes_are_written_in_the_unit_that_shows_them():
    written = [units.size(n) for n in (int(12.5 * GiB), int(0.98 * GiB), 999 * MiB, 111 * 1024, 3584, 999)]
    assert written == ["12.50 GiB", "0.98 GiB", "999.00 MiB", "111.00 KiB", "3.50 KiB", "999 B"]
    assert units.size(GiB + 53_555) == "1.00 GiB"
    assert units.size(GiB + 53_555, round_up=True) == "1.01 GiB", "a least amount is never shown below what it is"
    assert units.size(int(1.1 * GiB), round_up=True) == "1.10 GiB"


def test_a_tiny_models_step_refused_by_the_budget_says_what_is_short_at_its_scale():
    """A tiny model's step takes kilobytes beside the planner's 1 GiB reserve: the refusal
    shows each part in a unit that shows it (never '0.00 GiB' or a negative saving), what is
    short, that the reserve alone takes the budget, and the budget that would hold the step."""
    streamed, _ = peft_pair("llama", layers=4)
    stream(streamed, "cpu", slots=2, vram_budget="1GiB")
    memory = layerstream.get_runtime(streamed).memory_plan(2, 16, vram_bytes=GiB)
    ids = batch(96, size=2, seq=16)
    with pytest.raises(layerstream.StreamingError) as refused:
        streamed(input_ids=ids, labels=ids)
    text = str(refused.value)
    assert "0.00 GiB" not in text and "-0." not in text, text
    assert re.search(r"a peak of \d+\.\d\d (KiB|MiB) \(resident part \d+\.\d\d KiB, 2 slots \d+\.\d\d KiB", text), text
    assert f"it needs {units.size(memory.needed_bytes - GiB)} more" in text
    assert "1.00 GiB kept in reserve (CUDA context, cuBLAS workspaces, allocator slack), which alone takes" in text
    assert "vram_budget=1.01 GiB or more holds it" in text


def test_the_budget_check_plans_the_chunked_loss_the_model_runs_with():
    """An explicit vram_budget is checked against the memory of the step as it runs: with
    loss_chunk_tokens and mlp_tile_tokens, a budget between the plain and the chunked step's
    predicted needs trains (the plain model is refused under the same budget)."""
    seq = 512
    plain, _ = peft_pair("llama", layers=4)
    chunked, _ = peft_pair("llama", layers=4)
    stream(plain, "cpu", slots=2)
    stream(chunked, "cpu", slots=2, loss_chunk_tokens=32, mlp_tile_tokens=32)
    need = [layerstream.get_runtime(m).memory_plan(1, seq) for m in (plain, chunked)]
    assert need[1].peak_vram_bytes < need[0].peak_vram_bytes
    budget = need[1].reserve_bytes + (need[0].peak_vram_bytes + need[1].peak_vram_bytes) // 2
    ids = batch(96, size=1, seq=seq)
    for model in (plain, chunked):
        runtime = layerstream.get_runtime(model)
        runtime.config.vram_budget = budget  # checked at the next training step
        runtime.resident_window.meter = None  # the check alone, no window
    with pytest.raises(layerstream.StreamingError, match="does not fit vram_budget"):
        plain(input_ids=ids, labels=ids)
    chunked(input_ids=ids, labels=ids).loss.backward()


def test_a_step_shape_within_one_that_fit_the_vram_budget_is_not_planned_again(monkeypatch):
    """Padded batches come in a new shape at nearly every step: a shape no larger in batch and
    sequence than one that fit the budget is not planned again; a larger one is."""
    streamed, _ = peft_pair("llama", layers=4)
    stream(streamed, "cpu", slots=2, vram_budget="2GiB")
    runtime = layerstream.get_runtime(streamed)
    planned, memory_plan = [], runtime.memory_plan

    def counting(batch_size, seq, **kwargs):
        if "vram_bytes" in kwargs:  # the budget check's plan (the host meter plans without one)
            planned.append((batch_size, seq))
        return memory_plan(batch_size, seq, **kwargs)

    monkeypatch.setattr(runtime, "memory_plan", counting)
    for size, seq in [(2, 16), (2, 8), (1, 16), (2, 24), (4, 8), (3, 8)]:
        ids = batch(96, size=size, seq=seq)
        streamed(input_ids=ids, labels=ids).loss.backward()
    assert planned == [(2, 16), (2, 24), (4, 8)]


def test_a_refused_step_shape_does_not_let_a_smaller_one_that_cannot_fit_through():
    """Only shapes that fit are remembered: after a refusal, a smaller shape that still does
    not fit the budget is refused too (not taken for one within a shape that fit)."""
    streamed, _ = peft_pair("llama", layers=4)
    stream(streamed, "cpu", slots=2)
    runtime = layerstream.get_runtime(streamed)
    small, large = runtime.memory_plan(1, 64), runtime.memory_plan(1, 256)
    assert small.peak_vram_bytes < large.peak_vram_bytes
    runtime.config.vram_budget = small.reserve_bytes + (small.peak_vram_bytes + large.peak_vram_bytes) // 2
    ids = batch(96, size=1, seq=64)
    streamed(input_ids=ids, labels=ids).loss.backward()
    for size, seq in [(2, 512), (1, 256)]:
        ids = batch(96, size=size, seq=seq)
        with pytest.raises(layerstream.StreamingError, match="does not fit vram_budget"):
            streamed(input_ids=ids, labels=ids)


def test_a_step_within_the_vram_budget_runs():
    streamed, resident = peft_pair("llama", layers=4)
    stream(streamed, "cpu", slots=2, vram_budget="2GiB")
    assert_traces_equal(train_steps(streamed, 2), train_steps(resident, 2))


def _state(model):
    return {name: tensor.clone() for name, tensor in model.state_dict().items()}


def _unchanged(model, before):
    after = model.state_dict()
    assert list(after) == list(before) and all(torch.equal(after[k], before[k]) for k in before)
    assert not layerstream.is_streamed(model)


def test_an_encoder_decoder_is_refused_before_anything_changes():
    from transformers import T5Config, T5ForConditionalGeneration

    model = T5ForConditionalGeneration(T5Config(vocab_size=96, d_model=32, d_kv=8, d_ff=64, num_layers=3, num_heads=4))
    classes, before = [type(m) for m in model.modules()], _state(model)
    with pytest.raises(layerstream.StreamingError, match="T5ForConditionalGeneration is an encoder-decoder"):
        layerstream.stream_model(model, device="cpu")
    _unchanged(model, before)
    assert [type(m) for m in model.modules()] == classes


def test_prefix_tuning_is_refused_by_name_before_streaming_and_at_the_first_step_after():
    from peft import PrefixTuningConfig, get_peft_model

    prefix = PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)
    model = get_peft_model(tiny_model(layers=3), prefix)
    before = _state(model)
    with pytest.raises(layerstream.StreamingError, match="PEFT prefix tuning .* Use prompt tuning"):
        layerstream.stream_model(model, device="cpu")
    _unchanged(model, before)
    later = tiny_model(layers=3)
    layerstream.stream_model(later, device="cpu")
    later = get_peft_model(later, prefix)
    ids = torch.randint(3, 90, (1, 6))
    with pytest.raises(layerstream.StreamingError, match="prefix tuning .* cannot train streamed"):
        later(input_ids=ids, labels=ids)


def test_bias_training_after_streaming_is_refused_naming_the_bias_setting():
    from peft import LoraConfig, get_peft_model

    model = tiny_model("qwen2", layers=3)
    layerstream.stream_model(model, device="cpu")
    model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", bias="all"))
    ids = torch.randint(3, 90, (1, 6))
    with pytest.raises(layerstream.StreamingError, match=r"bias='all' or bias='lora_only'.*Use bias='none'") as refused:
        model(input_ids=ids, labels=ids)
    # the other way out is open only to a script that calls stream_model itself
    assert "under `layerstream run` and layerstream.from_pretrained the layers stream as they load" in str(
        refused.value
    )
