"""gpt-oss's MXFP4 experts kept packed (``modules.packed_experts``): the loader keeps the
checkpoint's blocks and scales, streams them, and each experts call dequantises them with
transformers' own arithmetic. The model computes, trains and generates exactly as the model
transformers' dequantising load gives (on a machine without its MXFP4 kernels, as this one),
with more layers than slots; the host store, the copies and the plan hold a quarter of the
bytes."""

import copy
import json
from pathlib import Path

import pytest
import torch
from peft import get_peft_model
from transformers import AutoModelForCausalLM, Mxfp4Config
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

import layerstream
from layerstream import plan
from layerstream.checkpoints import mxfp4
from layerstream.modules import packed_experts
from layerstream.runtime import experts as by_need

from tiny import batch, lora_config, save_mxfp4_gpt_oss

LAYERS, ROUTED = 3, 16
CPU = layerstream.StreamConfig(device="cpu", slots=2)
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_mxfp4_gpt_oss(tmp_path_factory.mktemp("packed") / "gpt-oss", layers=LAYERS)


@pytest.fixture(scope="module")
def many_experts(tmp_path_factory):
    """16 experts, 2 a token: a pass of a few tokens copies by need."""
    return save_mxfp4_gpt_oss(tmp_path_factory.mktemp("routed") / "gpt-oss", layers=LAYERS, experts=ROUTED)


def _dequantised(checkpoint, device="cpu"):
    """The reference: transformers' own load, dequantising MXFP4 to bf16 (as it does without
    its kernels; asked explicitly, so a GPU machine with Triton does the same)."""
    dequantise = Mxfp4Config(dequantize=True)
    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16, quantization_config=dequantise).to(
        device
    )


def _packed(checkpoint, device="cpu"):
    stream = layerstream.StreamConfig(device=device, slots=2)
    return layerstream.from_pretrained(checkpoint, dtype=torch.bfloat16, stream=stream).to(device)


def _logits(model):
    with torch.no_grad():
        return model(input_ids=batch(96, seq=12, device=model.device)).logits


def test_packed_experts_give_the_dequantised_models_logits_and_tokens(checkpoint, device):
    reference, model = _dequantised(checkpoint, device), _packed(checkpoint, device)
    runtime = layerstream.get_runtime(model)
    assert len(runtime.records) > runtime.config.slots
    experts = model.model.layers[1].mlp.experts
    assert "gate_up_proj" not in dict(experts.named_parameters())
    assert experts.gate_up_proj_blocks.dtype == torch.uint8
    assert torch.equal(_logits(model), _logits(reference))
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
    reference = _dequantised(checkpoint)
    real = packed_experts.dequantise

    def swapped(blocks, scales, *args, **kwargs):
        return real((blocks << 4) | (blocks >> 4), scales, *args, **kwargs)

    model = _packed(checkpoint)
    monkeypatch.setattr(packed_experts, "dequantise", swapped)
    assert not torch.equal(_logits(model), _logits(reference))


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
    reference, model = _dequantised(many_experts, device), _packed(many_experts, device)
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
            _packed(many_experts, device)(input_ids=one_token).logits, reference(input_ids=one_token).logits
        )
    monkeypatch.setattr(by_need.decide, "runs", runs)
    chosen = by_need._chosen_rows
    monkeypatch.setattr(by_need, "_chosen_rows", lambda *a: chosen(*a)[1:])  # left out of the rows as well
    # it has no place in the call's stacks: the CPU's indexing refuses it; CUDA's grouped
    # kernels count no tokens for it, so its share is missing from the logits
    with torch.no_grad():
        try:
            skipped = _packed(many_experts, device)(input_ids=one_token).logits
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

    reference_loss, reference_grads = step(_dequantised(many_experts))
    model = _packed(many_experts)
    assert model.config._experts_implementation == "grouped_mm"
    loss, grads = step(model)
    assert torch.equal(loss, reference_loss) and grads.keys() == reference_grads.keys()
    assert all(torch.equal(grads[name], reference_grads[name]) for name in grads)


