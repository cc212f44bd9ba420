"""loss_chunk_tokens (the head and cross-entropy in chunks) and mlp_tile_tokens (the MLP in
tiles of tokens): streamed and resident runs of the same chunking agree bit for bit (every
loss and LoRA gradient), with non-zero LoRA B and more layers than slots; against the
unchunked model they agree within fp32 rounding, since the sums run in another order.
Negative controls prove each comparison can fail."""

import argparse
import contextlib
import copy
import logging
from types import MethodType

import pytest
import torch
from transformers import HfArgumentParser, Trainer, TrainingArguments

import layerstream
from layerstream import loading
from layerstream.commands import flags
from layerstream.config import StreamConfig, parse_setting
from layerstream.errors import StreamConfigError, StreamingError
from layerstream.long import chunked_loss, tiled_mlp
from layerstream.modules import nf4

from tiny import (
    assert_traces_equal,
    batch,
    corrupt_copies,
    nf4_pair,
    peft_pair,
    portable_cpu_nf4,
    save_tiny,
    scale_mlp_outputs,
    stream,
    tiny_model,
    train_steps,
)

STEPS = 4
SEQ = 24  # 2 x 24 tokens: 10 loss chunks of 5 tokens, 4 MLP tiles of 13
CHUNK, TILE = 5, 13
# chunked against unchunked: the same sums in another order, in fp32 (torch's defaults for fp32)
CLOSE = dict(rtol=1.3e-6, atol=1e-5)


def _assert_close_traces(a, b):
    for step in range(len(a.losses)):
        torch.testing.assert_close(a.losses[step], b.losses[step], **CLOSE)
        for name in a.grads[step]:
            torch.testing.assert_close(a.grads[step][name], b.grads[step][name], **CLOSE)


def _long_pair(stream_embeddings=False, lora=None, chunk=CHUNK, tile=TILE, layers=5, device="cpu"):
    streamed, resident = peft_pair(layers=layers, lora=lora)
    options = {"loss_chunk_tokens": chunk, "mlp_tile_tokens": tile}
    stream(streamed, device, slots=2, prefetch=1, stream_embeddings=stream_embeddings, **options)
    resident.to(device)
    if chunk is not None:
        chunked_loss.apply(resident, chunk)
    if tile is not None:
        tiled_mlp.apply(resident, tile)
    return streamed, resident


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
    streamed, resident = _long_pair(lora=lora, device=device, **options)
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
    streamed, resident = _long_pair()
    runtime = layerstream.get_runtime(streamed)
    corrupt_copies(runtime, lambda layer, slot: runtime.records[0].host_region if layer == 3 else None)
    with pytest.raises(AssertionError):
        assert_traces_equal(train_steps(streamed, STEPS, seq=SEQ), train_steps(resident, STEPS, seq=SEQ))


def test_a_refused_torch_compile_leaves_the_chunked_loss_training_exactly():
    """torch.compile stops at the first streamed layer while it traces the model's forward,
    inside the chunked loss's capture of the head: the capture is undone, so the model then
    trains bit for bit as one never compiled (a capture left on made every later loss read
    empty logits)."""
    streamed, resident = _long_pair(layers=3)
    ids = batch(96, size=2, seq=SEQ)
    with pytest.raises(Exception, match="torch.compile cannot trace a streamed"):
        torch.compile(streamed, backend="eager")(input_ids=ids, labels=ids)
    assert_traces_equal(train_steps(streamed, 2, seq=SEQ), train_steps(resident, 2, seq=SEQ))


def test_the_tiled_backward_reads_the_slot_its_recompute_bound():
    """On the CPU a host weight and its slot copy hold the same values, so read from where
    the tiles' backward takes its frozen weights: the slot memory, never the host store."""
    streamed, _ = _long_pair(chunk=None)
    runtime = layerstream.get_runtime(streamed)
    seen = []
    original = tiled_mlp._plain

    def spy(module, x):
        if torch.is_grad_enabled():
            seen.append(module.gate_proj.base_layer.weight.data_ptr())
        return original(module, x)

    tiled_mlp._plain = spy
    try:
        ids = batch(96, size=2, seq=SEQ)
        streamed(input_ids=ids, labels=ids).loss.backward()
    finally:
        tiled_mlp._plain = original
    slots = [(b.data_ptr(), b.data_ptr() + b.numel() * b.element_size()) for b in runtime.pool.buffers]
    assert len(seen) == 5 * 4, "every layer's four tiles recomputed in backward"
    assert all(any(lo <= ptr < hi for lo, hi in slots) for ptr in seen)


def _tile_calls(model, steps=1) -> dict:
    """How often the tiles ran, by grad mode, over ``steps`` training steps."""
    calls = {"no_grad": 0, "grad": 0}
    original = tiled_mlp._plain

    def counting(module, x):
        calls["grad" if torch.is_grad_enabled() else "no_grad"] += 1
        return original(module, x)

    tiled_mlp._plain = counting
    try:
        train_steps(model, steps, seq=SEQ)
    finally:
        tiled_mlp._plain = original
    return calls


