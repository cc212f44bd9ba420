"""The decoder layers' norms differentiated in tiles (with mlp_tile_tokens): the same bits as
the untiled norms, streamed and resident, with only the norm's input kept for backward."""

import copy
import logging

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from layerstream.long import tiled_mlp, tiled_norm
from layerstream.long.tiled_norm import TiledNormFunction

from tiny import assert_traces_equal, batch, peft_pair, stream, tiny_model, train_steps

SEQ, TILE = 24, 7  # 2 x 24 tokens in tiles of 7: the last tile is short


def _counting(monkeypatch):
    calls = {"backward": 0}
    original = TiledNormFunction.backward

    def counted(ctx, grad):
        calls["backward"] += 1
        return original(ctx, grad)

    monkeypatch.setattr(TiledNormFunction, "backward", staticmethod(counted))
    return calls


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "phi3"])
def test_tiled_norms_give_the_untiled_models_bits(family, device, monkeypatch):
    calls = _counting(monkeypatch)
    tiled, plain = peft_pair(family, layers=3, dtype=torch.bfloat16)
    tiled.to(device), plain.to(device)
    tiled_norm.apply(tiled, TILE)
    assert_traces_equal(train_steps(tiled, 3, device, seq=SEQ), train_steps(plain, 3, device, seq=SEQ))
    per_layer = 4 if family == "gemma3_text" else 2  # Gemma 3 has norms before and after each block
    # every norm of every layer but the first one, whose input (the frozen embedding's) takes no gradient
    assert calls["backward"] == 3 * (3 * per_layer - 1), "every norm took its tiled backward"


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "phi3"])
def test_float32_inputs_give_the_untiled_models_bits(family, device, monkeypatch):
    """A float32 residual stream (peft's prepare_model_for_kbit_training): the norm's
    operations read the input directly and autograd adds each one's term to the residual
    branch's in turn; the tiled backward hands them over one by one in that order."""
    calls = _counting(monkeypatch)
    tiled, plain = peft_pair(family, layers=3)
    tiled.to(device), plain.to(device)
    tiled_norm.apply(tiled, TILE)
    assert_traces_equal(train_steps(tiled, 3, device, seq=SEQ), train_steps(plain, 3, device, seq=SEQ))
    per_layer = 4 if family == "gemma3_text" else 2
    assert calls["backward"] == 3 * (3 * per_layer - 1), "every norm took its tiled backward"


def test_float32_inputs_under_autocast_and_checkpointing_give_the_untiled_bits(monkeypatch):
    """As a prepared QLoRA Trainer script runs them: bf16 autocast around a float32 residual
    stream, each layer checkpointed (its recompute counts the norm's reads again)."""
    calls = _counting(monkeypatch)
    tiled, plain = peft_pair("llama", layers=3, lora={"lora_dropout": 0.1})
    for model in (tiled, plain):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    tiled_norm.apply(tiled, TILE)
    torch.manual_seed(0)
    got = train_steps(tiled, 2, seq=SEQ, autocast=torch.bfloat16)
    torch.manual_seed(0)
    assert_traces_equal(got, train_steps(plain, 2, seq=SEQ, autocast=torch.bfloat16))
    # checkpointing makes the embedding's output take a gradient: the first norm tiles too
    assert calls["backward"] == 2 * 3 * 2


def test_float32_terms_handed_over_already_summed_give_other_bits(monkeypatch):
    """Negative control: the same tiles, with each tile's terms added together before
    autograd adds them to the residual branch's (``residual + (scale + square)``)."""
    real = tiled_norm._each_reads_gradient

    def summed(module, leaf, grad, terms, a, b):
        real(module, leaf, grad, terms, a, b)
        assert len(terms) == 2, "an RMSNorm reads a float32 input twice: the square and the scale"
        terms[0][a:b] += terms[1][a:b]
        terms[1][a:b] = 0

    monkeypatch.setattr(tiled_norm, "_each_reads_gradient", summed)
    tiled, plain = peft_pair("llama", layers=3)
    tiled_norm.apply(tiled, TILE)
    with pytest.raises(AssertionError):
        assert_traces_equal(train_steps(tiled, 3, seq=SEQ), train_steps(plain, 3, seq=SEQ))