def test_window_layers_dequantise_only_the_chosen_experts_too(many_experts, dequantised_rows):
    """Layers kept on the device for good hold whole stacks, yet a short pass's call still
    reads only the chosen experts: it dequantises only theirs, and generates the same tokens."""
    reference, model = _dequantised(many_experts), _packed(many_experts)
    layerstream.get_runtime(model).set_window(range(LAYERS))
    prompt, settings = batch(96, size=1, seq=3), dict(max_new_tokens=6, do_sample=False, min_new_tokens=6)
    assert torch.equal(model.generate(prompt, **settings), reference.generate(prompt, **settings))
    assert layerstream.get_runtime(model).stats()["experts_copied"] == 0
    assert dequantised_rows and max(dequantised_rows) <= 3 * 2


def _lora_step_results(model, steps: int = 2, size: int = 2, seq: int = 12, config=None):
    """Losses and every LoRA gradient of a few AdamW steps of attention LoRA (non-zero B,
    TRL's default dropout; ``config``: other LoraConfig values), seeded alike."""
    torch.manual_seed(0)
    values = dict(target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], lora_dropout=0.05)
    peft = get_peft_model(model, lora_config(**{**values, **(config or {})}))
    peft.train()
    optimizer = torch.optim.AdamW([p for p in peft.parameters() if p.requires_grad], lr=1e-2)
    ids = batch(96, size=size, seq=seq, device=peft.device)
    losses, grads = [], []
    torch.manual_seed(1)
    for _ in range(steps):
        loss = peft(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad.clone() for n, p in peft.named_parameters() if p.requires_grad})
        optimizer.step()
        optimizer.zero_grad()
    return losses, grads


def test_training_with_packed_experts_equals_training_the_dequantised_model(checkpoint, device):
    reference_losses, reference_grads = _lora_step_results(_dequantised(checkpoint, device))
    losses, grads = _lora_step_results(_packed(checkpoint, device))
    assert [float(x) for x in losses] == [float(x) for x in reference_losses]
    for ours, theirs in zip(grads, reference_grads):
        assert ours.keys() == theirs.keys() and len(ours) == 4 * 2 * LAYERS
        assert all(torch.equal(ours[name], theirs[name]) for name in theirs)


def test_training_on_short_rows_copies_by_need_and_equals_the_dequantised_model(many_experts):
    reference_losses, reference_grads = _lora_step_results(_dequantised(many_experts), size=1, seq=2)
    model = _packed(many_experts)
    losses, grads = _lora_step_results(model, size=1, seq=2)
    stats = layerstream.get_runtime(model).stats()
    assert 0 < stats["experts_copied"] < stats["expert_visits"] * ROUTED / 2
    assert [float(x) for x in losses] == [float(x) for x in reference_losses]
    for ours, theirs in zip(grads, reference_grads):
        assert all(torch.equal(ours[name], theirs[name]) for name in theirs)


def test_the_dequantised_stacks_leave_the_module_even_when_its_call_fails(checkpoint):
    experts = _packed(checkpoint).model.layers[0].mlp.experts
    hidden = torch.zeros(2, 64, dtype=torch.bfloat16)
    with pytest.raises(IndexError):  # two tokens, routing for three
        experts(hidden, torch.zeros(3, 2, dtype=torch.long), torch.ones(3, 2, dtype=torch.bfloat16))
    assert "gate_up_proj" not in experts.__dict__ and "down_proj" not in experts.__dict__
    assert experts(hidden, torch.zeros(2, 2, dtype=torch.long), torch.ones(2, 2, dtype=torch.bfloat16)).shape == (2, 64)


def test_dequantising_a_group_of_experts_at_a_time_gives_transformers_whole_result(monkeypatch):
    generator = torch.Generator().manual_seed(3)
    blocks = torch.randint(0, 256, (5, 64, 2, 16), dtype=torch.uint8, generator=generator)
    scales = torch.randint(118, 132, (5, 64, 2), dtype=torch.uint8, generator=generator)
    whole = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)
    monkeypatch.setattr(packed_experts, "GROUP_BYTES", 2 * 64 * 64 * 2)  # two experts a group
    assert torch.equal(packed_experts.dequantise(blocks, scales, torch.bfloat16), whole)
    assert not torch.equal(packed_experts.dequantise(blocks, scales.flip(0), torch.bfloat16), whole)


