"""gpt-oss's MXFP4 experts kept packed (``modules.packed_experts``): the loader keeps the
checkpoint's blocks and scales, streams them, and each experts call dequantises them with
transformers' own arithmetic. The model computes, trains and generates exactly as the model
transformers' dequantising load gives (on a machine without its MXFP4 kernels, as this one),
with more layers than slots; the host store, the copies and the plan hold a quarter of the
bytes."""

import json

import pytest
import torch
from packed_models import LAYERS, ROUTED, dequantised_model, logits_of, lora_step_results, packed_model
from peft import get_peft_model
from transformers import AutoModelForCausalLM, Mxfp4Config

import layerstream
from layerstream.modules import packed_experts
from layerstream.runtime import experts as by_need

from tiny import batch, lora_config, save_mxfp4_gpt_oss


def test_packed_experts_give_the_dequantised_models_logits_and_tokens(checkpoint, device):
    reference, model = dequantised_model(checkpoint, device), packed_model(checkpoint, device)
    runtime = layerstream.get_runtime(model)
    assert len(runtime.records) > runtime.config.slots
    experts = model.model.layers[1].mlp.experts
    assert "gate_up_proj" not in dict(experts.named_parameters())
    assert experts.gate_up_proj_blocks.dtype == torch.uint8
    assert torch.equal(logits_of(model), logits_of(reference))
    assert "gate_up_proj" not in experts.__dict__  # dropped once the call returned
    prompt = batch(96, size=1, seq=6, device=device)
    settings = dict(max_new_tokens=8, do_sample=False, min_new_tokens=8)
    assert torch.equal(model.generate(prompt, **settings), reference.generate(prompt, **settings))
    assert "kept in MXFP4, each call dequantises its experts to bfloat16" in runtime.summary()
    dense = sum(p.numel() * p.element_size() for p in reference.model.layers[0].mlp.experts.parameters())
    assert runtime.records[0].nbytes < dense  # blocks and scales: about a quarter of bf16


def test_a_wrong_dequantisation_is_caught(checkpoint, monkeypatch):
    """Negative control: the two FP4 values of each byte taken in the other order change the
    logits, so the comparisons here can fail."""
    reference = dequantised_model(checkpoint)
    real = packed_experts.dequantise

    def swapped(blocks, scales, *args, **kwargs):
        return real((blocks << 4) | (blocks >> 4), scales, *args, **kwargs)

    model = packed_model(checkpoint)
    monkeypatch.setattr(packed_experts, "dequantise", swapped)
    assert not torch.equal(logits_of(model), logits_of(reference))


@pytest.fixture
def dequantised_rows(monkeypatch):
    """The experts each call of ``packed_experts.dequantise`` dequantised, in order."""
    counts, real = [], packed_experts.dequantise

    def counted(blocks, scales, dtype, rows=None, compact=False):
        counts.append(blocks.shape[0] if rows is None else len(set(rows)))
        return real(blocks, scales, dtype, rows, compact)

    monkeypatch.setattr(packed_experts, "dequantise", counted)
    return counts


