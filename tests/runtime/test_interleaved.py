"""Training interleaved with evaluation and generation, as a Trainer with eval_strategy
and a generation callback does: every phase change leaves the streamed model exact, with
evaluation and generation under ``torch.no_grad`` or ``torch.inference_mode`` (what the
runtime keeps from an inference-mode call must not be inference tensors, which a later
training step cannot save for backward)."""

import pytest
import torch

import layerstream

from tiny import assert_traces_equal, batch, peft_pair, stream, train_steps

MODES = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}


def _rounds(model, device, mode=torch.no_grad, rounds=3):
    outputs = []
    ids = batch(96, size=2, seq=6, seed=7, device=device)
    kwargs = dict(max_new_tokens=5, do_sample=False, attention_mask=torch.ones_like(ids), pad_token_id=0)
    for _ in range(rounds):
        outputs.append(train_steps(model, 2, device))
        model.eval()
        with mode():
            outputs.append(model(input_ids=batch(96, size=3, seq=9, seed=11, device=device)).logits.cpu())
            outputs.append(model.generate(input_ids=ids, **kwargs).cpu())
        model.train()
    return outputs


def _assert_same(got_rounds, expected_rounds):
    for got, expected in zip(got_rounds, expected_rounds):
        if isinstance(got, torch.Tensor):
            assert torch.equal(got, expected)
        else:
            assert_traces_equal(got, expected)


def test_training_evaluation_and_generation_interleaved_stay_exact(device):
    attn = "eager" if device == "cuda" else None
    streamed, resident = peft_pair("llama", layers=5, attn=attn)
    stream(streamed, device, slots=2, prefetch=1)
    resident.to(device)
    _assert_same(_rounds(streamed, device), _rounds(resident, device))


def _kept_tensors(runtime) -> list:
    """What the runtime keeps bound for later calls: slot views and the window's."""
    kept = [t for binding in runtime._bindings.values() for _, _, t in binding]
    return kept + [t for binding in runtime.resident_window.bindings.values() for _, _, t in binding]


@pytest.mark.parametrize("placement", ["slots", "window", "window-sized-by-generate", "streamed-ends"])
def test_evaluation_and_generation_under_inference_mode_leave_training_exact(placement):
    """Layers from slots, layers kept in a window (set, or sized by a generate call from a
    budget before any training), and a streamed embedding and head."""
    streamed, resident = peft_pair("llama", layers=5)
    budget = {"vram_budget": "1100MiB"} if placement == "window-sized-by-generate" else {}
    stream(streamed, "cpu", slots=2, prefetch=1, stream_embeddings=placement == "streamed-ends", **budget)
    runtime = layerstream.get_runtime(streamed)
    if placement == "window":
        runtime.set_window([1, 3])
    if placement == "window-sized-by-generate":
        ids = batch(96, size=2, seq=6, seed=3)
        for _ in range(2):  # the first call is measured, the second keeps the layers that fit
            with torch.inference_mode():
                tokens = [m.generate(input_ids=ids, max_new_tokens=3, do_sample=False) for m in (streamed, resident)]
            assert torch.equal(*tokens)
        assert runtime.resident_window.bindings, "the second generate call kept a window"
        assert not any(t.is_inference() for t in _kept_tensors(runtime))
    _assert_same(_rounds(streamed, "cpu", torch.inference_mode), _rounds(resident, "cpu", torch.inference_mode))
    kept = _kept_tensors(runtime)
    assert kept and not any(t.is_inference() for t in kept)
