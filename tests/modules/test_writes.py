"""Changes to streamed weights after streaming: whatever way they are made, the next
forward computes with them exactly as the resident model does, or they are refused
before anything is computed from stale device copies."""

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model

import layerstream
from layerstream.modules import swap

from tiny import (
    assert_traces_equal,
    batch,
    lora_config,
    peft_pair,
    portable_cpu_nf4,
    save_tiny,
    stream,
    tiny_model,
    train_steps,
)


def _streamed(layers=5, slots=2, window=None, device="cpu", **pair):
    streamed, resident = peft_pair("llama", layers=layers, **pair)
    stream(streamed, device, slots=slots, prefetch=1)
    resident.to(device)
    if window is not None:
        layerstream.get_runtime(streamed).set_window(window)
    return streamed, resident


def _weight(model, layer, name="self_attn.q_proj.base_layer.weight"):
    return model.get_parameter(f"base_model.model.model.layers.{layer}.{name}")


def _logits(model, device="cpu"):
    ids = batch(96, device=device)
    with torch.no_grad():
        return model(input_ids=ids).logits


# where a changed layer's device copy can be when the change is made: still in a slot after
# the step (layers 0 and 1 with 2 slots), in the resident window, streamed (not held), or
# every layer held because there are no more layers than slots
PLACES = [
    pytest.param(dict(), 0, id="in-a-slot"),
    pytest.param(dict(window=[2]), 2, id="in-the-window"),
    pytest.param(dict(), 3, id="not-held"),
    pytest.param(dict(layers=3, slots=3), 1, id="layers-le-slots"),
]


def _same_change(streamed, resident, change):
    for model in (streamed, resident):
        with torch.no_grad():
            change(model)


@pytest.mark.parametrize("setup,layer", PLACES)
@pytest.mark.parametrize(
    "how", ["in-place", "data-in-place", "load-state-dict", "assign", "data-assign", "swap-tensors", "assign-swapping"]
)
def test_a_change_after_a_step_is_seen_by_the_next_forward(setup, layer, how, device):
    streamed, resident = _streamed(device=device, **setup)
    train_steps(streamed, 1, device), train_steps(resident, 1, device)
    name = f"base_model.model.model.layers.{layer}.self_attn.q_proj.base_layer.weight"
    new = _weight(resident, layer).detach().mul(1.5)

    def change(model):
        weight = model.get_parameter(name)
        if how == "in-place":
            weight.mul_(1.5)
        elif how == "data-in-place":
            weight.data.mul_(1.5)
        elif how == "load-state-dict":
            model.load_state_dict({name: new}, strict=False)
        elif how == "assign":
            model.load_state_dict(
                {name: torch.nn.Parameter(new.clone(), requires_grad=False)}, strict=False, assign=True
            )
        elif how == "swap-tensors":  # the same Parameter object, another tensor under it
            torch.utils.swap_tensors(weight, torch.nn.Parameter(new.clone(), requires_grad=False))
        elif how == "assign-swapping":  # what load_state_dict(assign=True) does under torch's future flag
            torch.__future__.set_swap_module_params_on_conversion(True)
            try:
                model.load_state_dict({name: new.clone()}, strict=False, assign=True)
            finally:
                torch.__future__.set_swap_module_params_on_conversion(False)
        else:
            weight.data = new.clone()

    _same_change(streamed, resident, change)
    assert torch.equal(_logits(streamed, device), _logits(resident, device))
    assert_traces_equal(train_steps(streamed, 2, device), train_steps(resident, 2, device))


def test_a_tensor_swapped_under_a_streamed_weight_is_what_unstream_gives_back():
    streamed, resident = _streamed()
    _logits(streamed)
    new = _weight(resident, 1).detach().mul(1.5)
    for model in (streamed, resident):
        torch.utils.swap_tensors(_weight(model, 1), torch.nn.Parameter(new.clone(), requires_grad=False))
    layerstream.unstream_model(streamed)
    assert torch.equal(_weight(streamed, 1), new)
    assert torch.equal(_logits(streamed), _logits(resident))


