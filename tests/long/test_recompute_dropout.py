"""Dropout where layerstream recomputes: the tiled MLP's backward runs its tiles again, and
streamed layers run again under checkpoint. Both replay the forward's random state, so
every mask drawn in backward is the mask the forward drew, and a streamed run takes the
random numbers a resident run takes, in the same order. The chunked loss recomputes
nothing (its gradients are taken in the forward). Streamed and resident runs with
``lora_dropout=0.05`` agree bit for bit; negative controls prove that a recompute drawing
fresh masks is caught."""

import contextlib

import pytest
import torch
import torch.utils.checkpoint
from torch import nn

import layerstream
from layerstream.long import chunked_loss, tiled_mlp

from tiny import assert_traces_equal, peft_pair, scale_mlp_outputs, stream, train_steps

STEPS = 3
SEQ = 24  # 2 x 24 tokens: 4 MLP tiles of 13, 10 loss chunks of 5
LONG = {"loss_chunk_tokens": 5, "mlp_tile_tokens": 13}
DROPOUT = {"lora_dropout": 0.05}
ALL_LINEAR_AND_HEAD = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
CASES = {
    "tiled-and-chunked": (LONG, DROPOUT),
    "dropout-on-the-chunked-head": (LONG, dict(DROPOUT, target_modules=ALL_LINEAR_AND_HEAD)),
    "tiled-with-offloaded-inputs": (dict(LONG, offload_activations=True), DROPOUT),
    "tiles-run-in-the-layer-recompute": (dict(LONG, scale_mlp_outputs=True), DROPOUT),
    "untiled": ({}, DROPOUT),
}


class MaskSpy:
    """The mask each active Dropout of ``model`` draws (where its output is not zero), per
    step and module: those drawn during the model's forward and those drawn after it (in
    backward, by a recompute). Parity alone cannot see a tiled backward that draws fresh
    masks: the resident model recomputes its tiles too, from the same random stream, so
    both runs would draw the same wrong masks; the masks are compared here."""

    def __init__(self, model: nn.Module):
        self.drawn, self.redrawn = [], []
        self.handles = [
            model.register_forward_pre_hook(self._step_begins),
            model.register_forward_hook(self._forward_ends),
        ]
        for name, module in model.named_modules():
            if isinstance(module, nn.Dropout) and module.p > 0:
                self.handles.append(module.register_forward_hook(self._record(name)))

    def _step_begins(self, *_):
        self.drawn.append({})
        self.redrawn.append({})
        self.masks = self.drawn[-1]

    def _forward_ends(self, *_):
        self.masks = self.redrawn[-1]

    def _record(self, name):
        def hook(module, args, output):
            self.masks.setdefault(name, []).append(output.detach() != 0)

        return hook

    def remove(self):
        for handle in self.handles:
            handle.remove()

    def recomputed(self) -> int:
        return sum(len(masks) for step in self.redrawn for masks in step.values())

    def assert_recomputes_replay(self):
        """Each module that drew masks again in a step's backward drew the forward's, in
        order, once per recompute (a layer's recompute and its tiles' backward may both run
        the MLP)."""
        dropped = [m for step in self.drawn for masks in step.values() for m in masks if not m.all()]
        assert dropped, "dropout must have dropped something"
        for step, (drawn, redrawn) in enumerate(zip(self.drawn, self.redrawn)):
            for name, masks in redrawn.items():
                forward = drawn.get(name, [])
                replays = len(masks) // max(len(forward), 1)
                same = len(masks) == replays * len(forward) and all(map(torch.equal, masks, forward * replays))
                assert same, f"{name} drew other dropout masks in its recompute than in its forward at step {step}"


