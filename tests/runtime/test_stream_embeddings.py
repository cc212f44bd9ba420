"""StreamConfig(stream_embeddings=True): the input embedding and the output head stay in host
memory, and training, generation and every LoRA gradient stay bit for bit the resident
model's. Every parity test uses non-zero LoRA B and more layers than slots; the negative
controls below prove the comparisons can fail."""

import copy
import gc
import weakref
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from peft import get_peft_model
from torch import nn
from transformers import HfArgumentParser, Trainer, TrainingArguments

import layerstream
from layerstream.commands.train_config import TrainConfigError, load, stream_config
from layerstream.integrations import launch
from layerstream.long import chunked_loss
from layerstream.runtime import embeddings as ends_mod
from layerstream.runtime import ends_rows
from layerstream.runtime.embeddings import HeadLinear

from tiny import assert_traces_equal, batch, lora_config, peft_pair, save_tiny, stream, tiny_model, train_steps

STEPS = 6


def _attn(device):
    # memory-efficient attention's CUDA backward accumulates with atomics; eager is exact
    return "eager" if device == "cuda" else None


def _ends(model):
    inner = layerstream.api.unwrap_peft(model)
    return inner.get_input_embeddings(), inner.get_output_embeddings()


def _pair(device, family="llama", tied=False, layers=5, **overrides):
    streamed, resident = peft_pair(family, layers=layers, attn=_attn(device), tie_word_embeddings=tied, **overrides)
    stream(streamed, device, slots=2, prefetch=1, stream_embeddings=True)
    resident.to(device)
    return streamed, resident


@pytest.mark.parametrize(
    "family,tied",
    [("llama", False), ("llama", True), ("qwen3", False), ("gemma", True), ("gemma3_text", True)],
    ids=["llama-untied", "llama-tied", "qwen3-untied", "gemma-tied", "gemma3-scaled"],
)
def test_training_with_streamed_embedding_and_head_matches_resident(family, tied, device):
    streamed, resident = _pair(device, family, tied)
    embedding, head = _ends(streamed)
    assert (head.weight is embedding.weight) == tied
    assert embedding.weight.device.type == "cpu" and head.weight.device.type == "cpu"
    assert_traces_equal(train_steps(streamed, STEPS, device), train_steps(resident, STEPS, device))
    stats = layerstream.get_runtime(streamed).stats()
    assert stats["layer_loads"] > stats["layers"], "slots must have recycled"
    assert stats["head_copies"] == 2 * STEPS, "one head copy per forward and one per backward"


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_autocast_training_matches_resident(tied, device):
    """Under bf16 autocast the head's matmul runs in bf16: backward must cast the weight as
    the forward did and hand the input its gradient in the input's dtype."""
    streamed, resident = _pair(device, tied=tied)
    expected = train_steps(resident, STEPS, device, autocast=torch.bfloat16)
    got = train_steps(streamed, STEPS, device, autocast=torch.bfloat16)
    assert_traces_equal(got, expected)


def test_bf16_model_training_matches_resident(device):
    streamed, resident = _pair(device, layers=4, dtype=torch.bfloat16)
    assert_traces_equal(train_steps(streamed, STEPS, device), train_steps(resident, STEPS, device))


def _replace_end_data(model, change) -> None:
    """``weight.data = change(weight.data)`` on the embedding and head, as PEFT's
    ``prepare_model_for_kbit_training`` casts them to float32 (a tied pair once)."""
    for weight in {id(m.weight): m.weight for m in _ends(model)}.values():
        weight.data = change(weight.data)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_ends_cast_to_float32_after_streaming_train_as_resident(tied, device):
    """A bf16 model whose ends are cast to float32 after stream_model (a QLoRA script's
    prepare_model_for_kbit_training), trained under bf16 autocast as the Trainer does."""
    streamed, resident = _pair(device, tied=tied, layers=4, dtype=torch.bfloat16)
    for model in (streamed, resident):
        _replace_end_data(model, lambda data: data.to(torch.float32))
    got = train_steps(streamed, STEPS, device, autocast=torch.bfloat16)
    embedding, head = _ends(streamed)
    assert embedding.weight.dtype == head.weight.dtype == torch.float32
    assert embedding.weight.device.type == head.weight.device.type == "cpu", "the ends stay on the host"
    assert_traces_equal(got, train_steps(resident, STEPS, device, autocast=torch.bfloat16))