def test_the_comparison_catches_a_change_made_to_one_model_only():
    """Negative control: the change above must show in the logits."""
    streamed, resident = _streamed()
    train_steps(streamed, 1), train_steps(resident, 1)
    with torch.no_grad():
        _weight(resident, 0).mul_(1.5)
    assert not torch.equal(_logits(streamed), _logits(resident))


def test_prepare_model_for_kbit_training_after_streaming_gives_the_resident_numbers(tmp_path):
    """PEFT's prepare_model_for_kbit_training casts every weight that is not 4-bit to float32
    with ``param.data = param.data.to(torch.float32)``, the streamed norms included: each
    layer is laid out again in the new dtype (the slots grow if it does) and training matches."""
    from peft import get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    directory = save_tiny(tmp_path / "ckpt", layers=4, dtype=torch.bfloat16, wide=True)
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)

    def load():
        return AutoModelForCausalLM.from_pretrained(
            directory, quantization_config=quant, dtype=torch.bfloat16, device_map="cpu"
        )

    streamed = layerstream.from_pretrained(
        directory,
        quantization_config=quant,
        dtype=torch.bfloat16,
        stream=layerstream.StreamConfig(device="cpu", slots=2),
    )
    runtime = layerstream.get_runtime(streamed)
    assert any("layernorm" in e.qualified_name for e in runtime.records[1].entries), "the loader streams norms"
    streamed = get_peft_model(prepare_model_for_kbit_training(streamed), lora_config())
    resident = get_peft_model(prepare_model_for_kbit_training(portable_cpu_nf4(load())), lora_config())
    resident.load_state_dict({k: v for k, v in streamed.state_dict().items() if "lora_" in k}, strict=False)
    assert_traces_equal(train_steps(streamed, 2), train_steps(resident, 2))
    norm = streamed.get_parameter("base_model.model.model.layers.1.input_layernorm.weight")
    assert norm.dtype == torch.float32 and runtime.stats()["refreshed_layers"] >= 4
    assert {e.dtype for e in runtime.records[1].entries if "layernorm" in e.qualified_name} == {torch.float32}, (
        "the layer streams its norms in the new dtype"
    )


def test_a_change_between_forward_and_backward_is_refused():
    streamed, _ = _streamed()
    ids = batch(96)
    loss = streamed(input_ids=ids, labels=ids).loss
    with torch.no_grad():
        _weight(streamed, 3).mul_(2)
    with pytest.raises(layerstream.StreamingError, match="changed between its forward and its backward"):
        loss.backward()


def test_a_streamed_weight_made_trainable_is_refused_before_a_training_step():
    streamed, _ = _streamed()
    _weight(streamed, 2).requires_grad_(True)
    ids = batch(96)
    with pytest.raises(layerstream.StreamingError, match="requires grad, but streamed weights are frozen"):
        streamed(input_ids=ids, labels=ids)


# -- PEFT merges ---------------------------------------------------------------------------
@pytest.mark.parametrize("safe_merge", [False, True])
def test_merge_and_unload_gives_the_resident_merged_model(safe_merge, device):
    streamed, resident = _streamed(device=device)
    train_steps(streamed, 1, device), train_steps(resident, 1, device)
    merged_streamed = streamed.merge_and_unload(safe_merge=safe_merge)
    merged_resident = resident.merge_and_unload(safe_merge=safe_merge)
    assert layerstream.is_streamed(merged_streamed)
    assert torch.equal(_logits(merged_streamed, device), _logits(merged_resident, device))
    ids = batch(96, size=1, seq=5, device=device)
    kwargs = dict(max_new_tokens=5, do_sample=False, attention_mask=torch.ones_like(ids), pad_token_id=0)
    assert torch.equal(
        merged_streamed.generate(input_ids=ids, **kwargs), merged_resident.generate(input_ids=ids, **kwargs)
    )