def _pair(settings: dict, lora: dict, device):
    settings = dict(settings)
    scaled = settings.pop("scale_mlp_outputs", False)
    streamed, resident = peft_pair(layers=5, lora=lora)
    if scaled:
        scale_mlp_outputs(streamed)
        scale_mlp_outputs(resident)
    stream(streamed, device, slots=2, prefetch=1, **settings)
    resident.to(device)
    if "loss_chunk_tokens" in settings:
        chunked_loss.apply(resident, settings["loss_chunk_tokens"])
    if "mlp_tile_tokens" in settings:
        tiled_mlp.apply(resident, settings["mlp_tile_tokens"])
    return streamed, resident


def _random_state(device) -> list:
    state = [torch.get_rng_state()]
    if torch.device(device).type == "cuda":
        state.append(torch.cuda.get_rng_state(device))
    return state


def _seeded_run(model, device):
    torch.manual_seed(0)  # the CPU's and every CUDA device's generator
    spy = MaskSpy(model)
    try:
        trace = train_steps(model, STEPS, seq=SEQ, device=device)
    finally:
        spy.remove()
    return trace, _random_state(device), spy


def _assert_dropout_parity(case: str, device) -> None:
    """Streamed and resident, same settings and seed: the same losses and LoRA gradients,
    bit for bit; the random streams left where the other left them; every recomputed mask
    the forward's."""
    settings, lora = CASES[case]
    streamed, resident = _pair(settings, lora, device)
    got, got_state, got_masks = _seeded_run(streamed, device)
    expected, expected_state, expected_masks = _seeded_run(resident, device)
    got_masks.assert_recomputes_replay()
    expected_masks.assert_recomputes_replay()
    assert_traces_equal(got, expected)
    assert all(map(torch.equal, got_state, expected_state)), "the streamed run drew other random numbers"
    assert got_masks.recomputed() > 0, "streamed layers are recomputed in backward"
    if "mlp_tile_tokens" in settings:
        assert expected_masks.recomputed() > 0, "the tiled MLP recomputes its tiles in backward"
    stats = layerstream.get_runtime(streamed).stats()
    assert stats["layer_loads"] > stats["layers"], "slots must have recycled"


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_dropout_streamed_matches_resident_bit_for_bit(case, device):
    _assert_dropout_parity(case, device)


def test_a_tiled_recompute_that_draws_fresh_masks_is_caught(monkeypatch, device):
    """Negative control: the tiles' backward without the forward's random state."""
    monkeypatch.setattr(tiled_mlp.ForwardRandomState, "replayed", lambda self: contextlib.nullcontext())
    with pytest.raises(AssertionError, match="other dropout masks"):
        _assert_dropout_parity("tiled-and-chunked", device)


def test_a_layer_recompute_that_draws_fresh_masks_is_caught(monkeypatch, device):
    """Negative control: streamed layers checkpointed without the forward's random state."""
    checkpoint = torch.utils.checkpoint.checkpoint

    def forgetful(function, *args, **kwargs):
        return checkpoint(function, *args, **dict(kwargs, preserve_rng_state=False))

    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint", forgetful)
    with pytest.raises(AssertionError, match="other dropout masks|differs"):
        _assert_dropout_parity("untiled", device)


def test_tiles_draw_their_own_masks_unlike_an_untiled_mlp():
    """The tiled MLP draws each tile's masks in turn, so with dropout its run is not the
    untiled run of the same seed (without dropout the two agree within rounding). Where one
    tile covers every token the MLP runs untiled: the same masks, bit for bit."""
    _, untiled = peft_pair(layers=2, lora=DROPOUT)
    _, tiled = peft_pair(layers=2, lora=DROPOUT)
    _, whole = peft_pair(layers=2, lora=DROPOUT)
    tiled_mlp.apply(tiled, 13)
    tiled_mlp.apply(whole, 2 * SEQ)
    expected = _seeded_run(untiled, "cpu")[0]
    assert_traces_equal(_seeded_run(whole, "cpu")[0], expected)
    got = _seeded_run(tiled, "cpu")[0]
    assert abs(got.losses[0] - expected.losses[0]) > 1e-4, "other masks, not only rounding"
