"""offload_activations: each layer's checkpointed input lives in host memory between its
forward and its recompute, and training stays bit for bit what it is without.

Every parity test uses non-zero LoRA B and more layers than slots; the negative controls
at the end prove that a changed host copy is caught (debug checksums) and that the
parity comparison itself fails when an offloaded activation is perturbed.
"""

import weakref
from types import SimpleNamespace

import pytest
import torch

import layerstream
from layerstream.config import OFFLOAD_AUTO_MARGIN, OFFLOAD_KEPT_LAYERS, StreamConfig, offloaded_layers, parse_setting
from layerstream.errors import ActivationChecksumError, HostMemoryError, StreamConfigError
from layerstream.long import offload
from layerstream.system import memory_limits

from tiny import assert_traces_equal, batch, peft_pair, stream, train_steps

STEPS = 6


def _attn(device):
    return "eager" if device == "cuda" else None


def _offloaded_pair(device, layers=6, family="llama", dtype=torch.float32, **config):
    streamed, resident = peft_pair(family, layers=layers, dtype=dtype, attn=_attn(device))
    stream(streamed, device, offload_activations=True, **config)
    resident.to(device)
    return streamed, resident


@pytest.mark.parametrize(
    "family,slots,prefetch,dtype",
    [("llama", 2, 1, torch.float32), ("qwen3", 3, 2, torch.bfloat16), ("qwen3_moe", 2, 1, torch.float32)],
    ids=["llama-2-slots", "qwen3-bf16-3-slots", "qwen3_moe"],
)
def test_offloaded_training_matches_resident(family, slots, prefetch, dtype, device):
    streamed, resident = _offloaded_pair(device, family=family, dtype=dtype, slots=slots, prefetch=prefetch)
    assert_traces_equal(train_steps(streamed, STEPS, device), train_steps(resident, STEPS, device))
    stats = layerstream.get_runtime(streamed).stats()
    assert stats["layer_loads"] > stats["layers"], "slots must have recycled"
    assert stats["activations_offloaded"] == STEPS * offloaded_layers(6)
    assert stats["activations_restored"] == stats["activations_offloaded"]


def test_offloaded_and_not_offloaded_streaming_agree(device):
    on, _ = peft_pair("llama", layers=5, attn=_attn(device))
    off, _ = peft_pair("llama", layers=5, attn=_attn(device))
    stream(on, device, offload_activations=True)
    stream(off, device)
    assert_traces_equal(train_steps(on, STEPS, device), train_steps(off, STEPS, device))
    assert layerstream.get_runtime(off).stats()["activations_offloaded"] == 0


def test_offloaded_inputs_are_released_until_backward():
    """Between forward and backward only the kept last layer's input is alive: autograd
    holds the host copies of the others, not the tensors."""
    for offloading, alive_expected in ((False, 5), (True, OFFLOAD_KEPT_LAYERS)):
        streamed, _ = peft_pair("llama", layers=5)
        stream(streamed, "cpu", offload_activations=offloading)
        inputs = []
        for layer in streamed.base_model.model.model.layers:
            layer.register_forward_pre_hook(
                lambda module, args, kw: inputs.append(weakref.ref(args[0])), with_kwargs=True
            )
        ids = batch(seq=12)
        loss = streamed(input_ids=ids, labels=ids).loss
        alive = sum(ref() is not None for ref in inputs)
        assert alive == alive_expected, (offloading, alive)
        loss.backward()


def test_offload_with_a_resident_window_matches_resident(device):
    streamed, resident = _offloaded_pair(device, layers=6)
    runtime = layerstream.get_runtime(streamed)
    runtime.set_window([1, 3])
    assert_traces_equal(train_steps(streamed, STEPS, device), train_steps(resident, STEPS, device))
    # window layers' inputs are offloaded too: every layer but the kept last one
    assert runtime.stats()["activations_offloaded"] == STEPS * offloaded_layers(6)


def test_offload_with_gradient_accumulation_matches_resident(device):
    streamed, resident = _offloaded_pair(device, layers=5)
    assert_traces_equal(
        train_steps(streamed, 4, device, accumulation=3), train_steps(resident, 4, device, accumulation=3)
    )