def test_the_recompute_skips_the_tiled_mlp_whose_output_it_discards():
    """Five layers of four tiles: the forward runs each tile once and the backward once; the
    checkpoint's recompute stops before the MLP (its output is not needed), so the MLP's
    forward does not run a third time."""
    streamed, resident = _long_pair(chunk=None)
    assert _tile_calls(streamed) == {"no_grad": 5 * 4, "grad": 5 * 4}


def test_an_op_saving_the_mlp_output_makes_the_recompute_run_the_tiles():
    """Where something after the MLP saves its output, the recompute must compute it: the
    tiles run again there, and the gradients stay equal to the resident model's."""
    streamed, resident = _long_pair(chunk=None)
    for model in (streamed, resident):
        scale_mlp_outputs(model)
    assert _tile_calls(streamed) == {"no_grad": 2 * 5 * 4, "grad": 5 * 4}
    streamed, resident = _long_pair(chunk=None)
    for model in (streamed, resident):
        scale_mlp_outputs(model)
    got, expected = train_steps(streamed, STEPS, seq=SEQ), train_steps(resident, STEPS, seq=SEQ)
    assert any(".out_scale" in name for name in got.grads[0]), "the scale must be trained"
    assert_traces_equal(got, expected)


def test_a_recompute_that_skipped_a_needed_mlp_output_is_caught(monkeypatch):
    """Negative control: a tiled forward that returned zeros inside backward (a recompute
    that skipped the MLP although its output is saved) breaks the parity above."""
    streamed, resident = _long_pair(chunk=None)
    for model in (streamed, resident):
        scale_mlp_outputs(model)
    forward = tiled_mlp.TiledFunction.forward

    def skipping(ctx, x, *args):
        out = forward(ctx, x, *args)
        return torch.zeros_like(out) if torch._C._current_graph_task_id() != -1 else out

    monkeypatch.setattr(tiled_mlp.TiledFunction, "forward", staticmethod(skipping))
    with pytest.raises(AssertionError):
        assert_traces_equal(train_steps(streamed, STEPS, seq=SEQ), train_steps(resident, STEPS, seq=SEQ))


class _MatmulFlops(torch.utils._python_dispatch.TorchDispatchMode):
    """The FLOPs of every matrix product dispatched (torch's own flop formulas)."""

    def __init__(self):
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.utils._pytree import tree_map
        from torch.utils.flop_counter import flop_registry

        out = func(*args, **(kwargs or {}))
        formula = flop_registry.get(func._overloadpacket)
        if formula is not None:
            shapes = tree_map(lambda t: t.shape if isinstance(t, torch.Tensor) else t, args)
            out_shape = tree_map(lambda t: t.shape if isinstance(t, torch.Tensor) else t, out)
            self.flops += formula(*shapes, **(kwargs or {}), out_val=out_shape)
        return out


def _step_flops(model) -> int:
    ids = batch(96, size=2, seq=SEQ)
    with _MatmulFlops() as counted:
        model(input_ids=ids, labels=ids).loss.backward()
    return counted.flops


def test_a_tiled_mlp_step_costs_the_matmul_flops_of_an_untiled_one():
    """Tiles split the MLP's rows, so a step's matrix products add up to the FLOPs of the
    untiled step: the tiles' forward in backward replaces the recompute's, it does not come
    on top (as it did when the recompute ran the MLP too: 20% more here). Within 1%: the
    tiles' forward also runs down_proj's LoRA B product, which the untiled recompute's
    early stop skips (a rank-4 product here, 0.35%)."""
    tiled, _ = _long_pair(tile=TILE)
    untiled, _ = _long_pair(tile=None)
    tiled_flops, untiled_flops = _step_flops(tiled), _step_flops(untiled)
    assert untiled_flops <= tiled_flops < 1.01 * untiled_flops


def test_a_chunked_loss_step_costs_the_matmul_flops_of_an_unchunked_one():
    """The chunks' gradients are taken in the forward, while their logits exist: the head's
    product runs once forward and once for its input's gradient, as without chunks, and
    not a third time in backward."""
    chunked, _ = _long_pair(chunk=CHUNK, tile=None)
    plain, _ = _long_pair(chunk=None, tile=None)
    assert _step_flops(chunked) == _step_flops(plain)


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
    streamed, resident = _long_pair(stream_embeddings=True)
    assert not _differing(_steps_under_copying_hooks(streamed), _steps_under_copying_hooks(resident))
    monkeypatch.setattr(chunked_loss, "_span_graph", contextlib.nullcontext)
    streamed, resident = _long_pair(stream_embeddings=True)
    assert _differing(_steps_under_copying_hooks(streamed), _steps_under_copying_hooks(resident))


