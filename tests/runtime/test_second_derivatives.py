"""Gradients of gradients (``create_graph=True``, e.g. a gradient penalty): exact where
layerstream can give them, refused before any gradient is computed where it cannot (the
chunked loss and the tiled MLP take their gradients without a graph; a streamed layer's
backward reads weights from a slot that later layers reuse)."""

import pytest
import torch

import layerstream
from layerstream.errors import StreamingError
from layerstream.long import adapter_inputs, chunked_loss, tiled_mlp, tiled_norm

from tiny import batch, peft_pair, stream, train_steps

CHUNK, TILE, SEQ = 5, 13, 24
SETTINGS = {"loss_chunk_tokens": (chunked_loss, CHUNK), "mlp_tile_tokens": (tiled_mlp, TILE)}


def _pair():
    # eager attention: torch's CPU flash attention has no second derivative
    return peft_pair(layers=3, attn="eager")


def _penalty_gradients(model):
    """The gradient of a gradient penalty: d/dθ sum((dL/dθ)²) over the trainable tensors."""
    ids = batch(96, size=2, seq=SEQ)
    params = [p for p in model.parameters() if p.requires_grad]
    loss = model(input_ids=ids, labels=ids).loss
    first = torch.autograd.grad(loss, params, create_graph=True)
    penalty = sum(g.square().sum() for g in first)
    return torch.autograd.grad(penalty, params)


@pytest.mark.parametrize("setting", SETTINGS)
def test_a_second_derivative_through_a_chunked_loss_or_tiled_mlp_is_refused_naming_the_setting(setting):
    module, tokens = SETTINGS[setting]
    _, model = _pair()
    module.apply(model, tokens)
    with pytest.raises(
        StreamingError, match=rf"{setting}: a second derivative .*create_graph=True.*Leave {setting} unset"
    ):
        _penalty_gradients(model)


@pytest.mark.parametrize("setting", SETTINGS)
def test_without_the_refusal_the_second_derivative_would_be_wrong_negative_control(setting, monkeypatch):
    """Why the refusal: with it bypassed, the second derivative through the setting differs
    from the model's own far beyond the chunks' rounding, and the first derivative does not."""
    module, tokens = SETTINGS[setting]
    monkeypatch.setattr(module, "refuse_second_order", lambda *_: None)
    if module is tiled_mlp:  # the norms and attention adapters it sets up refuse too
        monkeypatch.setattr(tiled_norm, "refuse_second_order", lambda *_: None)
        monkeypatch.setattr(adapter_inputs, "refuse_second_order", lambda *_: None)
    _, model = _pair()
    exact = _penalty_gradients(model)
    module.apply(model, tokens)
    wrong = _penalty_gradients(model)
    assert not all(torch.allclose(a, b, rtol=1e-3, atol=1e-5) for a, b in zip(exact, wrong))


@pytest.mark.parametrize(
    "settings", [{}, {"loss_chunk_tokens": CHUNK}, {"mlp_tile_tokens": TILE}], ids=["plain", "chunked", "tiled"]
)
def test_a_second_derivative_through_a_streamed_model_is_refused_before_any_layer_recomputes(settings):
    streamed, resident = _pair()
    stream(streamed, **settings)
    for name, value in settings.items():
        SETTINGS[name][0].apply(resident, value)
    runtime = layerstream.get_runtime(streamed)
    ids = batch(96, size=2, seq=SEQ)
    params = [p for p in streamed.parameters() if p.requires_grad]
    loss = streamed(input_ids=ids, labels=ids).loss
    visits = runtime.visits
    expected = "loss_chunk_tokens" if settings.get("loss_chunk_tokens") else "streamed layer .*unstream_model"
    with pytest.raises(StreamingError, match=rf"second derivative .*create_graph=True.*{expected}"):
        torch.autograd.grad(loss, params, create_graph=True)
    assert runtime.visits == visits, "a layer was recomputed before the refusal"
    assert all(p.grad is None for p in params)
    del loss
    got, want = train_steps(streamed, 2, seq=SEQ), train_steps(resident, 2, seq=SEQ)  # the model trains on exactly
    assert all(torch.equal(a, b) for a, b in zip(got.losses, want.losses))
    assert all(torch.equal(got.grads[-1][n], want.grads[-1][n]) for n in want.grads[-1])


def test_a_resident_model_differentiates_twice_so_the_refusals_are_the_settings_own():
    _, model = _pair()
    second = _penalty_gradients(model)
    assert any(g.abs().sum() > 0 for g in second)