def test_the_comparison_catches_a_tile_left_out(monkeypatch):
    """Negative control: a backward that skips the last tile gives other gradients."""
    tiled, plain = peft_pair("llama", layers=3, dtype=torch.bfloat16)
    tiled_norm.apply(tiled, TILE)

    def all_but_the_last(total, tile):
        return [(a, min(a + tile, total)) for a in range(0, total - tile, tile)]

    monkeypatch.setattr(tiled_norm, "spans", all_but_the_last)
    with pytest.raises(AssertionError):
        assert_traces_equal(train_steps(tiled, 2, seq=SEQ), train_steps(plain, 2, seq=SEQ))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_streamed_tiled_norms_match_the_resident_ones(monkeypatch, dtype):
    calls = _counting(monkeypatch)
    streamed, resident = peft_pair("llama", layers=5, dtype=dtype)
    stream(streamed, "cpu", mlp_tile_tokens=TILE)
    tiled_mlp.apply(resident, TILE)
    assert_traces_equal(train_steps(streamed, 3, seq=SEQ), train_steps(resident, 3, seq=SEQ))
    assert calls["backward"] > 0


def _saved_bytes(norm, x):
    saved = []

    def pack(tensor):
        saved.append(tensor.numel() * tensor.element_size())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        norm(x)
    return sum(saved)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_tiled_norm_keeps_only_its_input(dtype):
    model = tiny_model("llama", layers=1, dtype=dtype).requires_grad_(False)  # frozen, as under LoRA
    norm = model.model.layers[0].post_attention_layernorm
    x = torch.randn(2, SEQ, model.config.hidden_size, dtype=dtype, requires_grad=True)
    untiled = _saved_bytes(norm, x)
    tiled_norm.apply(model, TILE)
    tiled = _saved_bytes(norm, x)
    weight = norm.weight.numel() * norm.weight.element_size()
    assert tiled == x.numel() * x.element_size() + weight, "the input once and the (frozen) weight, nothing else"
    assert untiled >= 2 * x.numel() * 4, "untiled, autograd keeps float32 tensors of the input's size"


def test_a_norm_with_a_trainable_weight_runs_untiled_and_says_so(monkeypatch, caplog):
    monkeypatch.setattr(tiled_norm, "_said_trainable", False)
    calls = _counting(monkeypatch)
    model = tiny_model("llama", layers=2, dtype=torch.bfloat16)
    plain = copy.deepcopy(model)
    for m in (model, plain):  # the norms and the embedding train, nothing else
        for name, p in m.named_parameters():
            p.requires_grad_("norm" in name or "embed_tokens" in name)
    tiled_norm.apply(model, TILE)
    with caplog.at_level(logging.WARNING, logger="layerstream"):
        assert_traces_equal(train_steps(model, 2, seq=SEQ), train_steps(plain, 2, seq=SEQ))
    assert calls["backward"] == 0
    assert sum("trainable weight" in r.getMessage() for r in caplog.records) == 1


def test_short_inputs_evaluation_and_generation_run_the_norms_own_forward(monkeypatch):
    calls = _counting(monkeypatch)
    tiled, plain = peft_pair("llama", layers=2, dtype=torch.bfloat16)
    tiled_norm.apply(tiled, TILE)
    ids = batch(96, size=1, seq=5)
    kwargs = dict(max_new_tokens=4, do_sample=False, attention_mask=torch.ones_like(ids), pad_token_id=0)
    assert torch.equal(tiled.generate(input_ids=ids, **kwargs), plain.generate(input_ids=ids, **kwargs))
    assert_traces_equal(train_steps(tiled, 1, seq=3, batch_size=1), train_steps(plain, 1, seq=3, batch_size=1))
    assert calls["backward"] == 0, "3 tokens fit one tile: nothing to tile"