def test_float32_ends_with_the_chunked_loss_under_autocast_train_as_resident(device):
    """The same, with the loss in chunks on both sides (a plain QLoRA script under "auto" at
    long lengths): the streamed head's one device copy and the resident head are each cast
    once for all chunks, and give the same bits."""
    streamed, resident = peft_pair("llama", layers=4, attn=_attn(device), dtype=torch.bfloat16)
    stream(streamed, device, slots=2, prefetch=1, stream_embeddings=True, loss_chunk_tokens=5)
    resident = chunked_loss.apply(resident.to(device), 5)
    for model in (streamed, resident):
        _replace_end_data(model, lambda data: data.to(torch.float32))
    got = train_steps(streamed, STEPS, device, autocast=torch.bfloat16)
    assert layerstream.get_runtime(streamed).stats()["head_copies"] == STEPS, "one a step: the chunks' gradients"
    assert_traces_equal(got, train_steps(resident, STEPS, device, autocast=torch.bfloat16))


def test_new_values_swapped_into_the_ends_reach_the_next_forward():
    """Negative control of the above: the swapped values are used (the logits change),
    equal to a resident model given the same."""
    streamed, resident = _pair("cpu")
    ids = batch(96)
    with torch.no_grad():
        before = streamed(input_ids=ids).logits
        for model in (streamed, resident):
            _replace_end_data(model, lambda data: data * 1.5)
        after = streamed(input_ids=ids).logits
    assert not torch.equal(before, after)
    with torch.no_grad():
        assert torch.equal(after, resident(input_ids=ids).logits)


def test_a_swap_between_forward_and_backward_leaves_the_backward_its_forwards_value():
    """As for a resident weight: autograd keeps the value the forward used."""
    grads = {}
    for name, model in zip(("streamed", "resident"), _pair("cpu")):
        ids = batch(96)
        loss = model(input_ids=ids, labels=ids).loss
        _, head = _ends(model)
        head.weight.data = head.weight.data * 1.5
        loss.backward()
        grads[name] = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert grads["streamed"].keys() == grads["resident"].keys()
    assert all(torch.equal(grads["streamed"][n], grads["resident"][n]) for n in grads["streamed"])


def test_a_cast_after_a_swap_not_yet_used_is_refused_before_anything_changes():
    """The swapped data's dtype is what a later .to() must not change (the ends would not
    follow it)."""
    streamed, _ = _pair("cpu")
    embedding, _ = _ends(streamed)
    embedding.weight.data = embedding.weight.data.to(torch.bfloat16)
    before = {n: p.dtype for n, p in streamed.named_parameters()}
    with pytest.raises(layerstream.StreamingError, match="would cast streamed weights"):
        streamed.float()
    assert {n: p.dtype for n, p in streamed.named_parameters()} == before


def test_swapped_data_that_another_tensor_shares_is_refused():
    """Copying it into the host store would cut the other tensor off from the model."""
    streamed, _ = _pair("cpu")
    embedding, head = _ends(streamed)
    head.weight.data = embedding.weight.data  # tied by hand after streaming
    with pytest.raises(layerstream.StreamingError, match="shared with another tensor"):
        streamed(input_ids=batch(96))
    streamed, _ = _pair("cpu")
    embedding, _ = _ends(streamed)
    held = embedding.weight.data * 2
    embedding.weight.data = held
    with pytest.raises(layerstream.StreamingError, match="shared with another tensor"):
        streamed(input_ids=batch(96))
    del held  # the same swap with nothing else holding the data is taken
    streamed(input_ids=batch(96))


def test_a_swapped_in_store_frees_the_one_before():
    streamed, _ = _pair("cpu")
    ends = layerstream.get_runtime(streamed).embeddings
    embedding, _ = _ends(streamed)
    first = weakref.ref(ends.store.arenas[0])
    embedding.weight.data = embedding.weight.data * 2
    streamed(input_ids=batch(96))
    gc.collect()
    assert first() is None, "the first store's host memory is still referenced"
    names = set(layerstream.api.unwrap_peft(streamed)._ddp_params_and_buffers_to_ignore)
    assert "model.embed_tokens.weight" in names, "DDP still skips the swapped-in weight"