def test_short_passes_copy_and_dequantise_only_the_chosen_experts(many_experts, device, monkeypatch, dequantised_rows):
    """A token step of generation copies the packed rows of the experts the router chose,
    dequantises those, and generates the reference's tokens; one chosen expert wrongly
    skipped (the negative control) changes the logits."""
    reference, model = dequantised_model(many_experts, device), packed_model(many_experts, device)
    prompt = batch(96, size=1, seq=3, device=device)
    settings = dict(max_new_tokens=8, do_sample=False, min_new_tokens=8)
    assert torch.equal(model.generate(prompt, **settings), reference.generate(prompt, **settings))
    stats = layerstream.get_runtime(model).stats()
    assert 0 < stats["experts_copied"] < stats["expert_visits"] * ROUTED / 2
    # the 3-token prompt's chosen (at most 6), then each token step's (at most 2), never all 16
    assert max(dequantised_rows) <= 3 * 2 and min(dequantised_rows) <= 2
    one_token = batch(96, size=1, seq=1, device=device)
    runs = by_need.decide.runs
    monkeypatch.setattr(by_need.decide, "runs", lambda rows: runs(rows)[1:])  # a chosen expert's copy skipped
    with torch.no_grad():
        assert not torch.equal(
            packed_model(many_experts, device)(input_ids=one_token).logits, reference(input_ids=one_token).logits
        )
    monkeypatch.setattr(by_need.decide, "runs", runs)
    chosen = by_need._chosen_rows
    monkeypatch.setattr(by_need, "_chosen_rows", lambda *a: chosen(*a)[1:])  # left out of the rows as well
    # it has no place in the call's stacks: the CPU's indexing refuses it; CUDA's grouped
    # kernels count no tokens for it, so its share is missing from the logits
    with torch.no_grad():
        try:
            skipped = packed_model(many_experts, device)(input_ids=one_token).logits
        except IndexError:
            assert device == "cpu"
        else:
            assert not torch.equal(skipped, reference(input_ids=one_token).logits)


@pytest.mark.parametrize("implementation", ["eager", "grouped_mm", "batched_mm"])
def test_a_call_of_a_few_experts_computes_on_stacks_of_only_theirs(many_experts, implementation, device, monkeypatch):
    """A short pass's experts call dequantises only the chosen experts' rows, into stacks of
    just those (not 16 experts' with most rows unread), and its forward reads them by their
    places there: each of transformers' implementations gives the reference's logits and
    tokens. Hooks on the module see the router's own numbers. Negative control: the chosen
    experts' rows placed in the wrong order change the logits."""
    reference = AutoModelForCausalLM.from_pretrained(
        many_experts,
        dtype=torch.bfloat16,
        quantization_config=Mxfp4Config(dequantize=True),
        experts_implementation=implementation,
    ).to(device)
    stream = layerstream.StreamConfig(device=device, slots=2)
    model = layerstream.from_pretrained(
        many_experts, dtype=torch.bfloat16, stream=stream, experts_implementation=implementation
    ).to(device)
    assert model.config._experts_implementation == implementation
    stacks, real = [], packed_experts.dequantise

    def recorded(*args, **kwargs):
        out = real(*args, **kwargs)
        stacks.append(out.shape[0])
        return out

    monkeypatch.setattr(packed_experts, "dequantise", recorded)
    seen = {"reference": [], "packed": []}
    for key, each in (("reference", reference), ("packed", model)):
        for layer in each.model.layers:
            layer.mlp.experts.register_forward_hook(lambda m, args, out, key=key: seen[key].append(args[1].clone()))
    prompt = batch(96, size=2, seq=2, device=device)
    settings = dict(max_new_tokens=6, do_sample=False, min_new_tokens=6)
    assert torch.equal(model.generate(prompt, **settings), reference.generate(prompt, **settings))
    assert stacks and max(stacks) <= 2 * 2 * 2 < ROUTED  # 2 rows of 2 tokens, 2 experts each
    assert len(seen["packed"]) == len(seen["reference"])
    assert all(torch.equal(a, b) for a, b in zip(seen["packed"], seen["reference"]))
    assert model.model.layers[0].mlp.experts.num_experts == ROUTED  # given back after each call

    def reversed_rows(*args, **kwargs):
        out = real(*args, **kwargs)
        return out.flip(0) if kwargs.get("compact") else out

    monkeypatch.setattr(packed_experts, "dequantise", reversed_rows)
    one_token = batch(96, size=2, seq=1, device=device)
    with torch.no_grad():
        assert not torch.equal(model(input_ids=one_token).logits, reference(input_ids=one_token).logits)