def test_merge_adapter_and_unmerge_adapter_match_the_resident_model(device):
    streamed, resident = _streamed(device=device)
    train_steps(streamed, 1, device), train_steps(resident, 1, device)
    for model in (streamed, resident):
        model.merge_adapter()
    assert torch.equal(_logits(streamed, device), _logits(resident, device))
    for model in (streamed, resident):
        model.unmerge_adapter()
    assert torch.equal(_logits(streamed, device), _logits(resident, device))
    assert_traces_equal(train_steps(streamed, 2, device), train_steps(resident, 2, device))


def _magnitudes(model):
    return {n: p.detach().cpu() for n, p in model.named_parameters() if "lora_magnitude_vector" in n}


def test_dora_added_after_streaming_starts_from_the_resident_magnitudes(device):
    """As under ``layerstream run``: the client's get_peft_model meets layers already
    streamed. DoRA's magnitudes (the base rows' norms) must be the ones a resident model
    takes on the same device, and training from there equal bit for bit."""
    base = tiny_model("llama", 5, hidden_size=256, intermediate_size=1024, head_dim=64)
    resident = copy.deepcopy(base).to(device)
    stream(base, device, slots=2, prefetch=1)
    before = {n: p.detach().clone() for n, p in base.named_parameters()}
    torch.manual_seed(0)
    streamed = get_peft_model(base, lora_config(use_dora=True)).to(device)  # non-zero B
    torch.manual_seed(0)
    resident = get_peft_model(resident, lora_config(use_dora=True))
    want, got = _magnitudes(resident), _magnitudes(streamed)
    assert want.keys() == got.keys() and want
    assert all(torch.equal(want[n], got[n]) for n in want), [n for n in want if not torch.equal(want[n], got[n])]
    after = {n.replace("base_model.model.", "").replace(".base_layer", ""): p for n, p in streamed.named_parameters()}
    assert all(torch.equal(before[n].cpu(), after[n].detach().cpu()) for n in before), "the host store changed"
    if device == "cuda":  # the control: the same norms taken on the host differ, so the check can fail
        on_host = {}
        for name, module in resident.named_modules():
            if hasattr(module, "lora_magnitude_vector") and module.lora_magnitude_vector:
                weight = module.get_base_layer().weight.detach().cpu()
                delta = module.lora_B["default"].weight.detach().cpu() @ module.lora_A["default"].weight.detach().cpu()
                norm = torch.linalg.norm(weight + module.scaling["default"] * delta, dim=1)
                on_host[f"{name}.lora_magnitude_vector.default.weight"] = norm
        assert any(not torch.equal(on_host[n], want[n]) for n in want), "host and device norms agree: no control"
    assert_traces_equal(train_steps(streamed, 2, device), train_steps(resident, 2, device))


def test_qlora_dora_added_after_streaming_trains_as_the_resident_model(tmp_path):
    """QLoRA with DoRA as under the launcher (`--load_in_4bit --use_dora`): PEFT deep-copies a
    4-bit base layer to take its norms, which a streamed layer refuses; DoRA's init reads
    the weight alone instead, and training equals the resident QLoRA DoRA model."""
    from transformers import BitsAndBytesConfig

    save_tiny(tmp_path, layers=4, dtype=torch.bfloat16, wide=True)
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)
    from transformers import AutoModelForCausalLM

    resident = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=quant, dtype=torch.bfloat16)
    streamed = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=quant, dtype=torch.bfloat16)
    portable_cpu_nf4(resident), portable_cpu_nf4(streamed)
    stream(streamed, "cpu", slots=2, prefetch=1)
    torch.manual_seed(0)
    streamed = get_peft_model(streamed, lora_config(use_dora=True))
    torch.manual_seed(0)
    resident = get_peft_model(resident, lora_config(use_dora=True))
    want, got = _magnitudes(resident), _magnitudes(streamed)
    assert want and all(torch.equal(want[n], got[n]) for n in want)
    assert_traces_equal(train_steps(streamed, 2), train_steps(resident, 2))