@pytest.mark.gpu
def test_end_data_swapped_onto_the_gpu_is_refused():
    """The ends stay on the host: data put on the GPU by a swap is refused, not copied back."""
    streamed, _ = _pair("cuda")
    _replace_end_data(streamed, lambda data: data.to("cuda"))
    with pytest.raises(layerstream.StreamingError, match="replaced by data on cuda"):
        streamed(input_ids=batch(96, device="cuda"))


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_greedy_generation_with_streamed_ends_matches_resident(tied, device):
    streamed, resident = _pair(device, tied=tied)
    ids = batch(96, size=2, seq=6, device=device)
    kwargs = dict(max_new_tokens=8, do_sample=False, attention_mask=torch.ones_like(ids), pad_token_id=0)
    with torch.no_grad():
        expected = resident.generate(input_ids=ids, **kwargs)
        got = streamed.generate(input_ids=ids, **kwargs)
    assert torch.equal(got, expected)


def test_the_model_reports_the_device_it_computes_on_and_unstream_restores_it(device):
    """transformers takes a model's device from its first parameter, the host embedding;
    generate moves its inputs to that device, so it must be the compute device."""
    streamed, _ = _pair(device)
    inner = layerstream.api.unwrap_peft(streamed)
    assert inner.device.type == device and inner.model.device.type == device
    assert streamed.device.type == device  # through PEFT's attribute forwarding
    assert type(inner).__name__ == "LlamaForCausalLM" and isinstance(inner, ends_mod.ComputeDevice)
    layerstream.unstream_model(streamed, device="cpu")
    assert inner.device.type == "cpu" and not hasattr(inner, "_layerstream_ends")
    assert not isinstance(inner, ends_mod.ComputeDevice) and not isinstance(inner.model, ends_mod.ComputeDevice)


_LAYOUTS = {
    "3d": lambda h, d: torch.randn(2, 7, h, dtype=d),
    "2d": lambda h, d: torch.randn(9, h, dtype=d),
    "last-position-slice": lambda h, d: torch.randn(2, 7, h, dtype=d)[:, -1:, :],  # matmul uses bmm
    "transposed-3d": lambda h, d: torch.randn(2, h, 7, dtype=d).transpose(1, 2),
    "column-major-2d": lambda h, d: torch.randn(h, 9, dtype=d).t(),
    "4d": lambda h, d: torch.randn(2, 3, 5, h, dtype=d),
}


@pytest.mark.parametrize("layout", sorted(_LAYOUTS))
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp32-autocast-bf16"])
def test_head_input_gradient_is_autograds_for_every_layout(layout, bias, precision, device):
    """HeadLinear against F.linear on a resident weight: same output, same input gradient,
    bit for bit, whichever kernel (mm, bmm, transposed mm) autograd picks for the layout."""
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    torch.manual_seed(0)
    weight = torch.randn(96, 32, dtype=dtype)
    bias_t = torch.randn(96, dtype=dtype, device=device) if bias else None
    source = _LAYOUTS[layout](32, dtype)

    def run(streamed):
        x = torch.empty_strided(source.shape, source.stride(), dtype=dtype, device=device)
        x.copy_(source)
        x.requires_grad_(True)
        autocast = torch.autocast(device, dtype=torch.bfloat16, enabled=precision.endswith("autocast-bf16"))
        with autocast:
            if streamed:
                out = HeadLinear.apply(x, weight, bias_t, lambda w: w.to(device, copy=True))
            else:
                out = F.linear(x, weight.to(device), bias_t)
        grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(device, out.dtype)
        out.backward(grad)
        return out.detach(), x.grad

    (out, grad), (expected_out, expected_grad) = run(True), run(False)
    assert torch.equal(out, expected_out)
    assert grad.dtype == expected_grad.dtype and torch.equal(grad, expected_grad)


def test_no_device_copy_of_the_head_outlives_its_forward_or_backward(device):
    streamed, _ = _pair(device)
    runtime = layerstream.get_runtime(streamed)
    _, head = _ends(streamed)
    copies = []
    fetch = runtime.pool.fetch

    def tracked(src):
        out = fetch(src)
        # the head's host weight (backward fetches the alias its forward saved); the
        # embedding rows live on as the first hidden state
        if src.data_ptr() == head.weight.data_ptr() and src.shape == head.weight.shape:
            copies.append(weakref.ref(out))
        return out

    runtime.pool.fetch = tracked
    ids = batch(96, device=device)
    loss = streamed(input_ids=ids, labels=ids).loss
    assert len(copies) == 1 and copies[0]() is None, "the forward's head copy must be gone once it returns"
    loss.backward()
    assert len(copies) == 2 and copies[1]() is None, "and the backward's once backward is done"


