"""loss_chunk_tokens (the head and cross-entropy in chunks): gradients, memory, labels and
the loss the Trainer or Liger put in charge; against the unchunked model within fp32
rounding (the sums run in another order), never equal, which the tests check too."""

import contextlib
import copy
import logging
from types import MethodType

import pytest
import torch
from long_pairs import CHUNK, SEQ, STEPS, MatmulFlops, long_pair, step_flops, token_rows
from transformers import Trainer, TrainingArguments

import layerstream
from layerstream.long import chunked_loss

from tiny import (
    assert_traces_equal,
    batch,
    peft_pair,
    stream,
    tiny_model,
    train_steps,
)

# chunked against unchunked: the same sums in another order, in fp32 (torch's defaults for fp32)
CLOSE = dict(rtol=1.3e-6, atol=1e-5)


def _assert_close_traces(a, b):
    for step in range(len(a.losses)):
        torch.testing.assert_close(a.losses[step], b.losses[step], **CLOSE)
        for name in a.grads[step]:
            torch.testing.assert_close(a.grads[step][name], b.grads[step][name], **CLOSE)


def test_a_chunked_loss_step_costs_the_matmul_flops_of_an_unchunked_one():
    """The chunks' gradients are taken in the forward, while their logits exist: the head's
    product runs once forward and once for its input's gradient, as without chunks, and
    not a third time in backward."""
    chunked, _ = long_pair(chunk=CHUNK, tile=None)
    plain, _ = long_pair(chunk=None, tile=None)
    assert step_flops(chunked) == step_flops(plain)


def test_the_chunked_loss_scales_its_gradients_by_the_incoming_one():
    """Gradients taken in the forward are scaled in backward by what reaches the loss
    (gradient accumulation divides it): every parameter's gradient, the head's own weight
    included, matches the unchunked model's within fp32 rounding."""
    plain = tiny_model()
    chunked = chunked_loss.apply(copy.deepcopy(plain), CHUNK)
    ids = batch(96, size=2, seq=SEQ)
    for model in (plain, chunked):
        (model(input_ids=ids, labels=ids).loss * 0.25).backward()
    for (name, expected), (_, got) in zip(plain.named_parameters(), chunked.named_parameters()):
        assert got.grad is not None, name
        torch.testing.assert_close(got.grad, expected.grad, **CLOSE)
    head = chunked.lm_head.weight.grad.clone()
    (chunked(input_ids=ids, labels=ids).loss * 0.25).backward()  # accumulates: twice the first
    torch.testing.assert_close(chunked.lm_head.weight.grad, 2 * head, **CLOSE)


def _node_holds_hidden_sized_tensor(node, numel: int) -> bool:
    def tensors(value):
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (tuple, list)):
            for item in value:
                yield from tensors(item)

    held = [t for value in vars(node).values() for t in tensors(value)]
    try:
        held += [t for t in node.saved_tensors if t is not None]
    except RuntimeError:  # released after its backward: what must happen
        pass
    return any(t.numel() == numel for t in held)


def test_the_chunked_loss_frees_its_hidden_gradient_once_its_backward_ran():
    """The gradient of the hidden states, taken in the forward, is tokens x hidden: held
    until the loss tensor is freed, it would sit in memory through every layer's backward
    (at 92k tokens of an 8B, 0.7 GiB the memory plan does not count). Autograd releases
    it after the loss's own backward; backward with retain_graph=True still runs twice
    (negative control: the probe finds the tensor while the graph is retained)."""
    head = torch.nn.Linear(32, 96, bias=False)
    hidden = torch.randn(2, SEQ, 32, requires_grad=True)
    labels = batch(96, size=2, seq=SEQ)
    loss = chunked_loss.causal_lm_loss(head, hidden, labels, CHUNK)
    node = loss.grad_fn
    while not type(node).__name__.startswith("ChunkedCrossEntropy"):
        node = node.next_functions[0][0]
    assert _node_holds_hidden_sized_tensor(node, hidden.numel()), "the probe sees it before backward"
    loss.backward(retain_graph=True)
    assert _node_holds_hidden_sized_tensor(node, hidden.numel()), "retained for a second backward"
    first = hidden.grad.clone()
    loss.backward()
    torch.testing.assert_close(hidden.grad, 2 * first, rtol=0, atol=0)
    assert not _node_holds_hidden_sized_tensor(node, hidden.numel()), "released after the last backward"