def test_the_plan_sizes_packed_layers_as_the_store_holds_them(checkpoint):
    model = _packed(checkpoint)
    stored = [record.nbytes for record in layerstream.get_runtime(model).records]
    assert plan.layer_bytes(model.config, "none", torch.bfloat16) == stored
    shape = plan.layer_shapes(model.config)[0]
    assert shape.dequantised == packed_experts.dequantised_bytes(model) > 0
    assert {p.name for p in shape.params} >= {"mlp.experts.gate_up_proj", "mlp.experts.down_proj"}
    assert shape.sparse  # still a mixture of experts to the plan


def test_the_decode_plan_counts_packed_experts_at_their_packed_bytes(checkpoint):
    from layerstream.plan.decode import decode_term, routed_bytes

    model = _packed(checkpoint)
    record = layerstream.get_runtime(model).records[0]
    packed = sum(e.nbytes for e in record.entries if e.name.endswith(("_blocks", "_scales")))
    shapes = plan.layer_shapes(model.config)
    assert routed_bytes(shapes, 2)[0] == (packed, 2, 4)
    term = decode_term(plan.layer_bytes(model.config, "none"), 2, 55.0, 0, routed=routed_bytes(shapes, 2))
    assert 0 < term.copy_bytes <= sum(r.nbytes for r in layerstream.get_runtime(model).records)


def test_the_plan_of_gpt_oss_as_published_keeps_its_experts_packed():
    """gpt-oss-120b's config as published (quant_method "mxfp4"): the plan's layers are the
    files' bytes, not bf16's (5.9 GiB a layer), unless the config asks to dequantise."""
    from transformers import AutoConfig

    raw = json.loads((ROOT / "configs" / "shapes" / "gpt-oss-120b.json").read_text())
    raw.setdefault("quantization_config", {"quant_method": "mxfp4"})
    config = AutoConfig.for_model(**raw)
    packed = max(plan.layer_bytes(config, "none", torch.bfloat16))
    config.quantization_config = {**config.quantization_config, "dequantize": True}
    dequantised = max(plan.layer_bytes(config, "none", torch.bfloat16))
    assert 1.5 * 2**30 < packed < 1.7 * 2**30 < 5.8 * 2**30 < dequantised


def test_the_disk_tier_reads_packed_layers_straight_from_the_files(checkpoint):
    reference = _dequantised(checkpoint)
    stream = layerstream.StreamConfig(device="cpu", slots=2, host_budget="200KiB")
    model = layerstream.from_pretrained(checkpoint, dtype=torch.bfloat16, stream=stream)
    assert layerstream.get_runtime(model).disk is not None
    assert torch.equal(_logits(model), _logits(reference))


def test_nf4_with_packed_experts_reads_its_disk_layers_from_the_layer_cache(checkpoint, tmp_path):
    """QLoRA of gpt-oss with a host budget: the attention in NF4, the experts packed, the layers
    beyond the budget written once to the NF4 layer cache and read from there: the same logits
    as with every layer in host RAM."""
    in_ram = layerstream.from_pretrained(checkpoint, quantization="nf4", dtype=torch.bfloat16, stream=CPU)
    stream = layerstream.StreamConfig(device="cpu", slots=2, host_budget="200KiB", disk_cache_dir=str(tmp_path))
    for _ in range(2):  # written, then read back
        model = layerstream.from_pretrained(checkpoint, quantization="nf4", dtype=torch.bfloat16, stream=stream)
        assert layerstream.get_runtime(model).disk is not None
        assert torch.equal(_logits(model), _logits(in_ram))
    assert any(tmp_path.rglob("*")), "the layer cache was written"