def test_backward_copies_the_head_weight_again():
    """Negative control for the above: a head weight changed between forward and backward
    (behind autograd's version counter) changes the gradient, so backward read the host
    weight again rather than a copy kept from the forward."""

    def input_grad(change):
        streamed, _ = _pair("cpu")
        _, head = _ends(streamed)
        ids = batch(96)
        loss = streamed(input_ids=ids, labels=ids).loss
        if change:
            head.weight.data.mul_(2.0)
        loss.backward()
        return [p.grad.clone() for p in streamed.parameters() if p.requires_grad]

    assert any(not torch.equal(a, b) for a, b in zip(input_grad(False), input_grad(True)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32])
def test_the_host_gather_is_the_embedding_lookup(dtype, id_dtype):
    """The rows the streamed embedding copies in are F.embedding's forward, whatever the ids'
    shape and the module's padding_idx (which changes only the gradient). Control: ids one
    off give other rows."""
    weight = torch.randn(97, 24).to(dtype)
    for shape in [(3, 11), (1, 1), (40,)]:
        ids = torch.randint(0, 97, shape, dtype=id_dtype)
        ids.view(-1)[0] = 5  # the padding row is looked up as any other
        gathered = ends_rows.gather_rows(weight, ids, pinned=False)
        assert gathered.shape == (*shape, 24)
        assert torch.equal(gathered, F.embedding(ids, weight, padding_idx=5))
        assert not torch.equal(ends_rows.gather_rows(weight, (ids + 1) % 97, pinned=False), gathered)


def test_rows_that_cannot_be_page_locked_are_gathered_into_ordinary_memory_said_once(monkeypatch, caplog):
    """Where page-locked memory cannot be had (cudaHostAlloc failing, as without CUDA), the
    rows are the same, in ordinary memory, and the slower copy is said once."""
    monkeypatch.setattr(ends_rows, "_warned", False)
    empty = torch.empty

    def no_pinned_memory(*args, pin_memory=False, **kwargs):
        if pin_memory:
            raise RuntimeError("CUDA error: out of memory (cudaHostAlloc)")
        return empty(*args, **kwargs)

    monkeypatch.setattr(ends_rows.torch, "empty", no_pinned_memory)
    weight, ids = torch.randn(50, 8), torch.randint(0, 50, (2, 9))
    with caplog.at_level("WARNING"):
        for _ in range(2):
            rows = ends_rows.gather_rows(weight, ids, pinned=True)
            assert torch.equal(rows, F.embedding(ids, weight)) and not rows.is_pinned()
    said = [r for r in caplog.records if "could not be page-locked" in r.getMessage()]
    assert len(said) == 1


def test_an_id_outside_the_vocabulary_is_refused_as_the_lookup_refuses_it():
    with pytest.raises(IndexError):
        ends_rows.gather_rows(torch.randn(10, 4), torch.tensor([[3, 10]]), pinned=False)


def test_a_wrong_host_embedding_row_is_caught_by_parity():
    """Negative control: one host embedding row off by a little must turn parity red."""
    streamed, resident = _pair("cpu")
    embedding, _ = _ends(streamed)
    row = int(batch(96, seed=0)[0, 0])  # a token of the first training batch (train_steps seeds)
    embedding.weight.data[row, 0] += 1e-3
    with pytest.raises(AssertionError):
        assert_traces_equal(train_steps(streamed, 1), train_steps(resident, 1))


def test_the_head_computes_with_the_host_weight():
    """Negative control: a changed host head weight changes the logits."""
    streamed, resident = _pair("cpu")
    _, head = _ends(streamed)
    head.weight.data[5] += 1e-3
    ids = batch(96)
    with torch.no_grad():
        assert not torch.equal(streamed(input_ids=ids).logits, resident(input_ids=ids).logits)


def test_moving_the_model_keeps_the_embedding_and_head_on_the_host():
    streamed, _ = _pair("cpu")
    embedding, head = _ends(streamed)
    runtime = layerstream.get_runtime(streamed)
    on_host = {id(v) for r in runtime.records for v in r.host_values} | {id(embedding.weight), id(head.weight)}
    before = {n: p.data_ptr() for n, p in streamed.named_parameters()}
    keys = list(streamed.state_dict())
    streamed._apply(lambda t: t.clone())  # what .to() does, with a visible effect
    for name, param in streamed.named_parameters():
        assert (param.data_ptr() != before[name]) == (id(param) not in on_host), name
    assert list(streamed.state_dict()) == keys
    streamed.to(torch.float32)  # no change: allowed
    with pytest.raises(layerstream.StreamingError, match="cast streamed weights"):
        streamed.half()
    # DistributedDataParallel must leave them alone too (they live on the host)
    ignored = layerstream.api.unwrap_peft(streamed)._ddp_params_and_buffers_to_ignore
    assert {"model.embed_tokens.weight", "lm_head.weight", "base_model.model.lm_head.weight"} <= set(ignored)


