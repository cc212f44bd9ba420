"""The streamed head computes with the kernel the resident head would: at::matmul folds a
strided input (the last position that ``logits_to_keep`` and ``generate`` keep) into one
matrix product or batches it by whether the weight requires grad, even with grad off (torch
2.13; 2.15 picks one kernel either way). A model fresh from ``from_pretrained`` has every
weight requiring grad, so its head's device copy must say so too, or generation's scores
differ from the resident model's in the last bits."""

import copy

import pytest
import torch

from tiny import batch, stream, tiny_model


def _generated(model, ids):
    kwargs = dict(max_new_tokens=4, do_sample=False, output_scores=True, return_dict_in_generate=True)
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), pad_token_id=0, **kwargs)
    return out.sequences, out.scores


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_a_head_that_requires_grad_generates_the_resident_heads_scores(tied):
    resident = tiny_model("llama", layers=4, tie_word_embeddings=tied)
    streamed = copy.deepcopy(resident)
    assert resident.lm_head.weight.requires_grad
    stream(streamed, "cpu", slots=2, stream_embeddings=True)
    ids = batch(96, size=2, seq=6)
    sequences, scores = _generated(streamed, ids)
    expected_sequences, expected_scores = _generated(resident, ids)
    assert torch.equal(sequences, expected_sequences)
    assert all(torch.equal(a, b) for a, b in zip(scores, expected_scores))
    with torch.no_grad():
        assert torch.equal(
            streamed(input_ids=ids, logits_to_keep=1).logits, resident(input_ids=ids, logits_to_keep=1).logits
        )


def _head_weight_flags(model, ids, head_shape, monkeypatch):
    """The ``requires_grad`` of every head-shaped weight ``F.linear`` is given that is not
    the model's own Parameter: the device copies the streamed head computes with."""
    flags, linear = [], torch.nn.functional.linear

    def recording(x, weight, bias=None):
        if tuple(weight.shape) == head_shape and not isinstance(weight, torch.nn.Parameter):
            flags.append(weight.requires_grad)
        return linear(x, weight, bias)

    monkeypatch.setattr(torch.nn.functional, "linear", recording)
    with torch.no_grad():
        model(input_ids=ids, logits_to_keep=1)
    return flags


@pytest.mark.parametrize("requires_grad", [True, False], ids=["trainable", "frozen"])
def test_the_streamed_heads_device_copy_says_what_the_host_weight_does(requires_grad, monkeypatch):
    """The parity test above can tell the two kernels apart only on a torch whose at::matmul
    picks its kernel by the flag (2.13 does, 2.15 does not): this pins the flag itself,
    on every torch, both ways, so a copy that always or never requires grad fails."""
    model = tiny_model("llama", layers=4).requires_grad_(requires_grad)  # fresh, or frozen for inference
    stream(model, "cpu", slots=2, stream_embeddings=True)
    flags = _head_weight_flags(model, batch(96, size=2, seq=6), tuple(model.lm_head.weight.shape), monkeypatch)
    assert flags == [requires_grad]