def test_save_pretrained_writes_a_checkpoint_that_loads_back_packed_or_dequantised(checkpoint, tmp_path):
    """The saved checkpoint is gpt-oss's format: blocks, scales and an MXFP4 quantization_config,
    so transformers (dequantising) and layerstream (packed) both load the same model back."""
    reference, model = _dequantised(checkpoint), _packed(checkpoint)
    model.save_pretrained(tmp_path / "saved")
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert saved["quantization_config"]["quant_method"] == "mxfp4" and "layerstream_packed_experts" not in saved
    assert getattr(model.config, "quantization_config", None) is None  # the model's own config as it was
    assert torch.equal(_logits(_dequantised(tmp_path / "saved")), _logits(reference))
    assert torch.equal(_logits(_packed(tmp_path / "saved")), _logits(reference))
    layerstream.unstream_model(model)  # a streamed model refuses to be copied
    twin = copy.deepcopy(model)  # a copy saves itself, not the model it was copied from
    with torch.no_grad():
        twin.model.layers[0].self_attn.q_proj.weight.mul_(2)
    twin.save_pretrained(tmp_path / "twin")
    assert not torch.equal(_logits(_dequantised(tmp_path / "twin")), _logits(reference))


def test_save_pretrained_of_packed_experts_beside_nf4_attention_is_refused(checkpoint, tmp_path):
    model = layerstream.from_pretrained(checkpoint, quantization="nf4", dtype=torch.bfloat16, stream=CPU)
    with pytest.raises(packed_experts.PackedExpertsError, match="Save the adapters"):
        model.save_pretrained(tmp_path / "saved")
    assert not (tmp_path / "saved" / "config.json").exists()


@pytest.mark.parametrize("implementation", ["eager", "grouped_mm"])
def test_a_model_no_longer_streamed_dequantises_to_the_dtype_it_is_cast_to(checkpoint, implementation):
    """After unstream_model a cast is the model's to make: ``float()`` dequantises in float32,
    as the reference's cast bf16 Parameters hold them."""
    reference, model = _dequantised(checkpoint).float(), _packed(checkpoint)
    layerstream.unstream_model(model)
    model.float()
    for each in (reference, model):
        each.set_experts_implementation(implementation)
    assert torch.equal(_logits(model), _logits(reference))


def test_a_float32_model_dequantises_to_the_dtype_this_transformers_gives_its_experts(checkpoint, device, monkeypatch):
    """transformers 5.17's dequantising load gives the experts bfloat16 whatever the model's
    dtype (its ``dequantize_convertops`` takes no dtype); newer releases give them the
    model's. A float32 model keeps its experts packed and dequantises them to the dtype the
    installed transformers gives them, and the older behaviour is staged too, by giving
    transformers' module the older function. Negative control: the model's own dtype under
    the older function changes the logits."""
    from transformers.integrations import mxfp4 as transformers_mxfp4

    def older(blocks, scales, *unused):  # 5.17's: no dtype, so convert_moe_packed_tensors' default
        return torch.nn.Parameter(convert_moe_packed_tensors(blocks, scales))

    stream = layerstream.StreamConfig(device=device, slots=2)
    for staged in (False, True):
        if staged:
            monkeypatch.setattr(transformers_mxfp4, "dequantize_convertops", older)
        reference = AutoModelForCausalLM.from_pretrained(
            checkpoint, dtype=torch.float32, quantization_config=Mxfp4Config(dequantize=True)
        ).to(device)
        given = reference.model.layers[0].mlp.experts.gate_up_proj.dtype
        assert given == torch.bfloat16 or not staged
        model = layerstream.from_pretrained(checkpoint, dtype=torch.float32, stream=stream).to(device)
        assert packed_experts.packed_of(model.model.layers[0].mlp.experts).dtype == given
        assert torch.equal(_logits(model), _logits(reference))
    monkeypatch.setattr(packed_experts, "dequantised_dtype", lambda dtype: dtype)
    model = layerstream.from_pretrained(checkpoint, dtype=torch.float32, stream=stream).to(device)
    assert not torch.equal(_logits(model), _logits(reference))


