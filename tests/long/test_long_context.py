"""loss_chunk_tokens (the head and cross-entropy in chunks) and mlp_tile_tokens (the MLP in
tiles of tokens): streamed and resident runs of the same chunking agree bit for bit (every
loss and LoRA gradient), with non-zero LoRA B and more layers than slots; against the
unchunked model they agree within fp32 rounding, since the sums run in another order.
Negative controls prove each comparison can fail."""

import argparse

import pytest
import torch
from long_pairs import CHUNK, SEQ, STEPS, TILE, long_pair, token_rows
from transformers import HfArgumentParser, Trainer, TrainingArguments

import layerstream
from layerstream import loading
from layerstream.commands import flags
from layerstream.config import StreamConfig, parse_setting
from layerstream.errors import StreamConfigError, StreamingError
from layerstream.long import chunked_loss, tiled_mlp

from tiny import (
    assert_traces_equal,
    batch,
    corrupt_copies,
    peft_pair,
    save_tiny,
    stream,
    tiny_model,
    train_steps,
)

ALL_LINEAR_AND_HEAD = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
CASES = {
    "resident-head": dict(),
    "lora-on-head": dict(lora={"target_modules": ALL_LINEAR_AND_HEAD}),
    "streamed-head": dict(stream_embeddings=True),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_chunked_loss_and_tiled_mlp_streamed_match_resident_bit_for_bit(case, device):
    options = dict(CASES[case])
    lora = options.pop("lora", None)
    streamed, resident = long_pair(lora=lora, device=device, **options)
    if lora is not None:
        assert any("lm_head.lora_B" in n for n, _ in streamed.named_parameters()), "LoRA must be on the head"
    got = train_steps(streamed, STEPS, seq=SEQ, device=device)
    expected = train_steps(resident, STEPS, seq=SEQ, device=device)
    assert got.logits[0] is None, "the chunked loss returns no logits"
    assert_traces_equal(got, expected)
    stats = layerstream.get_runtime(streamed).stats()
    assert stats["layer_loads"] > stats["layers"], "slots must have recycled"
    if options.get("stream_embeddings"):
        assert stats["head_copies"] == STEPS, (
            "one head copy per step (the gradients come in the forward), not per chunk"
        )


def test_streamed_parity_fails_when_a_copy_is_corrupted():
    """Negative control: the same comparison catches a slot that received another layer."""
    streamed, resident = long_pair()
    runtime = layerstream.get_runtime(streamed)
    corrupt_copies(runtime, lambda layer, slot: runtime.records[0].host_region if layer == 3 else None)
    with pytest.raises(AssertionError):
        assert_traces_equal(train_steps(streamed, STEPS, seq=SEQ), train_steps(resident, STEPS, seq=SEQ))


def test_a_refused_torch_compile_leaves_the_chunked_loss_training_exactly():
    """torch.compile stops at the first streamed layer while it traces the model's forward,
    inside the chunked loss's capture of the head: the capture is undone, so the model then
    trains bit for bit as one never compiled (a capture left on made every later loss read
    empty logits)."""
    streamed, resident = long_pair(layers=3)
    ids = batch(96, size=2, seq=SEQ)
    with pytest.raises(Exception, match="torch.compile cannot trace a streamed"):
        torch.compile(streamed, backend="eager")(input_ids=ids, labels=ids)
    assert_traces_equal(train_steps(streamed, 2, seq=SEQ), train_steps(resident, 2, seq=SEQ))


def _train(model, out):
    args = TrainingArguments(
        output_dir=str(out),
        max_steps=3,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        learning_rate=1e-2,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        seed=3,
    )
    trainer = Trainer(model=model, args=args, train_dataset=token_rows())
    assert trainer.model_accepts_loss_kwargs, "the Trainer must pass num_items_in_batch"
    trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    weights = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return losses, weights


def test_trainer_with_gradient_accumulation_streamed_matches_resident(tmp_path):
    streamed, resident = long_pair()
    _, plain = peft_pair()
    got, expected = _train(streamed, tmp_path / "s"), _train(resident, tmp_path / "r")
    assert len(got[0]) == 3 and got[0] == expected[0]
    assert all(torch.equal(got[1][n], expected[1][n]) for n in expected[1])
    unchunked = _train(plain, tmp_path / "p")
    assert got[0] == pytest.approx(unchunked[0], rel=1e-5)
    for name, weight in unchunked[1].items():
        torch.testing.assert_close(got[1][name], weight, rtol=1e-4, atol=1e-5)


def test_what_cannot_be_chunked_or_tiled_is_refused_clearly():
    with pytest.raises(StreamingError, match="mixture of experts"):
        chunked_loss.apply(tiny_model("mixtral"), CHUNK)
    with pytest.raises(StreamingError, match="gate, up and down projections.*mixture of experts"):
        tiled_mlp.apply(tiny_model("mixtral"), TILE)
    for bad in (-1, True, 2.5, "4k"):
        with pytest.raises(StreamConfigError, match="loss_chunk_tokens must be an integer >= 1"):
            StreamConfig(device="cpu", loss_chunk_tokens=bad)
    with pytest.raises(StreamConfigError, match="mlp_tile_tokens must be an integer >= 1"):
        StreamConfig(device="cpu", mlp_tile_tokens=-3)


REFUSED_FAMILIES = {
    "mixtral-loss": (
        "mixtral",
        "loss_chunk_tokens",
        r"MixtralForCausalLM \(model type 'mixtral'\).*mixture of experts",
    ),
    "mixtral-mlp": ("mixtral", "mlp_tile_tokens", r"MixtralSparseMoeBlock \(a mixture of experts"),
    "qwen3_moe-loss": ("qwen3_moe", "loss_chunk_tokens", r"model type 'qwen3_moe'.*load-balancing loss"),
    "qwen3_moe-mlp": ("qwen3_moe", "mlp_tile_tokens", r"model type 'qwen3_moe'.*mixture of experts"),
}


def _classes_and_storage(model) -> list:
    return [(name, type(m)) for name, m in model.named_modules()] + [
        (name, t.data_ptr()) for name, t in model.state_dict(keep_vars=True).items()
    ]


@pytest.mark.parametrize("case", REFUSED_FAMILIES, ids=list(REFUSED_FAMILIES))
def test_a_setting_a_family_cannot_run_is_refused_before_the_model_changes(case):
    """Refused with the setting, the family and what to do, before stream_model swaps a class
    or packs a layer: the model is untouched and computes what it did."""
    family, setting, family_match = REFUSED_FAMILIES[case]
    model, _ = peft_pair(family, layers=3)
    ids = batch(96, size=2, seq=SEQ)
    before, expected = _classes_and_storage(model), model(input_ids=ids, labels=ids).loss
    with pytest.raises(StreamingError, match=f"{setting}.*{family_match}.*Nothing was changed.*Leave {setting} unset"):
        layerstream.stream_model(model, device="cpu", slots=2, **{setting: 5})
    assert not layerstream.is_streamed(model)
    assert _classes_and_storage(model) == before, "no class swapped, no tensor moved into a store"
    assert torch.equal(model(input_ids=ids, labels=ids).loss, expected)


def test_a_setting_a_family_cannot_run_is_refused_by_from_pretrained_before_loading(tmp_path, monkeypatch):
    save_tiny(tmp_path, "mixtral", layers=3)
    monkeypatch.setattr(loading, "_load_module", lambda *a, **k: pytest.fail("a weight was read"))
    with pytest.raises(StreamingError, match="mlp_tile_tokens.*mixture of experts.*Nothing was changed"):
        layerstream.from_pretrained(tmp_path, stream=StreamConfig(device="cpu", mlp_tile_tokens=5))


def test_unstream_takes_the_chunking_off():
    streamed, _ = long_pair()
    layerstream.unstream_model(streamed)
    ids = batch(96, size=2, seq=SEQ)
    out = streamed(input_ids=ids, labels=ids)
    assert out.logits is not None and "Chunked" not in type(out.loss.grad_fn).__name__


def test_every_surface_offers_the_settings():
    assert parse_setting("loss_chunk_tokens", "none") is None
    assert parse_setting("mlp_tile_tokens", "8192") == 8192
    with pytest.raises(StreamConfigError, match="stream.loss_chunk_tokens must be an integer"):
        parse_setting("loss_chunk_tokens", "lots", "stream.loss_chunk_tokens")
    (arguments,) = HfArgumentParser(layerstream.StreamingArguments).parse_args_into_dataclasses(
        [
            "--layer_stream_loss_chunk_tokens",
            "64",
            "--layer_stream_mlp_tile_tokens",
            "128",
            "--layer_stream_device",
            "cpu",
        ]
    )
    config = arguments.to_config()
    assert (config.loss_chunk_tokens, config.mlp_tile_tokens) == (64, 128)
    parser = argparse.ArgumentParser()
    flags.add_setting_flags(parser)
    namespace = parser.parse_args(["--loss-chunk-tokens", "32"])
    assert namespace.loss_chunk_tokens == "32" and namespace.mlp_tile_tokens == "auto"


def _forwards_with_evaluation_and_generation_before_one_backward(model):
    """Two training forwards, then an evaluation forward and a generation, then one backward."""
    torch.manual_seed(5)
    model.train()
    a, b = batch(seq=SEQ, seed=3), batch(seq=SEQ - 5, seed=4)
    losses = [model(input_ids=a, labels=a).loss, model(input_ids=b, labels=b).loss]
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=batch(seq=9, seed=11)).logits
    prompt = batch(seq=6, seed=7)
    tokens = model.generate(
        input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=3, do_sample=False, pad_token_id=0
    )
    model.train()
    sum(losses).backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    return [loss.detach() for loss in losses] + [logits, tokens], grads


def test_evaluation_and_generation_between_forwards_and_their_backward_stay_exact():
    """With dropout, offloaded inputs, chunks and tiles, the passes in between draw no masks
    and free nothing the pending backward needs (the control above shows the comparison fails)."""
    streamed, resident = peft_pair(lora={"lora_dropout": 0.1})
    stream(streamed, "cpu", offload_activations=True, loss_chunk_tokens=CHUNK, mlp_tile_tokens=TILE)
    tiled_mlp.apply(chunked_loss.apply(resident, CHUNK), TILE)
    got, got_grads = _forwards_with_evaluation_and_generation_before_one_backward(streamed)
    assert layerstream.get_runtime(streamed).stats()["activations_offloaded"] > 0
    want, want_grads = _forwards_with_evaluation_and_generation_before_one_backward(resident)
    assert all(torch.equal(x, y) for x, y in zip(got, want))
    assert got_grads.keys() == want_grads.keys()
    assert all(torch.equal(got_grads[name], want_grads[name]) for name in got_grads)