def _lora_after_streaming(device, init):
    base = tiny_model("llama", 5, hidden_size=256, intermediate_size=1024, head_dim=64)
    resident = copy.deepcopy(base).to(device)
    stream(base, device, slots=2, prefetch=1)
    config = dict(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=init)
    torch.manual_seed(0)
    streamed = get_peft_model(base, LoraConfig(**config)).to(device)
    torch.manual_seed(0)
    return streamed, get_peft_model(resident, LoraConfig(**config))


# PiSSA with PEFT's fast SVD (a full SVD of each weight takes about a minute on a GPU here)
@pytest.mark.parametrize("init", ["pissa_niter_4", "olora"])
def test_an_init_that_rewrites_the_base_after_streaming_gives_the_resident_model(device, init, monkeypatch):
    """PiSSA and OLoRA split the base weight into the adapters and a residual left in the
    base layer; on streamed layers they run on device copies, as on a resident model,
    and the residual goes into the host store."""
    streamed, resident = _lora_after_streaming(device, init)
    assert torch.equal(_logits(streamed, device), _logits(resident, device))
    assert_traces_equal(train_steps(streamed, 2, device), train_steps(resident, 2, device))
    if device == "cuda":  # the control: the same init run where the host store is differs
        from peft.tuners.lora.layer import LoraLayer

        method = f"{init.split('_')[0]}_init"
        monkeypatch.setattr(LoraLayer, method, getattr(LoraLayer, method).__wrapped__)
        on_host, resident = _lora_after_streaming(device, init)
        assert not torch.equal(_logits(on_host, device), _logits(resident, device))


def test_a_merge_that_raises_leaves_the_host_store_as_it_was(monkeypatch):
    streamed, resident = _streamed()
    from peft.tuners.lora import layer as lora_layer

    def broken(self, adapter):
        raise RuntimeError("no delta today")

    monkeypatch.setattr(lora_layer.Linear, "get_delta_weight", broken)
    with pytest.raises(RuntimeError, match="no delta today"):
        streamed.merge_adapter()
    monkeypatch.undo()
    assert torch.equal(_logits(streamed), _logits(resident))


def test_nf4_merge_and_unload_gives_the_resident_merged_model(tmp_path):
    from tiny import nf4_pair, portable_cpu_nf4

    streamed, resident = nf4_pair(tmp_path, layers=4)
    stream(streamed, "cpu", slots=2, prefetch=1)
    portable_cpu_nf4(resident)
    with pytest.warns(UserWarning):
        merged_streamed = streamed.merge_and_unload()
    with pytest.warns(UserWarning):
        merged_resident = portable_cpu_nf4(resident.merge_and_unload())
    ids = batch(96)
    with torch.no_grad():
        assert torch.equal(merged_streamed(input_ids=ids).logits, merged_resident(input_ids=ids).logits)


# -- model-level operations ----------------------------------------------------------------
@pytest.mark.parametrize(
    "call",
    [
        lambda m: m.half(),
        lambda m: m.to(torch.bfloat16),
        lambda m: m.double(),
        lambda m: m.to("meta"),
        lambda m: m.float().half(),
    ],
    ids=["half", "to-bf16", "double", "meta", "float-then-half"],
)
def test_a_refused_cast_or_move_changes_nothing(call):
    streamed, resident = _streamed()
    before = {name: (t.dtype, t.device, t.detach().clone()) for name, t in streamed.state_dict().items()}
    with pytest.raises(layerstream.StreamingError, match="Nothing was changed|nothing was changed"):
        call(streamed)
    after = streamed.state_dict()
    for name, (dtype, where, value) in before.items():
        assert after[name].dtype == dtype and after[name].device == where and torch.equal(after[name], value), name
    assert_traces_equal(train_steps(streamed, 2), train_steps(resident, 2))


def test_a_refused_cast_of_an_inner_module_changes_nothing():
    streamed, _ = _streamed()
    inner = streamed.base_model.model.model
    embedding = inner.embed_tokens.weight.detach().clone()
    with pytest.raises(layerstream.StreamingError):
        inner.half()
    assert inner.embed_tokens.weight.dtype == torch.float32 and torch.equal(inner.embed_tokens.weight, embedding)


