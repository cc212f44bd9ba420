"""The attention adapters' dropout drawn again in backward where the MLP is tiled: the bits
of the adapters that keep their dropped inputs, streamed and resident, with only the input
kept, and a recompute that draws fresh masks caught."""

import contextlib
import logging

import pytest
import torch
from peft import get_peft_model

from layerstream.long import adapter_inputs, tiled_mlp, tiles
from layerstream.modules import swap

from tiny import assert_traces_equal, lora_config, peft_pair, stream, tiny_model, train_steps

SEQ, TILE = 24, 7
DROPOUT = {"lora_dropout": 0.1}


def _counting(monkeypatch):
    calls = {"backward": 0}
    original = adapter_inputs.DroppedInputFunction.backward

    def counted(ctx, grad):
        calls["backward"] += 1
        return original(ctx, grad)

    monkeypatch.setattr(adapter_inputs.DroppedInputFunction, "backward", staticmethod(counted))
    return calls


def _tiled_keeping_inputs(model):
    """The comparison: the same tiled MLP and norms, the adapters keeping their inputs."""
    tiled_mlp.apply(model, TILE)
    adapter_inputs.remove(model)
    return model


def _steps(model, device="cpu", autocast=None, steps=2):
    torch.manual_seed(0)  # the dropout masks
    return train_steps(model, steps, device, seq=SEQ, autocast=autocast)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("autocast", [None, torch.bfloat16], ids=["plain", "autocast"])
@pytest.mark.parametrize("family", ["llama", "phi3", "gemma3_text"])
def test_recomputed_dropout_gives_the_kept_inputs_bits(family, autocast, dtype, device, monkeypatch):
    calls = _counting(monkeypatch)
    recomputed, kept = peft_pair(family, layers=3, dtype=dtype, lora=DROPOUT)
    recomputed.to(device), kept.to(device)
    tiled_mlp.apply(recomputed, TILE)
    assert_traces_equal(_steps(recomputed, device, autocast), _steps(_tiled_keeping_inputs(kept), device, autocast))
    per_layer = 2 if family == "phi3" else 4  # Phi-3 fuses q, k and v into one projection
    if dtype == torch.bfloat16 and autocast is not None:
        # PEFT casts the bf16 input to its float32 adapters: drawn again, each adapter would
        # keep that 4-byte cast where PEFT keeps 3 bytes (its mask and autocast's copy)
        assert calls["backward"] == 0
    else:
        assert calls["backward"] == 2 * 3 * per_layer, "every attention adapter drew its mask again"


def test_a_recompute_that_draws_fresh_masks_is_caught(monkeypatch):
    """Negative control: backward without the forward's random state replayed."""

    class Fresh(tiles.ForwardRandomState):
        def replayed(self):
            return contextlib.nullcontext()

    monkeypatch.setattr(adapter_inputs, "ForwardRandomState", Fresh)
    recomputed, kept = peft_pair("llama", layers=3, lora=DROPOUT)
    tiled_mlp.apply(recomputed, TILE)
    with pytest.raises(AssertionError):
        assert_traces_equal(_steps(recomputed), _steps(_tiled_keeping_inputs(kept)))


def _saved_bytes(attention, x, **kwargs):
    """Bytes attention's forward saves for backward, each tensor counted once."""
    saved = {}

    def pack(tensor):
        saved[(tensor.data_ptr(), tensor.shape, tensor.dtype)] = tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        attention(x, **kwargs)
    return sum(saved.values())


def test_the_attention_adapters_keep_only_their_input():
    """q, k and v read one input: kept once, where each adapter kept its mask and its
    dropped input."""
    model = get_peft_model(tiny_model("llama", layers=1), lora_config(**DROPOUT))
    model.train()
    layer = model.get_base_model().model.layers[0]
    x = torch.randn(2, SEQ, model.config.hidden_size, requires_grad=True)
    position = torch.arange(SEQ).expand(2, SEQ)
    rotary = model.get_base_model().model.rotary_emb(x, position)
    kwargs = dict(position_embeddings=rotary, attention_mask=None)
    kept = _saved_bytes(layer.self_attn, x, **kwargs)
    tiled_mlp.apply(model, TILE)
    recomputed = _saved_bytes(layer.self_attn, x, **kwargs)
    width = x.numel() * x.element_size()
    assert kept - recomputed >= 3 * width, (kept, recomputed)


def test_streamed_recomputed_inputs_match_the_resident_ones(monkeypatch):
    calls = _counting(monkeypatch)
    streamed, resident = peft_pair("llama", layers=5, lora=DROPOUT)
    stream(streamed, "cpu", mlp_tile_tokens=TILE)
    tiled_mlp.apply(resident, TILE)
    assert_traces_equal(_steps(streamed, steps=3), _steps(resident, steps=3))
    assert calls["backward"] > 0


def test_adapters_added_after_streaming_recompute_from_the_first_step(monkeypatch):
    """TRL and `layerstream run` inject the adapters after the model streamed."""
    import copy

    calls = _counting(monkeypatch)
    base = tiny_model("llama", layers=4)
    resident = get_peft_model(copy.deepcopy(base), lora_config(**DROPOUT))
    stream(base, "cpu", mlp_tile_tokens=TILE)
    streamed = get_peft_model(base, lora_config(**DROPOUT))
    adapters = {k: v for k, v in resident.state_dict().items() if "lora_" in k}
    assert not streamed.load_state_dict(adapters, strict=False).unexpected_keys
    tiled_mlp.apply(resident, TILE)
    assert_traces_equal(_steps(streamed), _steps(resident))
    assert calls["backward"] > 0