@pytest.mark.parametrize("first, between", [(12, 1), (2, 12)], ids=["long-then-short", "short-then-long"])
def test_a_pass_of_another_size_between_a_forward_and_its_backward_changes_nothing(many_experts, first, between):
    """A layer's recompute in backward decides from its own tokens whether it reads only the
    chosen experts, not from the pass that ran last: it dequantises the stacks its forward did
    (with grouped_mm, which keeps the stacks it computed on, a stack of another size would
    fail the recompute's check), and the loss and every gradient are the reference's."""

    def step(model):
        torch.manual_seed(0)
        peft = get_peft_model(model, lora_config(target_modules=["q_proj", "v_proj"]))
        peft.train()
        ids, other = batch(96, size=2, seq=first), batch(96, size=1, seq=between, seed=2)
        loss = peft(input_ids=ids, labels=ids).loss
        with torch.no_grad():
            peft(input_ids=other)
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in peft.named_parameters() if p.requires_grad}

    reference_loss, reference_grads = step(dequantised_model(many_experts))
    model = packed_model(many_experts)
    assert model.config._experts_implementation == "grouped_mm"
    loss, grads = step(model)
    assert torch.equal(loss, reference_loss) and grads.keys() == reference_grads.keys()
    assert all(torch.equal(grads[name], reference_grads[name]) for name in grads)


def test_window_layers_dequantise_only_the_chosen_experts_too(many_experts, dequantised_rows):
    """Layers kept on the device for good hold whole stacks, yet a short pass's call still
    reads only the chosen experts: it dequantises only theirs, and generates the same tokens."""
    reference, model = dequantised_model(many_experts), packed_model(many_experts)
    layerstream.get_runtime(model).set_window(range(LAYERS))
    prompt, settings = batch(96, size=1, seq=3), dict(max_new_tokens=6, do_sample=False, min_new_tokens=6)
    assert torch.equal(model.generate(prompt, **settings), reference.generate(prompt, **settings))
    assert layerstream.get_runtime(model).stats()["experts_copied"] == 0
    assert dequantised_rows and max(dequantised_rows) <= 3 * 2


def test_training_with_packed_experts_equals_training_the_dequantised_model(checkpoint, device):
    reference_losses, reference_grads = lora_step_results(dequantised_model(checkpoint, device))
    losses, grads = lora_step_results(packed_model(checkpoint, device))
    assert [float(x) for x in losses] == [float(x) for x in reference_losses]
    for ours, theirs in zip(grads, reference_grads):
        assert ours.keys() == theirs.keys() and len(ours) == 4 * 2 * LAYERS
        assert all(torch.equal(ours[name], theirs[name]) for name in theirs)


def test_training_on_short_rows_copies_by_need_and_equals_the_dequantised_model(many_experts):
    reference_losses, reference_grads = lora_step_results(dequantised_model(many_experts), size=1, seq=2)
    model = packed_model(many_experts)
    losses, grads = lora_step_results(model, size=1, seq=2)
    stats = layerstream.get_runtime(model).stats()
    assert 0 < stats["experts_copied"] < stats["expert_visits"] * ROUTED / 2
    assert [float(x) for x in losses] == [float(x) for x in reference_losses]
    for ours, theirs in zip(grads, reference_grads):
        assert all(torch.equal(ours[name], theirs[name]) for name in theirs)


def test_the_dequantised_stacks_leave_the_module_even_when_its_call_fails(checkpoint):
    experts = packed_model(checkpoint).model.layers[0].mlp.experts
    hidden = torch.zeros(2, 64, dtype=torch.bfloat16)
    with pytest.raises(IndexError):  # two tokens, routing for three
        experts(hidden, torch.zeros(3, 2, dtype=torch.long), torch.ones(3, 2, dtype=torch.bfloat16))
    assert "gate_up_proj" not in experts.__dict__ and "down_proj" not in experts.__dict__
    assert experts(hidden, torch.zeros(2, 2, dtype=torch.long), torch.ones(2, 2, dtype=torch.bfloat16)).shape == (2, 64)