def test_deepcopy_and_pickle_say_to_unstream_first(tmp_path):
    import copy
    import pickle

    streamed, _ = _streamed()
    for attempt in (
        lambda: copy.deepcopy(streamed),
        lambda: pickle.dumps(streamed),
        lambda: torch.save(streamed, tmp_path / "model.pt"),
    ):
        with pytest.raises(layerstream.StreamingError, match="unstream_model"):
            attempt()
    layerstream.unstream_model(streamed)
    copy.deepcopy(streamed)  # a plain model again


@pytest.mark.parametrize("target", ["post_attention_layernorm", "mlp"])
def test_modules_to_save_inside_a_streamed_layer_is_refused_before_peft_changes_the_model(target):
    """PEFT's modules_to_save makes a trainable copy of each module it names, after its
    adapter layers are in: inside a streamed layer the copy cannot be made, so the config is
    refused first, naming modules_to_save, and the model is as it was (no adapter layer in,
    the same logits). Control: the head, outside the layers, is taken."""
    model = tiny_model("llama", layers=4)
    stream(model, slots=2)
    ids = batch(seq=6)
    before = _logits_of(model, ids)
    modules = {name for name, _ in model.named_modules()}
    config = lora_config(target_modules=["q_proj"], modules_to_save=[target])
    with pytest.raises(
        layerstream.StreamingError, match=rf"modules_to_save='{target}'.*inside the streamed decoder layer"
    ):
        get_peft_model(model, config)
    assert {name for name, _ in model.named_modules()} == modules
    assert torch.equal(_logits_of(model, ids), before)
    peft = get_peft_model(model, lora_config(target_modules=["q_proj"], modules_to_save=["lm_head"]))
    assert any("lm_head.modules_to_save" in name for name, _ in peft.named_parameters())


def test_modules_to_save_naming_a_streamed_head_is_refused_before_peft_changes_the_model():
    """With the embedding and head streamed, the head stays frozen in the host store: PEFT's
    trainable copy of it is refused as PEFT is asked, saying how to train it, and the model
    is as it was."""
    model = tiny_model("llama", layers=4)
    stream(model, slots=2, stream_embeddings=True)
    ids = batch(seq=6)
    before, modules = _logits_of(model, ids), {name for name, _ in model.named_modules()}
    config = lora_config(target_modules=["q_proj"], modules_to_save=["lm_head"])
    with pytest.raises(
        layerstream.StreamingError, match=r"modules_to_save='lm_head'.*stream with stream_embeddings=False"
    ):
        get_peft_model(model, config)
    assert {name for name, _ in model.named_modules()} == modules
    assert torch.equal(_logits_of(model, ids), before)