def test_offload_with_backward_slots_matches_resident(device):
    streamed, resident = _offloaded_pair(device, layers=7, backward_slots=2)
    assert_traces_equal(train_steps(streamed, STEPS, device), train_steps(resident, STEPS, device))
    assert layerstream.get_runtime(streamed).prefetch.backward_slots == 2


def test_offload_with_streamed_embeddings_matches_resident(device):
    streamed, resident = peft_pair("llama", layers=5, attn=_attn(device), tie_word_embeddings=False)
    stream(streamed, device, offload_activations=True, stream_embeddings=True)
    resident.to(device)
    assert_traces_equal(train_steps(streamed, STEPS, device), train_steps(resident, STEPS, device))


def test_two_forwards_before_one_backward_and_a_retained_graph_stay_exact():
    """Two passes' inputs live at once (a second arena), and a retained graph can run
    backward twice from the same host copies."""
    results = []
    for offloading in (True, False):
        model, _ = peft_pair("llama", layers=5)
        stream(model, "cpu", offload_activations=offloading)
        a, b = batch(seq=12, seed=3), batch(seq=9, seed=4)
        loss = model(input_ids=a, labels=a).loss + model(input_ids=b, labels=b).loss
        loss.backward(retain_graph=True)
        loss.backward()
        results.append({n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
    assert results[0].keys() == results[1].keys()
    for name in results[0]:
        assert torch.equal(results[0][name], results[1][name]), name


def _set_by_method(runtime, value):
    runtime.set_offload_activations(value)


def _set_in_config(runtime, value):
    runtime.config.offload_activations = value


@pytest.mark.parametrize(
    "switch,start,then",
    [(_set_by_method, True, False), (_set_by_method, True, "auto"), (_set_in_config, False, True)],
    ids=["method-off", "method-auto", "config-on"],
)
def test_offload_switched_between_a_forward_and_its_backward_applies_from_the_next_pass(
    monkeypatch, switch, start, then
):
    """The pass under way finishes with the setting it started with (its backward brings its
    inputs back through the offloader it began with); the next pass runs with the new one
    ("auto" without a budget: off). Every gradient equals the resident model's."""
    streamed, resident = peft_pair("llama", layers=3)
    stream(streamed, "cpu", offload_activations=start)
    runtime = layerstream.get_runtime(streamed)
    packed = []
    pack = offload.ActivationOffloader._pack
    monkeypatch.setattr(offload.ActivationOffloader, "_pack", lambda self, t: packed.append(1) or pack(self, t))
    for step, setting in enumerate((start, then)):
        ids = batch(seq=12, seed=step)
        loss = streamed(input_ids=ids, labels=ids).loss
        if step == 0:
            switch(runtime, then)
        loss.backward()
        resident(input_ids=ids, labels=ids).loss.backward()
        assert len(packed) == (offloaded_layers(3) if setting is True else 0), (step, setting)
        packed.clear()
        for (name, got), (_, expected) in zip(_grads(streamed), _grads(resident)):
            assert torch.equal(got, expected), f"gradient of {name} differs at step {step}"
        streamed.zero_grad(set_to_none=True)
        resident.zero_grad(set_to_none=True)


def _grads(model):
    return [(n, p.grad) for n, p in model.named_parameters() if p.requires_grad]


def test_offload_through_the_trainer_matches_the_plain_model(tmp_path):
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    ids = [batch(size=1, seq=12, seed=i)[0].tolist() for i in range(16)]
    data = Dataset.from_list([{"input_ids": row, "labels": row} for row in ids])
    streamed, plain = peft_pair("llama", layers=5)
    layerstream.stream_model(streamed, device="cpu", slots=2, offload_activations=True)
    losses = []
    for model, out in ((streamed, "streamed"), (plain, "plain")):
        args = TrainingArguments(
            output_dir=str(tmp_path / out),
            use_cpu=True,
            report_to=[],
            max_steps=4,
            per_device_train_batch_size=2,
            gradient_accumulation_steps=2,
            save_strategy="no",
            learning_rate=1e-2,
            logging_steps=1,
        )
        trainer = Trainer(model=model, args=args, train_dataset=data)
        trainer.train()
        losses.append([e["loss"] for e in trainer.state.log_history if "loss" in e])
    assert len(losses[0]) == 4 and losses[0] == losses[1]
    for (name, a), (_, b) in zip(streamed.named_parameters(), plain.named_parameters()):
        if a.requires_grad:
            assert torch.equal(a, b), name
    assert layerstream.get_runtime(streamed).stats()["activations_offloaded"] > 0


# -- settings, auto, host memory ------------------------------------------------------------
def test_the_setting_takes_true_false_or_auto_on_every_surface():
    assert parse_setting("offload_activations", "auto") == "auto"
    assert parse_setting("offload_activations", "yes") is True
    assert parse_setting("offload_activations", False) is False
    with pytest.raises(StreamConfigError, match="true, false or auto"):
        parse_setting("offload_activations", "sometimes", "--offload-activations")
    with pytest.raises(StreamConfigError, match="offload_activations must be True, False or 'auto'"):
        StreamConfig(device="cpu", offload_activations="on")


def _needed(model, seq, offload_on):
    return layerstream.get_runtime(model).memory_plan(2, seq, offload=offload_on).needed_bytes


def test_auto_offloads_when_the_plan_without_it_leaves_less_than_the_margin(caplog):
    """On where the plan does not fit, and also where it fits with less than the margin to
    spare (the plan can be under the real peak at long sequences); off beyond the margin."""
    probe, _ = peft_pair("llama", layers=6)
    stream(probe, "cpu")
    seq = 12
    without, with_offload = _needed(probe, seq, False), _needed(probe, seq, True)
    assert with_offload < without
    just_fits = int(without / (1 - OFFLOAD_AUTO_MARGIN)) - 1
    beyond_margin = int(without / (1 - OFFLOAD_AUTO_MARGIN)) + 1
    cases = (((without + with_offload) // 2, True), (without + 1, True), (just_fits, True), (beyond_margin, False))
    for budget, expected in cases:
        streamed, resident = peft_pair("llama", layers=6)
        stream(streamed, "cpu", offload_activations="auto", vram_budget=budget)
        with caplog.at_level("WARNING", logger="layerstream"):
            assert_traces_equal(train_steps(streamed, 2, seq=seq), train_steps(resident, 2, seq=seq))
        offloaded = layerstream.get_runtime(streamed).stats()["activations_offloaded"]
        assert (offloaded > 0) is expected, budget
        assert ("offload_activations='auto' is on" in caplog.text) is expected
        caplog.clear()


def test_auto_wanted_only_for_the_margin_stays_off_when_the_host_cannot_hold_it(monkeypatch, caplog):
    """Where the plan fits without offloading and only the margin made "auto" want it, a
    host that cannot hold the inputs does not stop the step: it runs without offloading,
    exactly, and says so. Where the plan does not fit, the host's refusal stands."""
    probe, _ = peft_pair("llama", layers=6)
    stream(probe, "cpu")
    without, with_offload = _needed(probe, 12, False), _needed(probe, 12, True)
    monkeypatch.setattr(offload, "host_memory", lambda: (1000, 64 << 30))
    streamed, resident = peft_pair("llama", layers=6)
    stream(streamed, "cpu", offload_activations="auto", vram_budget=int(without / (1 - OFFLOAD_AUTO_MARGIN)) - 1)
    with caplog.at_level("WARNING", logger="layerstream"):
        assert_traces_equal(train_steps(streamed, 2, seq=12), train_steps(resident, 2, seq=12))
    assert layerstream.get_runtime(streamed).stats()["activations_offloaded"] == 0
    assert caplog.text.count("stays off for batch") == 1, "said once"
    short, _ = peft_pair("llama", layers=6)
    stream(short, "cpu", offload_activations="auto", vram_budget=(without + with_offload) // 2)
    with pytest.raises(HostMemoryError, match="offload_activations needs"):
        train_steps(short, 1, seq=12)


def test_auto_refused_by_the_host_says_so_once_and_tries_no_longer_step(monkeypatch, caplog):
    """Padded batches bring a new length at most steps: after the host refused one arena,
    "auto" neither tries a larger one nor warns again."""
    probe, _ = peft_pair("llama", layers=6)
    stream(probe, "cpu")
    runtime = layerstream.get_runtime(probe)
    budget = runtime.memory_plan(2, 16, offload=False).needed_bytes + 1
    assert runtime.memory_plan(2, 13, offload=False).needed_bytes > (1 - OFFLOAD_AUTO_MARGIN) * budget
    asked = []
    monkeypatch.setattr(offload, "host_memory", lambda: asked.append(1) or (1000, 64 << 30))
    streamed, _ = peft_pair("llama", layers=6)
    stream(streamed, "cpu", offload_activations="auto", vram_budget=budget)
    with caplog.at_level("DEBUG", logger="layerstream"):
        for seq in (14, 16, 15, 14, 13):
            train_steps(streamed, 1, seq=seq)
    warned = [r for r in caplog.records if "stays off for batch" in r.message and r.levelname == "WARNING"]
    assert len(warned) == 1 and "offload_activations='auto' is on" not in caplog.text
    # 13 tokens need the same aligned arena as 14 here: the host is asked once
    assert len(asked) == 1, "no step needing an arena at least as large as one refused asks again"


def test_an_arena_refused_while_a_pass_holds_one_is_released_once_idle(monkeypatch):
    """Two forwards before one backward: the first pass's arena is in use when the host
    refuses the second's. Once nothing holds it, the next pass (not offloading) frees it."""
    probe, _ = peft_pair("llama", layers=6)
    stream(probe, "cpu")
    without = _needed(probe, 12, False)
    answers = iter([(64 << 30, 64 << 30)])
    monkeypatch.setattr(offload, "host_memory", lambda: next(answers, (1000, 64 << 30)))
    streamed, resident = peft_pair("llama", layers=6)
    stream(streamed, "cpu", offload_activations="auto", vram_budget=int(without / (1 - OFFLOAD_AUTO_MARGIN)) - 1)
    runtime = layerstream.get_runtime(streamed)
    losses = {}
    for name, model in (("streamed", streamed), ("resident", resident)):
        model.train()
        losses[name] = []
        for step in range(3):
            a, b = batch(size=2, seq=12, seed=step), batch(size=2, seq=12, seed=50 + step)
            loss = model(input_ids=a, labels=a).loss + model(input_ids=b, labels=b).loss
            loss.backward()
            losses[name].append(loss.detach())
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
            losses[name].append(grads)
            model.zero_grad()
            if model is streamed and step == 0:
                assert runtime.offload_policy.offloader.host_bytes > 0, (
                    "the first pass's arena, held until its backward"
                )
    assert runtime.offload_policy.offloader.host_bytes == 0
    for mine, theirs in zip(losses["streamed"], losses["resident"]):
        if isinstance(mine, dict):
            assert all(torch.equal(mine[k], theirs[k]) for k in mine)
        else:
            assert torch.equal(mine, theirs)


def test_a_budget_that_fits_only_with_offload_is_refused_without_it():
    probe, _ = peft_pair("llama", layers=6)
    stream(probe, "cpu")
    budget = (_needed(probe, 12, False) + _needed(probe, 12, True)) // 2
    refused, _ = peft_pair("llama", layers=6)
    stream(refused, "cpu", vram_budget=budget)
    with pytest.raises(layerstream.StreamingError):
        train_steps(refused, 1, seq=12)


def test_host_memory_for_offloaded_inputs_is_refused_before_any_layer_runs(monkeypatch):
    streamed, _ = peft_pair("llama", layers=5)
    stream(streamed, "cpu", offload_activations=True)
    monkeypatch.setattr(offload, "host_memory", lambda: (1000, 64 << 30))
    runtime = layerstream.get_runtime(streamed)
    with pytest.raises(HostMemoryError, match="offload_activations needs .* set offload_activations=False"):
        train_steps(streamed, 1)
    assert runtime.visits == 0, "refused before the first layer computed"


def test_host_memory_refusal_names_the_host_budget_that_would_make_room(monkeypatch):
    """Short of host memory by less than the layer store holds: reading some layers from
    disk (a smaller host_budget) makes room, and the refusal says how small."""
    streamed, _ = peft_pair("llama", layers=5)
    stream(streamed, "cpu", offload_activations=True)
    runtime = layerstream.get_runtime(streamed)
    store = runtime.store.host_bytes
    need = offload.ActivationOffloader.pass_bytes(5, torch.zeros(*batch(seq=12).shape, streamed.config.hidden_size))
    monkeypatch.setattr(offload, "host_memory", lambda: (need - store // 2, 64 << 30))
    with pytest.raises(HostMemoryError, match=r"host_budget='[0-9]+MiB'\) or less \(--host-budget\)"):
        train_steps(streamed, 1)
    monkeypatch.setattr(offload, "host_memory", lambda: (1000, 64 << 30))
    monkeypatch.setattr(offload.ActivationOffloader, "pass_bytes", staticmethod(lambda *_: 2 * store + 1000))
    with pytest.raises(HostMemoryError) as refused:
        train_steps(streamed, 1)
    assert "host_budget" not in str(refused.value), "short by more than the store: no disk tier helps"


def test_the_host_arena_is_one_buffer_reused_across_steps():
    streamed, _ = peft_pair("llama", layers=5)
    stream(streamed, "cpu", offload_activations=True)
    train_steps(streamed, 3)
    offloader = layerstream.get_runtime(streamed).offload_policy.offloader
    per_layer = batch(seq=12).numel() * streamed.config.hidden_size * 4
    assert len(offloader.arenas) == 1
    assert offloader.host_bytes == offloaded_layers(5) * layerstream.plan.aligned(per_layer)


# -- negative controls ---------------------------------------------------------------------
def _corrupt_host_copies(monkeypatch):
    """Flip a byte of every host copy right after it was made."""
    original = offload.ActivationOffloader._pack

    def pack(self, tensor):
        saved = original(self, tensor)
        raw = saved.host.view(-1).view(torch.uint8)
        raw[0] ^= 0x40
        return saved

    monkeypatch.setattr(offload.ActivationOffloader, "_pack", pack)


def test_a_corrupted_host_copy_is_caught_by_the_debug_checksum(device, monkeypatch):
    streamed, _ = _offloaded_pair(device, layers=5, checksum=True)
    _corrupt_host_copies(monkeypatch)
    with pytest.raises(ActivationChecksumError, match="came back different"):
        train_steps(streamed, 1, device)


def test_the_debug_checksum_passes_untouched_copies(device):
    streamed, resident = _offloaded_pair(device, layers=5, checksum=True)
    assert_traces_equal(train_steps(streamed, 2, device), train_steps(resident, 2, device))
    assert layerstream.get_runtime(streamed).stats()["activation_checks"] == 2 * offloaded_layers(5)


def test_a_perturbed_offloaded_activation_turns_the_parity_check_red(device, monkeypatch):
    streamed, resident = _offloaded_pair(device, layers=5)
    _corrupt_host_copies(monkeypatch)
    with pytest.raises(AssertionError, match="gradient"):
        assert_traces_equal(train_steps(streamed, 2, device), train_steps(resident, 2, device))


# -- other offloaders ----------------------------------------------------------------------
def test_transformers_offloading_checkpoint_option_is_refused_with_what_to_use(tmp_path):
    from transformers import Trainer, TrainingArguments

    model, _ = peft_pair("llama", layers=3)
    layerstream.stream_model(model, device="cpu", slots=2)
    args = TrainingArguments(
        output_dir=str(tmp_path),
        use_cpu=True,
        report_to=[],
        max_steps=1,
        gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"offload": True},
    )
    with pytest.raises(layerstream.StreamingError, match="does not reach streamed layers.*offload_activations=True"):
        Trainer(model=model, args=args)


@pytest.mark.parametrize("setting", [True, "auto"])
def test_trl_activation_offloading_beside_offload_activations(tmp_path, setting, caplog):
    from transformers import Trainer
    from trl import SFTConfig

    model, _ = peft_pair("llama", layers=3)
    layerstream.stream_model(model, device="cpu", slots=2, offload_activations=setting)
    args = SFTConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=1, activation_offloading=True)
    if setting is True:
        with pytest.raises(layerstream.StreamingError, match="Use one: offload_activations=True"):
            Trainer(model=model, args=args)
        return
    with caplog.at_level("WARNING", logger="layerstream"):
        Trainer(model=model, args=args)
    assert "offload_activations='auto' stays off" in caplog.text
    assert layerstream.get_runtime(model).offload_policy.offloader is None


@pytest.mark.parametrize("early", [True, False], ids=["early", "negative-control-without-early-copy"])
def test_backward_copies_the_first_offloaded_input_back_while_the_last_layer_recomputes(monkeypatch, early):
    """No input is copied back on demand: the kept last layer's recompute issues the copy of
    the layer before it, and each unpack issues the next one's (without the first, the
    layer before the last waits for its copy in every step)."""
    if not early:
        monkeypatch.setattr(offload.ActivationOffloader, "prefetch_newest", lambda self: None)
    streamed, _ = peft_pair("llama", layers=5)
    demand = []
    original_unpack = offload.ActivationOffloader._unpack

    def unpack(self, saved):
        if isinstance(saved, offload._Saved) and saved.device_copy is None:
            demand.append(saved.position)
        return original_unpack(self, saved)

    monkeypatch.setattr(offload.ActivationOffloader, "_unpack", unpack)
    stream(streamed, "cpu", offload_activations=True)  # its hooks bind the patched unpack
    train_steps(streamed, 2)
    assert demand == ([] if early else [offloaded_layers(5) - 1] * 2)
    assert layerstream.get_runtime(streamed).stats()["activations_restored"] == 2 * offloaded_layers(5)


def test_a_handle_reached_by_its_weak_reference_while_finalised_is_not_copied_back(monkeypatch):
    """The lookahead reaches handles through weak references, which still resolve while a
    handle is finalised; a copy back issued then would never be waited for (finalisers run
    once), so a handle being finalised is never fetched."""
    streamed, _ = peft_pair("llama", layers=4)
    stream(streamed, "cpu", offload_activations=True)
    offloader = layerstream.get_runtime(streamed).offload_policy.offloader
    fetched_while_finalised = []
    finalise = offload._Saved.__del__

    def racing_lookahead(saved):  # what another thread's lookahead can do at that moment
        finalise(saved)
        offloader._fetch(saved)
        fetched_while_finalised.append(saved.device_copy is not None)

    monkeypatch.setattr(offload._Saved, "__del__", racing_lookahead)
    ids = batch(96, seq=8)
    streamed(input_ids=ids, labels=ids).loss  # the graph and its handles are dropped unused
    assert fetched_while_finalised == [False] * offloaded_layers(4)


def test_the_page_lock_limit_counts_the_ends_store_beside_the_layer_store(monkeypatch):
    """The offloaded inputs, the layer store and the ends' store (where the embedding and
    head stream) are all page-locked: an arena that fits the limit beside the layer store
    alone is refused beside both, before anything is allocated."""
    offloader = offload.ActivationOffloader(torch.device("cpu"), 5, pin=False, verify=False)
    offloader.pin = True  # as on CUDA; the check refuses before any page is locked
    hidden = torch.zeros(1, 12, 32)
    need = offload.ActivationOffloader.pass_bytes(5, hidden)
    total = 64 << 30
    lockable = memory_limits.lockable_bytes(total)
    store, ends = lockable - need - (1 << 20), 2 << 20  # 1 MiB under the limit, then 1 MiB over
    monkeypatch.setattr(offload, "host_memory", lambda: (total, total))
    arena = lambda nbytes, pin: SimpleNamespace(nbytes=nbytes, pinned=pin, used=0, release=lambda: None)  # noqa: E731
    monkeypatch.setattr(offload, "_Arena", arena)
    offloader.start_pass(hidden, store)
    offloader.release()
    with pytest.raises(HostMemoryError, match="page-lock"):
        offloader.start_pass(hidden, store, ends)