def test_a_transformers_without_the_dequantising_function_is_said_and_the_load_dtype_kept(monkeypatch, caplog):
    from transformers.integrations import mxfp4 as transformers_mxfp4

    monkeypatch.delattr(transformers_mxfp4, "dequantize_convertops")
    assert packed_experts.dequantised_dtype(torch.float32) == torch.float32
    assert "no mxfp4.dequantize_convertops" in caplog.text


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dequantise_gives_transformers_values_for_every_byte_and_exponent(device, dtype, monkeypatch):
    """layerstream dequantises with transformers' arithmetic but not its function: every one
    of the 256 bytes under every one of the 256 exponents (zeros, subnormals, infinities and
    NaN among them), in groups of two experts, whole, by rows and compacted, equals
    ``convert_moe_packed_tensors``' output bit for bit."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    # 4 experts x 128 outputs x 8 blocks of 16 bytes (256 inputs): block b has exponent b % 256
    # and bytes 16 * (b // 256) + 0..15, so each exponent meets each byte once
    monkeypatch.setattr(packed_experts, "GROUP_BYTES", 2 * 256 * 128 * dtype.itemsize)
    block = torch.arange(4 * 128 * 8)
    scales = (block % 256).to(torch.uint8).view(4, 128, 8).to(device)
    blocks = (16 * (block // 256)[:, None] + torch.arange(16)).to(torch.uint8).view(4, 128, 8, 16).to(device)
    pairs = {(e, v) for e, row in zip(scales.flatten().tolist(), blocks.view(-1, 16).tolist()) for v in row}
    assert len(pairs) == 256 * 256
    reference = convert_moe_packed_tensors(blocks, scales, dtype=dtype)
    ours = packed_experts.dequantise(blocks, scales, dtype)
    assert ours.shape == reference.shape == (4, 256, 128) and ours.dtype == dtype
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    assert torch.equal(ours.view(bits), reference.view(bits))
    rows = [3, 0, 1]
    assert torch.equal(
        packed_experts.dequantise(blocks, scales, dtype, rows)[rows].view(bits), reference[rows].view(bits)
    )
    compact = packed_experts.dequantise(blocks, scales, dtype, rows, compact=True)
    assert torch.equal(compact.view(bits), reference[[0, 1, 3]].view(bits))
    # control: the byte's halves in the other order give other values
    swapped = packed_experts.dequantise((blocks << 4) | (blocks >> 4), scales, dtype)
    assert not torch.equal(swapped.view(bits), reference.view(bits))


def test_dequantise_takes_rows_as_a_router_gives_them_and_refuses_rows_out_of_range():
    """Rows as the router's index tensor gives them (repeated, any shape) count each expert
    once, as the same rows as ints do; an index past the last expert is refused, not read."""
    blocks = torch.randint(0, 256, (4, 8, 2, 16), dtype=torch.uint8)
    scales = torch.randint(120, 134, (4, 8, 2), dtype=torch.uint8)
    as_ints = packed_experts.dequantise(blocks, scales, torch.float32, [1, 3], compact=True)
    as_tensor = packed_experts.dequantise(
        blocks, scales, torch.float32, torch.tensor([[3, 1], [1, 3], [3, 3]]), compact=True
    )
    assert as_tensor.shape == as_ints.shape == (2, 64, 8)
    assert torch.equal(as_tensor, as_ints)
    assert not torch.equal(as_ints[0], as_ints[1])  # control: the two rows differ
    for wrong in ([4], [-1], torch.tensor([0, 7])):
        with pytest.raises(ValueError, match=r"\[0, 4\)"):
            packed_experts.dequantise(blocks, scales, torch.float32, wrong)


@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
def test_a_copy_of_a_model_no_longer_streamed_computes_counts_and_saves_as_its_original(checkpoint, tmp_path, how):
    """The packed experts' forward, ``num_parameters`` and ``save_pretrained`` are set on the
    objects themselves: a deep copy or a pickled and loaded copy has them, bound to itself
    (the copy's experts dequantise the copy's blocks), and gives the reference's logits."""
    reference, model = _dequantised(checkpoint), _packed(checkpoint)
    layerstream.unstream_model(model)
    if how == "deepcopy":
        again = copy.deepcopy(model)
    else:
        torch.save(model, tmp_path / "model.pt")
        again = torch.load(tmp_path / "model.pt", weights_only=False)
    experts = again.model.layers[0].mlp.experts
    assert experts.forward.owner is experts and again.save_pretrained.owner is again
    assert torch.equal(_logits(again), _logits(reference))
    assert again.num_parameters() == reference.num_parameters()
    with torch.no_grad():
        experts.gate_up_proj_scales.add_(1)  # the copy's own blocks: the original is untouched
    assert not torch.equal(_logits(again), _logits(reference)) and torch.equal(_logits(model), _logits(reference))
    again.save_pretrained(tmp_path / "saved")
    assert (
        json.loads((tmp_path / "saved" / "config.json").read_text())["quantization_config"]["quant_method"] == "mxfp4"
    )