def test_the_modules_stay_the_models_own_and_their_hooks_run():
    streamed, _ = peft_pair("llama", layers=4)
    embedding, head = _ends(streamed)
    names = [n for n, _ in streamed.named_parameters()]
    params = list(streamed.parameters())
    stream(streamed, "cpu", stream_embeddings=True)
    assert _ends(streamed) == (embedding, head)
    assert isinstance(embedding, nn.Embedding) and type(embedding).__name__ == "Embedding"
    assert [n for n, _ in streamed.named_parameters()] == names
    assert all(a is b for a, b in zip(streamed.parameters(), params)), "Parameter objects replaced"
    streamed.enable_input_require_grads()  # what gradient checkpointing with PEFT registers
    outputs = []
    embedding.register_forward_hook(lambda module, args, out: outputs.append(out))
    ids = batch(96)
    streamed(input_ids=ids, labels=ids).loss.backward()
    assert len(outputs) == 1 and outputs[0].requires_grad, "PEFT's hook ran on the streamed embedding"


def test_unstream_restores_plain_modules_with_the_same_parameters(device):
    streamed, resident = _pair(device, "gemma3_text", tied=True)
    embedding, head = _ends(streamed)
    classes = [type(m) for m in _ends(resident)]
    assert [type(m) for m in (embedding, head)] != classes, "streamed: swapped classes"
    weight = embedding.weight
    train_steps(streamed, 2, device)
    train_steps(resident, 2, device)
    layerstream.unstream_model(streamed)
    assert not layerstream.is_streamed(streamed)
    assert _ends(streamed) == (embedding, head) and embedding.weight is weight and head.weight is weight
    assert [type(m) for m in (embedding, head)] == classes
    assert all(p.device.type == device for p in streamed.parameters())
    ours, theirs = streamed.state_dict(), resident.state_dict()
    assert list(ours) == list(theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert_traces_equal(train_steps(streamed, 2, device), train_steps(resident, 2, device))


def test_stats_count_the_head_and_the_embedding_rows(device):
    streamed, _ = _pair(device)
    train_steps(streamed, 2, device)
    runtime = layerstream.get_runtime(streamed)
    stats = runtime.stats()
    _, head = _ends(streamed)
    head_bytes = head.weight.numel() * head.weight.element_size()
    rows = 2 * 2 * 12 * 32 * 4  # steps x batch x seq x hidden x fp32
    assert stats["stream_embeddings"] is True
    assert stats["head_copies"] == 4 and stats["head_h2d_bytes"] == 4 * head_bytes
    assert stats["embedding_h2d_bytes"] == rows
    assert stats["h2d_bytes"] == stats["layer_loads"] * runtime.records[0].nbytes + 4 * head_bytes + rows
    assert stats["host_bytes"] >= sum(r.nbytes for r in runtime.records) + 2 * head_bytes
    assert stats["h2d_seconds"] > 0
    plain, _ = peft_pair("llama", layers=3)
    stream(plain, device)
    off = layerstream.get_runtime(plain).stats()
    assert off["stream_embeddings"] is False and off["head_h2d_bytes"] == 0


def test_summary_says_the_embedding_and_head_stream():
    streamed, _ = _pair("cpu", tied=True)
    summary = layerstream.get_runtime(streamed).summary()
    assert "embeddings   streamed: input embedding and the head tied to it (one host copy)" in summary
    assert "resident     final norm, and every trainable tensor" in summary
    plain, _ = peft_pair("llama", layers=3)
    stream(plain, "cpu", stream_embeddings="auto")
    assert "embeddings   resident (stream_embeddings=auto: to host memory at a step the long-sequence" in (
        layerstream.get_runtime(plain).summary()
    )
    kept, _ = peft_pair("llama", layers=3)
    stream(kept, "cpu", stream_embeddings=False)
    assert "embeddings   resident (stream_embeddings=False)" in layerstream.get_runtime(kept).summary()


# -- refusals -------------------------------------------------------------------------------


def test_a_trained_head_is_refused_at_stream_time():
    model = tiny_model("llama", layers=3)
    for name, param in model.named_parameters():
        param.requires_grad = name.startswith("lm_head")
    with pytest.raises(
        layerstream.StreamingError,
        match=r"lm_head.weight requires grad, but stream_embeddings keeps it in host memory.*"
        r"freeze it .*or stream with stream_embeddings=False",
    ):
        layerstream.stream_model(model, device="cpu", stream_embeddings=True)
    assert not layerstream.is_streamed(model)
    assert model.lm_head.weight.untyped_storage().data_ptr() != 0


def test_a_qlora_model_whose_ends_train_is_refused_before_streaming(tmp_path):
    """PEFT applied to a 4-bit model, the embedding and head made trainable by hand (new
    tokens): stream_embeddings keeps the ends frozen on the host, so stream_model refuses
    before it changes anything, not at the first training step."""
    from tiny import nf4_pair

    streamed, _ = nf4_pair(tmp_path, layers=2)
    inner = streamed.base_model.model
    inner.get_input_embeddings().weight.requires_grad_(True)
    inner.get_output_embeddings().weight.requires_grad_(True)
    with pytest.raises(
        layerstream.StreamingError, match="requires grad, but stream_embeddings keeps it in host memory"
    ):
        stream(streamed, stream_embeddings=True)
    assert not layerstream.is_streamed(streamed)


def test_peft_modules_to_save_on_the_head_is_refused_at_stream_time():
    model = get_peft_model(tiny_model("llama", layers=3), lora_config(modules_to_save=["lm_head"]))
    with pytest.raises(layerstream.StreamingError, match=r"lm_head is a ModulesToSaveWrapper.*PEFT wraps it"):
        layerstream.stream_model(model, device="cpu", stream_embeddings=True)
    assert not layerstream.is_streamed(model)


def test_training_an_embedding_left_trainable_is_refused_at_the_first_forward():
    """Streamed before PEFT (nothing frozen yet), then trained without freezing."""
    model = tiny_model("llama", layers=3)
    layerstream.stream_model(model, device="cpu", stream_embeddings=True)
    ids = batch(96)
    with pytest.raises(layerstream.StreamingError, match="embed_tokens.weight requires grad"):
        model(input_ids=ids, labels=ids)
    with torch.no_grad():  # inference needs no gradient: fine
        model(input_ids=ids)


def test_peft_applied_after_streaming_the_ends_matches_resident():
    base = tiny_model("mistral", layers=5)
    resident = get_peft_model(copy.deepcopy(base), lora_config())
    layerstream.stream_model(base, slots=2, device="cpu", stream_embeddings=True)
    streamed = get_peft_model(base, lora_config())
    streamed.load_state_dict(resident.state_dict())
    assert_traces_equal(train_steps(streamed, STEPS), train_steps(resident, STEPS))


def test_an_embedding_whose_forward_bypasses_nn_embedding_is_refused():
    class OwnLookup(nn.Embedding):
        def forward(self, ids):
            return self.weight[ids]

    model = tiny_model("llama", layers=3)
    model.model.embed_tokens.__class__ = OwnLookup
    with pytest.raises(layerstream.StreamingError, match="does not call nn.Embedding.forward"):
        layerstream.stream_model(model, device="cpu", stream_embeddings=True)
    assert type(model.model.embed_tokens) is OwnLookup


def test_an_embedding_with_max_norm_is_refused():
    model = tiny_model("llama", layers=3)
    model.model.embed_tokens.max_norm = 1.0
    with pytest.raises(layerstream.StreamingError, match="max_norm=1.0.*Set max_norm=None"):
        layerstream.stream_model(model, device="cpu", stream_embeddings=True)


def test_stream_embeddings_must_be_true_false_or_auto():
    for value in ("yes", 1, 0):  # 1 == True, but a surface that tests `is True` would take it as off
        with pytest.raises(layerstream.StreamConfigError, match="stream_embeddings must be True, False or 'auto'"):
            layerstream.StreamConfig(device="cpu", stream_embeddings=value)
    assert layerstream.StreamConfig(device="cpu").stream_embeddings == "auto"


# -- configuration paths --------------------------------------------------------------------


def test_yaml_launcher_and_trainer_flags_accept_stream_embeddings(tmp_path, monkeypatch):
    import runpy

    from layerstream.commands import cli

    default = Path(__file__).resolve().parents[2] / "configs" / "default.yaml"
    config = load(
        str(default),
        ["stream.stream_embeddings=true", "stream.device=cpu", f"training.output_dir={tmp_path / 'never'}"],
    )
    assert stream_config(config).stream_embeddings is True
    with pytest.raises(TrainConfigError, match="stream.stream_embeddings must be true, false or auto"):
        load(str(default), ["stream.stream_embeddings=maybe", "stream.device=cpu"])
    (streaming,) = HfArgumentParser((layerstream.StreamingArguments,)).parse_args_into_dataclasses(
        ["--layer_stream_embeddings", "--layer_stream_device", "cpu", "--layer_stream_slots", "2"]
    )
    assert streaming.to_config().stream_embeddings is True
    seen = []
    (tmp_path / "train.py").write_text("")
    monkeypatch.setattr(runpy, "run_path", lambda path, run_name: seen.append(launch.config_for()))
    assert cli.main(["run", "--stream-embeddings", "--slots", "2", "--device", "cpu", str(tmp_path / "train.py")]) == 0
    assert seen[0].stream_embeddings is True


def test_a_trainer_run_with_streamed_ends_matches_the_plain_run(tmp_path, caplog):
    from datasets import Dataset

    data = Dataset.from_list([{"input_ids": [3, 4, 5, 6, 7, 8], "labels": [3, 4, 5, 6, 7, 8]}] * 16)

    def run(model, out):
        args = TrainingArguments(
            output_dir=str(out),
            use_cpu=True,
            report_to=[],
            max_steps=3,
            logging_steps=1,
            per_device_train_batch_size=4,
            save_strategy="no",
            learning_rate=1e-2,
        )
        trainer = Trainer(model=model, args=args, train_dataset=data)
        trainer.train()
        return [e["loss"] for e in trainer.state.log_history if "loss" in e]

    streamed, resident = peft_pair("llama", layers=4)
    plain = run(resident, tmp_path / "plain")
    launch.enable(dict(device="cpu", slots=2, stream_embeddings=True))
    try:
        with caplog.at_level("WARNING", logger="layerstream"):
            got = run(streamed, tmp_path / "streamed")
    finally:
        launch.disable()
    assert len(plain) == 3 and got == plain
    assert layerstream.get_runtime(streamed).stats()["stream_embeddings"]
    assert "embeddings   streamed: input embedding and head" in caplog.text


def test_a_qlora_model_loaded_by_from_pretrained_streams_its_ends_and_matches_resident(tmp_path):
    """layerstream.from_pretrained(stream=StreamConfig(stream_embeddings=True)): 4-bit layers
    (frozen as loaded) and the embedding and head (trainable until PEFT freezes them)."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from tiny import portable_cpu_nf4

    save_tiny(tmp_path, layers=4, dtype=torch.bfloat16, wide=True)
    config = layerstream.StreamConfig(device="cpu", slots=2, stream_embeddings=True)
    streamed = get_peft_model(layerstream.from_pretrained(tmp_path, quantization="nf4", stream=config), lora_config())
    quant = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )
    resident = get_peft_model(
        portable_cpu_nf4(
            AutoModelForCausalLM.from_pretrained(
                tmp_path, quantization_config=quant, dtype=torch.bfloat16, device_map="cpu"
            )
        ),
        lora_config(),
    )
    streamed.load_state_dict({k: v for k, v in resident.state_dict().items() if "lora_" in k}, strict=False)
    assert layerstream.get_runtime(streamed).stats()["stream_embeddings"]
    assert_traces_equal(train_steps(streamed, 4), train_steps(resident, 4))


def test_host_bytes_of_the_ends_count_a_tied_matrix_once():
    untied, tied = tiny_model("llama", layers=2), tiny_model("llama", layers=2, tie_word_embeddings=True)
    assert ends_mod.host_bytes(untied) == 2 * 96 * 32 * 4
    assert ends_mod.host_bytes(tied) == 96 * 32 * 4


# -- CUDA -----------------------------------------------------------------------------------


@pytest.mark.gpu
def test_on_cuda_the_ends_stay_pinned_on_the_host_and_only_a_transient_head_reaches_the_gpu():
    """A 4096 x 256 fp32 head (4 MiB) is larger than everything else a step allocates on
    top of what stays (logits 2 x 12 x 4096 fp32, a few copies of them, small layers)."""
    streamed, resident = peft_pair(
        "llama", layers=4, attn="eager", vocab_size=4096, hidden_size=256, head_dim=64, intermediate_size=512
    )
    # no backward slots: they hold memory across the step boundary that this step's forward
    # gives back, which would hide the head's copy in the comparison with `before`
    stream(streamed, "cuda", slots=2, prefetch=1, stream_embeddings=True, backward_slots=0)
    resident.to("cuda")
    embedding, head = _ends(streamed)
    assert embedding.weight.device.type == "cpu" and embedding.weight.is_pinned()
    assert head.weight.device.type == "cpu" and head.weight.is_pinned()
    head_bytes = head.weight.numel() * head.weight.element_size()
    ids = batch(4096, device="cuda")
    streamed(input_ids=ids, labels=ids).loss.backward()  # warm up (LoRA gradients exist now)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    streamed(input_ids=ids, labels=ids).loss.backward()
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() >= before + head_bytes, "the head was copied in"
    assert torch.cuda.memory_allocated() < before + head_bytes // 2, "and not kept"
    streamed.zero_grad(set_to_none=True)
    assert_traces_equal(train_steps(streamed, STEPS, "cuda"), train_steps(resident, STEPS, "cuda"))


@pytest.mark.gpu
def test_on_cuda_the_embedding_rows_are_gathered_into_pinned_memory_and_equal_the_lookup(monkeypatch):
    """The rows come to the GPU from page-locked memory (an asynchronous copy at the pinned
    rate), and are the resident lookup's: also lookups queued without a sync behind a busy
    stream, whose host blocks the caching allocator must not hand out again too early."""
    streamed, resident = peft_pair("llama", layers=3, attn="eager", vocab_size=512, hidden_size=64, head_dim=16)
    stream(streamed, "cuda", slots=2, prefetch=1, stream_embeddings=True)
    resident.to("cuda")
    pinned = []
    gather = ends_mod.gather_rows

    def recording(*args, **kwargs):
        rows = gather(*args, **kwargs)
        pinned.append(rows.is_pinned())
        return rows

    monkeypatch.setattr(ends_mod, "gather_rows", recording)
    ids = [(batch(512, device="cuda") + 7 * n) % 512 for n in range(6)]
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # the stream busy: the copies below queue behind it
    got = [streamed.get_input_embeddings()(i) for i in ids]  # no sync between the lookups
    torch.cuda.synchronize()
    assert pinned == [True] * len(ids)
    for i, rows in zip(ids, got):
        assert torch.equal(rows, resident.get_input_embeddings()(i))


@pytest.mark.gpu
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_a_model_already_on_the_gpu_streams_its_ends_from_the_host_as_resident(tied):
    """A script that loads with device_map="auto" hands stream_model a model on the GPU:
    the ends move into pinned host memory as the decoder layers do, their GPU memory goes
    back, and training stays bit for bit the resident model's. The ends are cast to
    float32 first, as PEFT's prepare_model_for_kbit_training leaves them. The vocabulary is
    large enough that the ends outweigh the layers, the slots and the adapters together, so
    the memory check fails while the ends' GPU copies are kept."""
    streamed, resident = peft_pair("llama", layers=5, attn="eager", tie_word_embeddings=tied, vocab_size=65536)
    for model in (streamed, resident):
        for end in _ends(model):
            end.weight.data = end.weight.data.float()
        model.to("cuda")
    embedding, head = _ends(streamed)
    ends_bytes = ends_mod.host_bytes(streamed)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    stream(streamed, "cuda", slots=2, prefetch=1, stream_embeddings=True)
    for weight in (embedding.weight, head.weight):
        assert weight.device.type == "cpu" and weight.is_pinned()
    assert torch.cuda.memory_allocated() <= before - ends_bytes, "the ends' GPU memory was not freed"
    assert_traces_equal(train_steps(streamed, STEPS, "cuda"), train_steps(resident, STEPS, "cuda"))
    assert layerstream.get_runtime(streamed).stats()["head_copies"] == 2 * STEPS


def test_a_hooked_streamed_head_runs_its_hooks_at_each_chunk_and_says_it_copies_for_each(device, caplog):
    """A forward hook on the head (here doubling its logits) runs as on the resident head
    when the loss is chunked: the streamed head is then called as a module at each chunk,
    copied in for each, which is said once."""
    streamed, resident = peft_pair("llama", layers=4, attn=_attn(device))
    stream(streamed, device, slots=2, prefetch=1, stream_embeddings=True, loss_chunk_tokens=5)
    resident = chunked_loss.apply(resident.to(device), 5)
    for model in (streamed, resident):
        _ends(model)[1].register_forward_hook(lambda module, args, out: out * 2)
    chunked_loss._warned.discard("hooked-streamed-head")
    with caplog.at_level("WARNING", logger="layerstream"):
        got = train_steps(streamed, STEPS, device)
    assert sum("the streamed head has hooks" in r.getMessage() for r in caplog.records) == 1
    assert_traces_equal(got, train_steps(resident, STEPS, device))