def test_removing_the_tiles_restores_the_norms_classes():
    model = tiny_model("llama", layers=2)
    classes = [type(n) for n in tiled_norm.norms(model)]
    tiled_norm.apply(model, TILE)
    assert all(type(n) is not c for n, c in zip(tiled_norm.norms(model), classes))
    tiled_norm.remove(model)
    assert [type(n) for n in tiled_norm.norms(model)] == classes


def _input_gradient_beside_a_residual(norm, x):
    """The gradient of ``x`` (its strides kept) read by ``norm`` and by a residual branch,
    whose gradient autograd adds to the norm's terms, as in a decoder layer."""
    gen = torch.Generator().manual_seed(1)
    grad = torch.randn(x.shape, generator=gen, dtype=x.dtype)
    residual_grad = torch.randn(x.shape, generator=gen, dtype=x.dtype)
    leaf = x.detach().requires_grad_(True)
    torch.autograd.backward([leaf * 1.0, norm(leaf)], [residual_grad, grad])
    return leaf.grad


class _WholeRowAdds(TorchDispatchMode):
    """Counts the elements of additions whose result has rows of the hidden width."""

    def __init__(self, hidden):
        super().__init__()
        self.hidden, self.count = hidden, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if (
            func._overloadpacket is torch.ops.aten.add
            and isinstance(out, torch.Tensor)
            and out.shape[-1] == self.hidden
        ):
            self.count += out.numel()
        return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_tiled_norms_backward_adds_no_more_than_the_untiled_one(dtype):
    """Each tile's terms are handed over as they come; autograd does not also sum them into the
    tile's input gradient, which nothing reads (a float32 input's two terms: a sum per tile).
    Counted in elements: the sums the norm's own backward takes, it takes tile by tile."""
    model = tiny_model("llama", layers=1, dtype=dtype).requires_grad_(False)
    norm = model.model.layers[0].post_attention_layernorm
    hidden = model.config.hidden_size
    x = torch.randn(2, SEQ, hidden, dtype=dtype)
    grad = torch.randn_like(x)

    def adds():
        leaf = x.clone().requires_grad_(True)
        out = norm(leaf)
        with _WholeRowAdds(hidden) as counted:
            out.backward(grad)
        return counted.count, leaf.grad

    untiled, plain = adds()
    tiled_norm.apply(model, TILE)
    tiled, gradient = adds()
    assert torch.equal(gradient, plain)
    assert tiled == untiled, f"{tiled} elements added tiled, {untiled} untiled"


def test_a_remainder_shorter_than_the_fewest_rows_joins_the_tile_before_it():
    assert tiled_norm.tile_spans(45060, 4096, 16)[-2:] == [(36864, 40960), (40960, 45060)]
    assert len(tiled_norm.tile_spans(45060, 4096, 16)) == 11
    assert tiled_norm.tile_spans(4096 + 15, 4096, 16) == [(0, 4111)], "15 rows join the tile before them"
    assert tiled_norm.tile_spans(16400, 4096, 16)[-1] == (16384, 16400), "16 rows make a tile of their own"
    assert tiled_norm.tile_spans(15, 7, 2) == [(0, 7), (7, 15)], "one row left joins the tile before it"
    assert tiled_norm.tile_spans(48, 7, 16) == [(0, 16), (16, 32), (32, 48)], "a tile is at least the fewest rows"
    assert tiled_norm.fewest_rows(torch.device("cpu")) == 2
    assert tiled_norm.fewest_rows(torch.device("cuda", 0)) == tiled_norm.FEWEST_ROWS == 16