@pytest.mark.parametrize("strict", [True, False])
def test_a_dequantised_state_dict_is_refused_before_anything_loads(checkpoint, strict):
    """The dequantised model's state dict names expert stacks this model keeps packed: torch
    would load every other tensor, then raise for them (or, not strict, skip them without a
    word). Refused first, with what to load; the model computes as before. Control: the
    model's own state dict, with one attention weight changed, loads and is used."""
    reference, model = _dequantised(checkpoint), _packed(checkpoint)
    state = {name: value + 1 if value.is_floating_point() else value for name, value in reference.state_dict().items()}
    before = _logits(model)
    with pytest.raises(packed_experts.PackedExpertsError, match=r"nothing was loaded.*Mxfp4Config\(dequantize=True\)"):
        model.load_state_dict(state, strict=strict)
    assert torch.equal(_logits(model), before)
    own = model.state_dict()
    own["model.layers.1.self_attn.q_proj.weight"] = own["model.layers.1.self_attn.q_proj.weight"] * 2
    model.load_state_dict(own, strict=strict)
    assert not torch.equal(_logits(model), before)


def test_the_parameter_count_is_the_dequantised_models(checkpoint):
    """``num_parameters`` (and with it the Trainer's ``total_flos``) and PEFT's own count count
    what the packed stacks stand for, as transformers' dequantised model counts its
    Parameters; trainable ones after PEFT alike. Control: the class's own count, which misses
    the experts."""
    reference, model = _dequantised(checkpoint), _packed(checkpoint)
    for kwargs in ({}, {"exclude_embeddings": True}):
        assert model.num_parameters(**kwargs) == reference.num_parameters(**kwargs)
    assert type(model).num_parameters(model) < reference.num_parameters()
    config = lora_config(target_modules=["q_proj", "v_proj"])
    peft, plain = get_peft_model(model, config), get_peft_model(reference, copy.deepcopy(config))
    assert peft.num_parameters(only_trainable=True) == plain.num_parameters(only_trainable=True) > 0
    # what the Trainer's floating_point_ops reads, through PEFT's model
    assert peft.num_parameters(exclude_embeddings=True) == plain.num_parameters(exclude_embeddings=True)
    # what PEFT's print_trainable_parameters prints
    assert peft.get_nb_trainable_parameters() == plain.get_nb_trainable_parameters()


def test_adapters_aimed_at_packed_experts_are_refused_with_what_to_load(checkpoint, monkeypatch):
    """Refused as PEFT is asked; and, should an adapter get there another way (here: that
    check bypassed), at the first forward, before it computes."""
    from peft import LoraConfig

    from layerstream.integrations import peft as peft_integration

    aimed = LoraConfig(r=4, target_modules=["q_proj"], target_parameters=["mlp.experts.gate_up_proj"])
    with pytest.raises(packed_experts.PackedExpertsError, match=r"Mxfp4Config\(dequantize=True\)"):
        get_peft_model(_packed(checkpoint), copy.deepcopy(aimed))
    monkeypatch.setattr(peft_integration, "refuse_untrainable_targets", lambda *args: None)
    peft = get_peft_model(_packed(checkpoint), aimed)
    with pytest.raises(packed_experts.PackedExpertsError, match=r"Mxfp4Config\(dequantize=True\)"):
        _logits(peft)
    attention_only = get_peft_model(_packed(checkpoint), LoraConfig(r=4, target_modules=["q_proj"]))
    assert _logits(attention_only).isfinite().all()  # the control: attention adapters compute