def _logits_of(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_stream_model_of_something_that_is_not_a_module_says_so():
    with pytest.raises(TypeError, match="takes a torch.nn.Module"):
        layerstream.stream_model({"not": "a model"})


# -- threads --------------------------------------------------------------------------------
def test_a_second_thread_during_a_pass_is_refused_and_the_first_is_exact():
    import threading

    streamed, resident = _streamed()
    inside, go_on = threading.Event(), threading.Event()
    layer = streamed.base_model.model.model.layers[2]

    def hold(module, args):
        if threading.current_thread() is not threading.main_thread():
            inside.set()
            go_on.wait(10)

    handle = layer.register_forward_pre_hook(hold)
    results = {}

    def first():
        results["first"] = _logits(streamed)

    worker = threading.Thread(target=first)
    worker.start()
    assert inside.wait(10)
    with pytest.raises(layerstream.StreamingError, match="in use by another thread"):
        _logits(streamed)
    go_on.set()
    worker.join(10)
    handle.remove()
    assert torch.equal(results["first"], _logits(resident))
    assert torch.equal(_logits(streamed), _logits(resident)), "after the pass, another thread may use it"


def test_a_thread_may_use_the_model_once_a_training_step_has_finished():
    import threading

    streamed, resident = _streamed()
    train_steps(streamed, 1), train_steps(resident, 1)
    out = {}
    worker = threading.Thread(target=lambda: out.setdefault("logits", _logits(streamed)))
    worker.start()
    worker.join(10)
    assert torch.equal(out["logits"], _logits(resident))


# -- unstreaming -----------------------------------------------------------------------------
def test_an_interrupted_unstream_leaves_a_working_streamed_model_and_can_be_finished(monkeypatch):
    from layerstream.tiers.store import HostStore

    streamed, resident = _streamed()
    original, calls = HostStore.copies_out, []

    def interrupted(self, record, device):
        calls.append(record.index)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return original(self, record, device)

    monkeypatch.setattr(HostStore, "copies_out", interrupted)
    with pytest.raises(KeyboardInterrupt):
        layerstream.unstream_model(streamed)
    monkeypatch.undo()
    assert layerstream.is_streamed(streamed)
    assert_traces_equal(train_steps(streamed, 1), train_steps(resident, 1))
    layerstream.unstream_model(streamed)
    assert not layerstream.is_streamed(streamed)
    assert_traces_equal(train_steps(streamed, 1), train_steps(resident, 1))


def _interrupt_call(monkeypatch, owner, name, at):
    """KeyboardInterrupt at the ``at``-th call of ``owner.name`` (before it changes anything)."""
    original, calls = getattr(owner, name), []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == at:
            raise KeyboardInterrupt
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, interrupted)


def _commit_steps():
    """Where unstream_model changes the model once its copies are made: (what is
    interrupted, at which call) for each kind of change."""
    from layerstream import api
    from layerstream.runtime.core import StreamRuntime
    from layerstream.runtime.embeddings import StreamedEnds
    from layerstream.tiers.store import HostStore

    return {
        "restoring-a-layers-tensors": (HostStore, "restore", 2),
        "restoring-the-streamed-embeddings": (StreamedEnds, "restore", 1),
        "making-a-layer-plain": (api.layer, "make_plain", 2),
        "releasing-the-modules-above": (api.layer, "release_ancestors", 1),
        "releasing-the-store": (StreamRuntime, "close", 1),
    }


@pytest.mark.parametrize("step", list(_commit_steps()))
def test_an_unstream_interrupted_while_changing_the_model_says_so_and_is_finished_when_called_again(monkeypatch, step):
    """An interrupt after the copies are made leaves some modules plain and others streamed.
    What cannot be right on such a model is refused, saying that unstream_model was
    interrupted and to call it again: a forward or a merge while a layer still streams, a
    cast or move until the modules above the layers are released. Called again, it finishes
    the job and the model trains exactly as the resident one."""
    owner, name, at = _commit_steps()[step]
    streamed, resident = peft_pair("llama", layers=3, tie_word_embeddings=False)
    stream(streamed, "cpu", slots=2, stream_embeddings=True)
    _interrupt_call(monkeypatch, owner, name, at)
    with pytest.raises(KeyboardInterrupt):
        layerstream.unstream_model(streamed)
    monkeypatch.undo()
    half = r"unstream_model\(model\) was interrupted.*Call layerstream.unstream_model\(model\) again"
    layers = streamed.base_model.model.model.layers
    uses = []
    if any(map(swap.behaviours, layers)):
        uses += [lambda: _logits(streamed), lambda: train_steps(streamed, 1), streamed.merge_adapter]
    if swap.behaviours(streamed.base_model.model):
        uses.append(lambda: streamed.to(torch.float64))
    assert uses or not layerstream.is_streamed(streamed), "a half-unstreamed model must refuse something"
    for use in uses:
        with pytest.raises(layerstream.StreamingError, match=half):
            use()
    if layerstream.is_streamed(streamed):
        layerstream.unstream_model(streamed)
    assert not layerstream.is_streamed(streamed)
    assert not any(swap.behaviours(module) for module in streamed.modules()), "every class is the model's own"
    assert all(p.dtype == torch.float32 for p in streamed.parameters()), "a refused cast changed nothing"
    assert_traces_equal(train_steps(streamed, 2), train_steps(resident, 2))