def test_the_chunked_loss_takes_no_gradient_under_no_grad():
    """Gradients are taken in the forward only when autograd is on: under no_grad the
    loss runs the head's product once (a Function sees inputs that require grad as
    needing it even then)."""
    head = torch.nn.Linear(32, 96, bias=False)
    hidden = torch.randn(2, SEQ, 32, requires_grad=True)
    labels = batch(96, size=2, seq=SEQ)
    with torch.no_grad(), _MatmulFlops() as counted:
        loss = chunked_loss.causal_lm_loss(head, hidden, labels, CHUNK)
    assert counted.flops == 2 * (2 * SEQ) * 32 * 96, "the head once, over every row (each chunk counts a token)"
    assert not loss.requires_grad


def test_chunked_and_tiled_are_close_to_the_unchunked_model_and_not_equal():
    """Within fp32 rounding of the plain model (CLOSE); and not bit for bit, which shows the
    parity tests above compare something that another reduction order changes."""
    streamed, _ = _long_pair()
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


def test_nf4_tiled_mlp_streamed_matches_resident(tmp_path, monkeypatch):
    """QLoRA: lora.Linear4bit over streamed NF4 weights, tiled, through the checkpoint-visible
    NF4 function (forced), whose saved slot tensors the tiles' backward must be given."""
    streamed, resident = nf4_pair(tmp_path, "llama", layers=5)
    portable_cpu_nf4(resident)
    stream(streamed, "cpu", slots=2, prefetch=1, mlp_tile_tokens=TILE, loss_chunk_tokens=CHUNK)
    tiled_mlp.apply(resident, TILE)
    chunked_loss.apply(resident, CHUNK)
    monkeypatch.setattr(nf4, "fused_kernel_would_run", lambda *a, **k: True)
    assert_traces_equal(train_steps(streamed, STEPS, seq=SEQ), train_steps(resident, STEPS, seq=SEQ))
    assert layerstream.get_runtime(streamed).stats()["nf4_function_calls"] > 0


def _dataset(rows=8, seq=SEQ):
    ids = [batch(96, size=1, seq=seq, seed=i)[0] for i in range(rows)]
    out = []
    for i, row in enumerate(ids):
        labels = row.clone()
        labels[: 3 + i % 5] = -100  # prompts of different lengths: num_items_in_batch matters
        out.append({"input_ids": row, "labels": labels})
    return out


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
    trainer = Trainer(model=model, args=args, train_dataset=_dataset())
    assert trainer.model_accepts_loss_kwargs, "the Trainer must pass num_items_in_batch"
    trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    weights = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return losses, weights


def test_trainer_with_gradient_accumulation_streamed_matches_resident(tmp_path):
    streamed, resident = _long_pair()
    _, plain = peft_pair()
    got, expected = _train(streamed, tmp_path / "s"), _train(resident, tmp_path / "r")
    assert len(got[0]) == 3 and got[0] == expected[0]
    assert all(torch.equal(got[1][n], expected[1][n]) for n in expected[1])
    unchunked = _train(plain, tmp_path / "p")
    assert got[0] == pytest.approx(unchunked[0], rel=1e-5)
    for name, weight in unchunked[1].items():
        torch.testing.assert_close(got[1][name], weight, rtol=1e-4, atol=1e-5)


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
    streamed, _ = _long_pair()
    args = TrainingArguments(output_dir=str(tmp_path), use_liger_kernel=True, use_cpu=True, report_to="none")
    with caplog.at_level(logging.WARNING, logger="layerstream"):
        Trainer(model=streamed, args=args, train_dataset=_dataset())
    assert sum("Liger" in r.message for r in caplog.records) == 1


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


def test_phi3_fused_mlp_tiled_streamed_matches_resident_bit_for_bit(monkeypatch):
    """Phi-3 fuses the gate and up projections (gate_up_proj): its MLP is per token, so it
    tiles like Llama's, streamed and resident alike (LoRA on the fused projection)."""
    streamed, resident = peft_pair("phi3", layers=3, lora={"target_modules": ["gate_up_proj", "down_proj"]})
    stream(streamed, "cpu", mlp_tile_tokens=TILE)
    tiled_mlp.apply(resident, TILE)
    tiles, plain = [], tiled_mlp._plain
    monkeypatch.setattr(
        tiled_mlp, "_plain", lambda module, x: tiles.append(torch.is_grad_enabled()) or plain(module, x)
    )
    got = train_steps(streamed, 2, seq=SEQ)
    assert tiles.count(True) == 2 * 3 * 4, "every layer's four tiles ran in each backward"
    assert_traces_equal(got, train_steps(resident, 2, seq=SEQ))
    runtime = layerstream.get_runtime(streamed)
    corrupt_copies(runtime, lambda layer, slot: runtime.records[0].host_region if layer == 2 else None)
    with pytest.raises(AssertionError):  # negative control: the same comparison sees a wrong layer
        assert_traces_equal(train_steps(streamed, 1, seq=SEQ), train_steps(resident, 1, seq=SEQ))


def test_unstream_takes_the_chunking_off():
    streamed, _ = _long_pair()
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