@pytest.mark.parametrize(
    "config",
    [
        dict(target_modules=[], target_parameters=["mlp.experts.gate_up_proj"]),
        dict(target_modules=["q_proj"], modules_to_save=["experts"]),
        dict(target_modules=["q_proj"], modules_to_save=["mlp"]),
    ],
    ids=["experts-only-target-parameters", "modules-to-save-experts", "modules-to-save-their-mlp"],
)
@pytest.mark.parametrize("streamed", [True, False], ids=["streamed", "no-longer-streamed"])
def test_a_peft_config_that_would_train_packed_stacks_is_refused_before_peft_changes_the_model(
    checkpoint, config, streamed
):
    """What would leave the packed stacks untrained (PEFT finds no Parameter to adapt; its
    modules_to_save copy has only biases to train) is refused as PEFT is asked, streamed or
    after ``unstream_model``, with what to load, and the model is as it was. Control: the
    router in modules_to_save trains, as on the dequantised model."""
    model = _packed(checkpoint)
    if not streamed:
        layerstream.unstream_model(model)
    modules, before = {name for name, _ in model.named_modules()}, _logits(model)
    match = "Mxfp4Config" if streamed is False or "target_parameters" in config else "modules_to_save"
    with pytest.raises((packed_experts.PackedExpertsError, layerstream.StreamingError), match=match):
        get_peft_model(model, lora_config(**config))
    assert {name for name, _ in model.named_modules()} == modules and torch.equal(_logits(model), before)
    if not streamed:
        reference = _dequantised(checkpoint)
        router = dict(target_modules=["q_proj"], modules_to_save=["router"])
        losses, grads = _lora_step_results(model, config=router)
        reference_losses, reference_grads = _lora_step_results(reference, config=router)
        assert [float(x) for x in losses] == [float(x) for x in reference_losses]
        assert any("router" in name for name in grads[0])
        assert all(torch.equal(grads[0][name], reference_grads[0][name]) for name in reference_grads[0])


def test_the_plan_holds_dequantised_experts_for_transformers_own_load(checkpoint):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(checkpoint)  # names MXFP4, as published
    request = plan.PlanRequest(config, 12, 1, 8 << 30, "none")
    memory = plan.make_plan(request)
    dequantised = plan.layer_bytes(mxfp4.dequantised_config(config), "none")
    assert memory.host_steady_bytes == sum(dequantised) and memory.loader_store_bytes < sum(dequantised)
    assert memory.host_store_bytes == sum(plan.layer_bytes(config, "none")) < sum(dequantised)


@pytest.mark.parametrize("marked", [True, False], ids=["observing", "unmarked"])
def test_a_hook_that_only_observes_the_routing_leaves_copies_by_need_on(many_experts, marked):
    """A hook added after the model's own that says it only reads the routing
    (``_layerstream_keeps_choice``, as the MoE benchmark's does) keeps copies by need; any other
    may change the choice, so every row is copied and dequantised (the control)."""
    reference, model = _dequantised(many_experts), _packed(many_experts)

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


def test_the_plan_says_why_packed_experts_take_no_lora(checkpoint):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(checkpoint)
    with pytest.raises(ValueError, match="stay packed in MXFP4"):
        plan.make_plan(plan.PlanRequest(config, 12, 1, 8 << 30, "none", lora_targets="q_proj,gate_up_proj"))
    dequantised = mxfp4.dequantised_config(config)  # the control: the reason is the packing's alone
    with pytest.raises(ValueError, match="matches nothing") as refused:
        plan.make_plan(plan.PlanRequest(dequantised, 12, 1, 8 << 30, "none", lora_targets="q_proj,gate_up_proj"))
    assert "stay packed" not in str(refused.value)