@pytest.mark.parametrize("marked", [True, False], ids=["observing", "unmarked"])
def test_a_hook_that_only_observes_the_routing_leaves_copies_by_need_on(many_experts, marked):
    """A hook added after the model's own that says it only reads the routing
    (``_layerstream_keeps_choice``, as the MoE benchmark's does) keeps copies by need; any other
    may change the choice, so every row is copied and dequantised (the control)."""
    reference, model = dequantised_model(many_experts), packed_model(many_experts)

    def observe(module, args):
        return None

    if marked:
        observe._layerstream_keeps_choice = True
    for layer in model.model.layers:
        layer.mlp.experts.register_forward_pre_hook(observe)
    prompt, settings = batch(96, size=1, seq=3), dict(max_new_tokens=4, do_sample=False, min_new_tokens=4)
    assert torch.equal(model.generate(prompt, **settings), reference.generate(prompt, **settings))
    stats = layerstream.get_runtime(model).stats()
    by_need = stats["experts_copied"] < stats["expert_visits"] * ROUTED / 2
    assert by_need is marked


def test_trls_sft_script_trains_the_packed_model_as_the_plain_script_trains_the_dequantised_one(
    tmp_path, monkeypatch, caplog
):
    """TRL's ``sft.py`` unchanged on a gpt-oss MXFP4 checkpoint, plainly (transformers
    dequantises) and behind ``layerstream run`` (experts kept packed, 3 layers in 2 slots):
    the same losses, with TRL's LoRA dropout and gradient checkpointing."""
    import runpy
    import sys

    from layerstream import data as embedded
    from layerstream.commands import cli
    from layerstream.integrations import launch

    tokenizer = embedded.byte_tokenizer()
    checkpoint = save_mxfp4_gpt_oss(tmp_path / "gpt-oss", layers=LAYERS, vocab_size=len(tokenizer))
    tokenizer.save_pretrained(checkpoint)
    rows = [json.loads(line) for line in embedded.data_path().read_text().splitlines() if line.strip()][:24]
    (tmp_path / "sft").mkdir()
    (tmp_path / "sft" / "train.jsonl").write_text(
        "".join(json.dumps({"text": f"Q: {r['instruction']}\nA: {r['response']}"}) + "\n" for r in rows)
    )

    def argv(out):
        return [
            *("--model_name_or_path", str(checkpoint), "--dataset_name", str(tmp_path / "sft")),
            *("--output_dir", str(out), "--max_steps", "3", "--logging_steps", "1", "--report_to", "none"),
            *("--use_cpu", "--per_device_train_batch_size", "2", "--save_strategy", "steps", "--save_steps", "3"),
            "--use_peft",
            *("--lora_r", "4", "--lora_target_modules", "q_proj", "k_proj", "v_proj", "o_proj"),
            *("--max_length", "32", "--seed", "0", "--dtype", "bfloat16"),
        ]

    histories = {}
    for run in ("plain", "streamed"):
        if run == "plain":
            monkeypatch.setattr(sys, "argv", ["trl.scripts.sft", *argv(tmp_path / run)])
            runpy.run_module("trl.scripts.sft", run_name="__main__", alter_sys=True)
        else:
            try:
                with caplog.at_level("WARNING", logger="layerstream"):
                    assert cli.main(["run", "--slots", "2", "-m", "trl.scripts.sft", *argv(tmp_path / run)]) == 0
            finally:
                launch.disable()
            assert "they stay so in host memory" in caplog.text  # packed, not dequantised
        state = tmp_path / run / "checkpoint-3" / "trainer_state.json"
        histories[run] = [e for e in json.loads(state.read_text())["log_history"] if "loss" in e]
    plain, streamed = ([e["loss"] for e in histories[run]] for run in ("plain", "streamed"))
    assert len(plain) == 3 and streamed == plain
    assert all("layerstream/layer_loads" in e for e in histories["streamed"])  # it streamed
