"""The streamed head computes with the kernel the resident head would: at::matmul folds a
strided input (the last position that ``logits_to_keep`` and ``generate`` keep) into one
matrix product or batches it by whether the weight requires grad, even with grad off. A
model fresh from ``from_pretrained`` has every weight requiring grad, so its head's device
copy must say so too, or generation's scores differ from the resident model's in the last
bits."""

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


def test_the_two_kernels_differ_on_a_strided_input_so_the_comparison_can_fail():
    """Control: the same product with the weight's flag flipped gives other bits."""
    torch.manual_seed(0)
    x, weight = torch.randn(2, 6, 32)[:, -1:, :], torch.randn(96, 32)
    with torch.no_grad():
        assert not torch.equal(
            torch.nn.functional.linear(x, weight.clone().requires_grad_()), torch.nn.functional.linear(x, weight)
        )