def test_a_few_rows_more_than_the_tile_still_keep_only_the_norms_input(monkeypatch):
    """Past the tile by fewer than the fewest rows, the input is one span: it still goes
    through the Function, which keeps only the input (the plan counts the norms tiled)."""
    monkeypatch.setattr(tiled_norm, "fewest_rows", lambda device: 16)
    model = tiny_model("llama", layers=1, dtype=torch.bfloat16).requires_grad_(False)
    norm = model.model.layers[0].post_attention_layernorm
    tiled_norm.apply(model, 40)
    x = torch.randn(1, 48, model.config.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    assert type(norm(x).grad_fn).__name__ == "TiledNormFunctionBackward"
    assert _saved_bytes(norm, x) == x.numel() * x.element_size() + norm.weight.numel() * norm.weight.element_size()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_tiles_with_a_remainder_joined_give_the_untiled_bits(dtype, monkeypatch):
    """The tiles as CUDA takes them, on the CPU: 48 rows in tiles of at least 10, the last 8
    joined to the one before it."""
    taken = []
    spans_of = tiled_norm.tile_spans

    def recorded(rows, tile, fewest):
        taken.append(spans_of(rows, tile, fewest))
        return taken[-1]

    monkeypatch.setattr(tiled_norm, "fewest_rows", lambda device: 10)
    monkeypatch.setattr(tiled_norm, "tile_spans", recorded)
    model = tiny_model("llama", layers=1, dtype=dtype).requires_grad_(False)
    norm = model.model.layers[0].post_attention_layernorm
    x = torch.randn(2, SEQ, model.config.hidden_size, dtype=dtype)
    plain = _input_gradient_beside_a_residual(norm, x)
    tiled_norm.apply(model, TILE)
    assert torch.equal(_input_gradient_beside_a_residual(norm, x), plain)
    assert [(0, 10), (10, 20), (20, 30), (30, 48)] in taken, taken


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [16384, 16388, 16400])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_at_an_8b_width_a_tiled_norms_input_gradient_has_the_untiled_bits(family, dtype, tokens):
    """On CUDA a reduction's kernel is chosen by its sizes: the row sums of a 4,096-token
    tile, of a last tile of 16, and of 4 last tokens (joined to the tile before them: alone,
    they were summed in another order) must be taken as in the whole norm, at Llama-3-8B's
    width. The input also feeds a residual branch, whose gradient autograd adds to the norm's
    terms."""
    config = dict(hidden_size=4096, intermediate_size=64, num_attention_heads=32, num_key_value_heads=8, head_dim=128)
    model = tiny_model(family, layers=1, dtype=dtype, **config).requires_grad_(False).cuda()
    norm = model.model.layers[0].post_attention_layernorm
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1, tokens, 4096, device="cuda", dtype=dtype, generator=gen)
    grad = torch.randn(1, tokens, 4096, device="cuda", dtype=dtype, generator=gen)
    residual_grad = torch.randn(1, tokens, 4096, device="cuda", dtype=dtype, generator=gen)

    def input_gradient():
        leaf = x.clone().requires_grad_(True)
        out = norm(leaf)
        torch.autograd.backward([leaf * 1.0, out], [residual_grad, grad])
        return leaf.grad, out.grad_fn

    plain, _ = input_gradient()
    tiled_norm.apply(model, 4096)
    tiled, node = input_gradient()
    assert type(node).__name__ == "TiledNormFunctionBackward", "the tiled norm ran"
    assert torch.equal(tiled, plain)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_non_contiguous_input_runs_the_norms_own_backward(dtype, monkeypatch):
    """Rows of a strided input would be a copy, whose reductions take other kernels: such an
    input (a custom model's transposed states) runs untiled, with the untiled bits."""
    calls = _counting(monkeypatch)
    model = tiny_model("llama", layers=1, dtype=dtype).requires_grad_(False)
    norm = model.model.layers[0].post_attention_layernorm
    hidden = model.config.hidden_size
    x = torch.randn(2, hidden, SEQ, dtype=dtype).transpose(1, 2)
    plain = _input_gradient_beside_a_residual(norm, x)
    tiled_norm.apply(model, TILE)
    assert torch.equal(_input_gradient_beside_a_residual(norm, x), plain)
    assert calls["backward"] == 0