def _steps_under_copying_hooks(model, steps=2) -> dict:
    """Training steps inside a saved-tensor hook that, as TRL's activation_offloading does
    on its way to the host and back, keeps Parameters and views of them and hands back
    every other saved tensor as a contiguous copy."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(tensor):
        if isinstance(tensor, torch.nn.Parameter) or tensor.untyped_storage().data_ptr() in params:
            return tensor
        return tensor.clone(memory_format=torch.contiguous_format)

    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    out = {}
    for step in range(steps):
        ids = batch(96, size=2, seq=SEQ, seed=step)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
        out[f"{step}:loss"] = loss.detach()
        out.update({f"{step}:{n}": p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
        opt.step()
        opt.zero_grad()
    return out


def _differing(a: dict, b: dict) -> list:
    return [k for k in a if not torch.equal(a[k], b[k])]


def test_saved_tensor_hooks_around_a_step_keep_chunks_and_tiles_exact(monkeypatch):
    """TRL's activation_offloading wraps forward and backward in saved-tensor hooks that
    copy every saved tensor but Parameters. The chunks' and tiles' own short-lived graphs
    are kept from them: with the head streamed (its weight a device copy, not a
    Parameter), streamed and resident models still agree bit for bit. Negative control:
    letting the hooks reach those graphs makes the gradients differ."""
    streamed, resident = long_pair(stream_embeddings=True)
    assert not _differing(_steps_under_copying_hooks(streamed), _steps_under_copying_hooks(resident))
    monkeypatch.setattr(chunked_loss, "span_graph", contextlib.nullcontext)
    streamed, resident = long_pair(stream_embeddings=True)
    assert _differing(_steps_under_copying_hooks(streamed), _steps_under_copying_hooks(resident))


def test_the_chunked_loss_takes_no_gradient_under_no_grad():
    """Gradients are taken in the forward only when autograd is on: under no_grad the
    loss runs the head's product once (a Function sees inputs that require grad as
    needing it even then)."""
    head = torch.nn.Linear(32, 96, bias=False)
    hidden = torch.randn(2, SEQ, 32, requires_grad=True)
    labels = batch(96, size=2, seq=SEQ)
    with torch.no_grad(), MatmulFlops() as counted:
        loss = chunked_loss.causal_lm_loss(head, hidden, labels, CHUNK)
    assert counted.flops == 2 * (2 * SEQ) * 32 * 96, "the head once, over every row (each chunk counts a token)"
    assert not loss.requires_grad


def test_chunked_and_tiled_are_close_to_the_unchunked_model_and_not_equal():
    """Within fp32 rounding of the plain model (CLOSE); and not bit for bit, which shows the
    parity tests above compare something that another reduction order changes."""
    streamed, _ = long_pair()
    _, plain = peft_pair()
    got, expected = train_steps(streamed, STEPS, seq=SEQ), train_steps(plain, STEPS, seq=SEQ)
    _assert_close_traces(got, expected)
    differs = any(not torch.equal(got.grads[s][n], expected.grads[s][n]) for s in range(STEPS) for n in got.grads[s])
    assert differs, "chunking must change some bits, or the parity tests could not tell"


def test_labels_ignore_index_and_num_items_follow_the_transformers_loss():
    plain = tiny_model()
    chunked = chunked_loss.apply(copy.deepcopy(plain), CHUNK)
    ids = batch(96, size=2, seq=SEQ)
    labels = ids.clone()
    labels[:, :9] = -100  # a prompt: the first chunks count nothing and are skipped
    for kwargs in ({}, {"num_items_in_batch": torch.tensor(17)}, {"num_items_in_batch": 17}):
        expected = plain(input_ids=ids, labels=labels, **kwargs).loss
        got = chunked(input_ids=ids, labels=labels, **kwargs).loss
        torch.testing.assert_close(got, expected, **CLOSE)
    shift = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:].contiguous()
    shift[:, -6:] = -100  # given shifted labels win over labels, as in transformers
    expected = plain(input_ids=ids, labels=labels, shift_labels=shift).loss
    torch.testing.assert_close(chunked(input_ids=ids, labels=labels, shift_labels=shift).loss, expected, **CLOSE)
    assert chunked(input_ids=ids, shift_labels=shift).loss is None, "no labels: no loss, as in transformers"
    with torch.no_grad():  # evaluation keeps the model's own forward and its logits
        out = chunked(input_ids=ids, labels=labels)
    assert out.logits is not None and out.logits.shape[-1] == 96


def test_liger_fused_loss_is_used_instead_and_said_once(monkeypatch, caplog):
    """A forward from liger_kernel (class-level patch, or bound on the instance as the
    Trainer's use_liger_kernel does) computes the loss; nothing is applied on top of it."""
    from transformers.models.llama import modeling_llama

    own = modeling_llama.LlamaForCausalLM.forward
    calls = []

    def fused(self, *args, **kwargs):
        calls.append(kwargs.get("labels") is not None)
        return own(self, *args, **kwargs)

    fused.__module__ = "liger_kernel.transformers.model.llama"
    chunked_loss._warned.discard("liger")
    monkeypatch.setattr(modeling_llama.LlamaForCausalLM, "forward", fused)
    model = chunked_loss.apply(tiny_model(), CHUNK)
    ids = batch(96, size=2, seq=SEQ)
    with caplog.at_level(logging.WARNING, logger="layerstream"):
        for _ in range(2):
            out = model(input_ids=ids, labels=ids)
    assert calls == [True, True] and out.logits is not None, "Liger's forward ran, with the labels"
    assert sum("Liger" in r.message for r in caplog.records) == 1
    monkeypatch.undo()
    instance = chunked_loss.apply(tiny_model(), CHUNK)
    instance.forward = MethodType(fused, instance)
    calls.clear()
    instance(input_ids=ids, labels=ids)
    assert calls == [True]


def _scaled_loss(logits, labels, vocab_size, **kwargs):
    """A user's own loss: not the cross-entropy the chunks compute."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    return 2 * ForCausalLMLoss(logits, labels, vocab_size, **kwargs) + logits.float().square().mean()


def test_a_loss_function_set_on_the_model_runs_unchunked_and_exact_and_is_said(caplog):
    """``model.loss_function = fn`` (an instance attribute) must compute the loss: chunking
    cross-entropy in its place would train on another loss without a word."""
    streamed, resident = peft_pair()
    stream(streamed, "cpu", loss_chunk_tokens=CHUNK)
    default = train_steps(copy.deepcopy(resident), 1, seq=SEQ)
    for model in (streamed, resident):
        layerstream.api.unwrap_peft(model).loss_function = _scaled_loss
    with caplog.at_level(logging.WARNING, logger="layerstream"):
        got = train_steps(streamed, 2, seq=SEQ)
    expected = train_steps(resident, 2, seq=SEQ)
    assert not torch.equal(default.losses[0], expected.losses[0]), "the custom loss must differ from the default"
    assert_traces_equal(got, expected)
    assert sum("loss_chunk_tokens is not applied" in r.message for r in caplog.records) == 1


def test_the_trainers_use_liger_kernel_leaves_liger_in_charge_and_says_so(tmp_path, monkeypatch, caplog):
    """use_liger_kernel=True binds Liger's fused forward to the model instance, in front of
    the chunked forward: the Trainer integration says once that Liger computes the loss."""
    import transformers.trainer

    def fake_liger(model, config):
        inner = layerstream.api.unwrap_peft(model)
        own = type(inner).forward

        def fused(self, *args, **kwargs):
            return own(self, *args, **kwargs)

        fused.__module__ = "liger_kernel.transformers.model.llama"
        inner.forward = MethodType(fused, inner)

    monkeypatch.setattr(transformers.trainer, "apply_liger_kernel", fake_liger)
    chunked_loss._warned.discard("liger")
    streamed, _ = long_pair()
    args = TrainingArguments(output_dir=str(tmp_path), use_liger_kernel=True, use_cpu=True, report_to="none")
    with caplog.at_level(logging.WARNING, logger="layerstream"):
        Trainer(model=streamed, args=args, train_dataset=token_rows())
    assert sum("Liger" in r.message for r in caplog.records) == 1


def test_gemma2_softcapped_logits_chunked_match_resident_bit_for_bit_and_the_model_closely(monkeypatch):
    """Gemma-2 softcaps its logits before the loss, and so do the chunks: streamed and
    resident agree bit for bit, and both are within fp32 rounding of the unchunked model
    (a cap of 0.5 bends these logits hard). Negative control: chunks without the cap are not."""
    streamed, resident = peft_pair("gemma2", layers=3, final_logit_softcapping=0.5)
    stream(streamed, "cpu", loss_chunk_tokens=CHUNK)
    chunked_loss.apply(resident, CHUNK)
    _, plain = peft_pair("gemma2", layers=3, final_logit_softcapping=0.5)
    got = train_steps(streamed, 2, seq=SEQ)
    assert_traces_equal(got, train_steps(resident, 2, seq=SEQ))
    _assert_close_traces(got, train_steps(plain, 2, seq=SEQ))
    uncapped, plain = peft_pair("gemma2", layers=3, final_logit_softcapping=0.5)
    chunked_loss.apply(uncapped, CHUNK)
    monkeypatch.setattr(chunked_loss, "softcapped", lambda logits, cap: logits)
    with pytest.raises(AssertionError):
        _assert_close_traces(train_steps(uncapped, 1, seq=SEQ), train_steps(plain, 1, seq=SEQ))


class _HeadCasts(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the casts of a tensor of the head weight's shape (autocast's ``to``)."""

    def __init__(self, shape):
        super().__init__()
        self.shape, self.casts = tuple(shape), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._to_copy.default and tuple(args[0].shape) == self.shape:
            self.casts += 1
        return func(*args, **(kwargs or {}))


def _autocast_loss(head, hidden, labels):
    """The chunked loss and its hidden states' gradient under bf16 autocast, and the casts
    of the head's weight it made."""
    hidden = hidden.detach().requires_grad_()
    with _HeadCasts(head.weight.shape) as casts, torch.autocast("cpu", dtype=torch.bfloat16):
        loss = chunked_loss.causal_lm_loss(head, hidden, labels, chunk=8)
        loss.backward()
    return loss.detach(), hidden.grad, casts.casts


def test_under_autocast_a_frozen_float32_head_is_cast_once_with_the_bits_of_a_cast_per_chunk(monkeypatch):
    """peft's k-bit preparation leaves a float32 head, which bf16 autocast casts at every call
    (it caches the casts of trainable leaves only): the chunked loss casts it once for all
    chunks, with the same loss and gradient bits as autocast's cast at each chunk (the
    control: 6 chunks, 6 casts). A head with a hook of its own is called as a module."""
    torch.manual_seed(0)
    head = torch.nn.Linear(32, 96, bias=False).requires_grad_(False)
    hidden, labels = torch.randn(1, 48, 32), torch.randint(0, 96, (1, 48))
    once = _autocast_loss(head, hidden, labels)
    monkeypatch.setattr(chunked_loss, "_cast_once", lambda weight: weight)
    each = _autocast_loss(head, hidden, labels)
    assert (once[2], each[2]) == (1, 6)
    assert torch.equal(once[0], each[0]) and torch.equal(once[1], each[1])
    monkeypatch.undo()
    calls = []
    head.register_forward_hook(lambda module, args, out: calls.append(out.dtype))
    hooked = _autocast_loss(head, hidden, labels)
    assert calls == [torch.bfloat16] * 6 and hooked[2] == 6
    assert torch.equal(hooked[0], once[0]) and torch.equal(hooked[1], once[1])


def test_a_trainable_or_bfloat16_head_is_not_cast_by_the_chunked_loss():
    """Autocast caches a trainable head's cast itself, and a head already in its dtype needs
    none: ``_cast_once`` leaves both, and everything outside autocast, as they are."""
    trainable = torch.nn.Parameter(torch.randn(4, 4))
    frozen = torch.randn(4, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert chunked_loss._cast_once(trainable) is trainable
        for kept in (frozen.bfloat16(), frozen.double(), frozen.long()):
            assert chunked_loss._cast_once(kept) is kept
        assert chunked_loss._cast_once(frozen).dtype == torch.bfloat16
    assert chunked_loss._cast_once(frozen) is frozen


class _Scale(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.tensor(1.5))

    def forward(self, weight):
        return weight * self.scale


def test_a_parametrized_heads_weight_is_computed_at_each_chunk_and_trains():
    """A parametrization computes the head's weight at each call, from tensors that may
    train: the chunks call the head as a module, so its parameter gets the gradient the
    unchunked loss gives (within the chunks' other order of sums)."""
    torch.manual_seed(0)
    head = torch.nn.Linear(32, 96, bias=False).requires_grad_(False)
    torch.nn.utils.parametrize.register_parametrization(head, "weight", _Scale())
    hidden, labels = torch.randn(1, 48, 32), torch.randint(0, 96, (1, 48))
    grads = []
    for chunk in (8, None):
        head.parametrizations.weight[0].scale.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if chunk:
                loss = chunked_loss.causal_lm_loss(head, hidden, labels, chunk=chunk)
            else:
                logits = head(hidden).float()[:, :-1]
                loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 96), labels[:, 1:].reshape(-1))
        loss.backward()
        grads.append(head.parametrizations.weight[0].scale.grad)
    assert grads[0] is not None
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-2, atol=1e-3)