def test_evaluation_and_short_inputs_run_peft_own_forward(monkeypatch):
    calls = _counting(monkeypatch)
    recomputed, kept = peft_pair("llama", layers=2, lora=DROPOUT)
    tiled_mlp.apply(recomputed, TILE)
    torch.manual_seed(0)
    got = train_steps(recomputed, 1, seq=3, batch_size=1)
    torch.manual_seed(0)
    assert_traces_equal(got, train_steps(kept, 1, seq=3, batch_size=1))
    assert calls["backward"] == 0, "3 tokens fit one tile: nothing recomputed"


def test_mlp_and_dora_adapters_are_left_as_they_are_and_remove_restores_classes():
    model = get_peft_model(tiny_model("llama", layers=2), lora_config(**DROPOUT))
    tiled_mlp.apply(model, TILE)
    layer = model.get_base_model().model.layers[0]
    assert swap.has(layer.self_attn.q_proj.lora_dropout["default"], adapter_inputs.DeferredDropout)
    assert not swap.behaviours(layer.mlp.up_proj.lora_dropout["default"])
    tiled_mlp.remove(model)
    assert not swap.behaviours(layer.self_attn.q_proj.lora_dropout["default"])
    assert not swap.behaviours(layer.self_attn.q_proj.lora_A["default"])
    dora = get_peft_model(tiny_model("llama", layers=2), lora_config(use_dora=True, **DROPOUT))
    tiled_mlp.apply(dora, TILE)
    assert not any(swap.has(m, adapter_inputs.DeferredDropout) for m in dora.modules())


def test_a_direct_dropout_call_drops_and_a_hook_on_lora_a_sees_the_dropped_input(monkeypatch, caplog):
    """Outside PEFT's own forward the dropout drops as always; a pre-hook on lora_A that
    swaps its input gets PEFT's behaviour (the dropout runs first, so the hook sees it)."""
    calls = _counting(monkeypatch)
    model = get_peft_model(tiny_model("llama", layers=1), lora_config(lora_dropout=0.5))
    tiled_mlp.apply(model, TILE)
    model.train()
    q = model.get_base_model().model.layers[0].self_attn.q_proj
    x = torch.randn(2, SEQ, model.config.hidden_size, requires_grad=True)
    assert not torch.equal(q.lora_dropout["default"](x), x), "a direct call drops"
    assert torch.equal(q.lora_A["default"](x), torch.nn.functional.linear(x, q.lora_A["default"].weight))
    recomputed, kept = peft_pair("llama", layers=2, lora=DROPOUT)
    for model in (recomputed, kept):
        for module in model.modules():
            if hasattr(module, "lora_A") and isinstance(module.lora_A, torch.nn.ModuleDict):
                module.lora_A["default"].register_forward_pre_hook(lambda m, args: (args[0] * 1.0,))
    tiled_mlp.apply(recomputed, TILE)
    monkeypatch.setattr(adapter_inputs, "_said_hooked", False)
    with caplog.at_level(logging.WARNING, logger="layerstream"):
        assert_traces_equal(_steps(recomputed), _steps(_tiled_keeping_inputs(kept)))
    assert calls["backward"] == 0, "hooked adapters keep their inputs"
    assert sum("forward hooks" in r.getMessage() for r in caplog.records) == 1, "said once"


def test_eval_between_forward_and_backward_keeps_the_forwards_masks(monkeypatch):
    calls = _counting(monkeypatch)
    recomputed, kept = peft_pair("llama", layers=2, lora=DROPOUT)
    tiled_mlp.apply(recomputed, TILE)
    _tiled_keeping_inputs(kept)
    grads = []
    for model in (recomputed, kept):
        model.train()
        torch.manual_seed(0)
        ids = torch.randint(3, 96, (2, SEQ), generator=torch.Generator().manual_seed(1))
        loss = model(input_ids=ids, labels=ids).loss
        model.eval()
        loss.backward()
        grads.append([p.grad.clone() for p in model.parameters() if p.requires_grad])
    assert calls["backward"] > 0
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_a_deferred_dropout_whose_lora_a_never_runs_keeps_no_input_alive():
    """An exception between PEFT's dropout and lora_A leaves the mark behind: it holds the
    input weakly, and the next call of lora_A on another tensor drops that one."""
    import gc
    import weakref

    model = get_peft_model(tiny_model("llama", layers=1), lora_config(**DROPOUT))
    tiled_mlp.apply(model, TILE)
    model.train()
    q = model.get_base_model().model.layers[0].self_attn.q_proj
    x = torch.randn(2, SEQ, model.config.hidden_size, requires_grad=True)
    q.__dict__[adapter_inputs._INSIDE] = 1  # as inside PEFT's forward
    assert q.lora_dropout["default"](x) is x, "deferred to lora_A"
    q.__dict__[adapter_inputs._INSIDE] = 0
    ref = weakref.ref(x)
    del x
    gc.collect()
    assert ref() is None
    y = torch.randn(2, SEQ, model.config.hidden_size)
    torch.manual_seed(0)
    got = q.lora_A["default"](y)
    torch.manual_seed(0)
    dropped = torch.nn.functional.dropout(y, DROPOUT["lora_dropout"], True)
    assert torch.equal(got, torch.nn.functional.linear(dropped, q.lora_A["default"].weight))
