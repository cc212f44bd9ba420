"""Activation offload, the chunked loss, the tiled MLP and the disk tier combined with each
other and with the rest: each result equals the resident one bit for bit, or is refused
before anything changes."""

import shutil

import pytest
import torch
from peft import get_peft_model

import layerstream
from layerstream.errors import DiskReadError, StreamingError
from layerstream.long import chunked_loss, tiled_mlp

from tiny import assert_traces_equal, batch, lora_config, peft_pair, save_tiny, stream, train_steps

LAYERS = 6
LONG = dict(offload_activations=True, loss_chunk_tokens=5, mlp_tile_tokens=7)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("adversarial") / "ckpt", layers=LAYERS, shard="60KB")


@pytest.fixture
def copy_of(checkpoint, tmp_path):
    target = tmp_path / "copy"
    shutil.copytree(checkpoint, target)
    return target


def _load(directory, disk=True, **settings):
    budget = None
    if disk:
        probe = layerstream.from_pretrained(
            directory, dtype=torch.float32, stream=layerstream.StreamConfig(device="cpu")
        )
        budget = 5 * layerstream.get_runtime(probe).store.largest_layer_bytes  # the ring and one layer
    config = layerstream.StreamConfig(device="cpu", slots=2, host_budget=budget, **settings)
    return layerstream.from_pretrained(directory, dtype=torch.float32, stream=config)


def _peft(model):
    torch.manual_seed(0)
    return get_peft_model(model, lora_config())


def _rewrite_in_place(model):
    """An ordinary in-place write (the mtime changes) into a disk layer's bytes in its file."""
    tier = layerstream.get_runtime(model).disk
    chunk = tier.layers[tier.tiers.disk[0]].chunks[0]
    begin, _, _ = chunk.pieces[0]
    with open(chunk.file.path, "r+b") as handle:
        handle.seek(begin + 3)
        value = handle.read(1)[0]
        handle.seek(begin + 3)
        handle.write(bytes([value ^ 0x40]))


def _long_pair(family="llama", layers=5, **settings):
    streamed, resident = peft_pair(family, layers)
    stream(streamed, **LONG, **settings)
    chunked_loss.apply(resident, LONG["loss_chunk_tokens"])
    tiled_mlp.apply(resident, LONG["mlp_tile_tokens"])
    return streamed, resident


# -- findings ------------------------------------------------------------------------------------
def test_a_merge_refused_on_a_disk_layer_changes_nothing_and_the_model_runs_on(checkpoint):
    fed = _peft(_load(checkpoint))
    assert layerstream.get_runtime(fed).disk.holds(0)
    before = {k: v.clone() for k, v in fed.state_dict().items()}
    with pytest.raises(StreamingError, match="read from disk each time"):
        fed.merge_adapter()
    changed = [k for k, v in fed.state_dict().items() if not torch.equal(before[k], v)]
    assert changed == [], f"the refused merge wrote {changed}"
    assert not any(getattr(m, "merged_adapters", None) for m in fed.modules())
    fed(torch.tensor([[3, 4, 5]]))  # still usable


@pytest.mark.parametrize("merge", ["merge_adapter", "merge_and_unload"])
def test_a_merge_refused_at_a_later_disk_layer_leaves_the_earlier_ram_layer_unmerged(checkpoint, merge):
    """Adapters on a layer in host RAM (2) and on one after it read from disk (3): the refusal
    must come before layer 2 is merged, or layer 2 is left merged and its adapters gone."""
    torch.manual_seed(0)
    fed = get_peft_model(
        _load(checkpoint), lora_config(target_modules=["q_proj", "down_proj"], layers_to_transform=[2, 3])
    )
    tiers = layerstream.get_runtime(fed).disk.tiers
    assert 2 in tiers.ram and 3 in tiers.disk
    ids = torch.tensor([[3, 4, 5, 6]])
    logits = fed(ids).logits
    before = {k: v.clone() for k, v in fed.state_dict().items()}
    with pytest.raises(StreamingError, match="model.layers.3 is read from disk each time"):
        getattr(fed, merge)()
    after = fed.state_dict()
    assert after.keys() == before.keys(), f"the refused merge removed {sorted(before.keys() - after.keys())}"
    changed = [k for k, v in after.items() if not torch.equal(before[k], v)]
    assert changed == [], f"the refused merge wrote {changed}"
    assert not any(getattr(m, "merged_adapters", None) for m in fed.modules())
    assert torch.equal(fed(ids).logits, logits)


def test_unstream_refuses_a_checkpoint_file_changed_in_place(copy_of):
    fed = _load(copy_of)
    _rewrite_in_place(fed)
    with pytest.raises(DiskReadError, match="changed while the run used it"):
        layerstream.unstream_model(fed)


def test_unstream_of_an_unchanged_disk_tier_keeps_the_loaded_values_negative_control(checkpoint):
    fed = _load(checkpoint)
    before = {k: v.clone() for k, v in fed.state_dict().items()}
    layerstream.unstream_model(fed)
    assert all(torch.equal(before[k], v) for k, v in fed.state_dict().items())


def test_state_dict_of_a_disk_tier_never_shows_bytes_written_into_the_file_after_load(copy_of):
    fed = _load(copy_of)
    before = {k: v.clone() for k, v in fed.state_dict().items()}
    _rewrite_in_place(fed)
    with pytest.raises(DiskReadError, match="changed while the run used it"):
        fed.state_dict()
    assert before  # the unchanged files gave the loaded values


# -- probes that held ----------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_a_step_interrupted_inside_a_layer_leaves_offload_chunks_and_tiles_exact(where):
    streamed, resident = _long_pair(stream_embeddings=True, backward_slots=1)
    target = streamed.base_model.model.model.layers[2].mlp.down_proj.lora_A["default"]
    armed = [True]

    def boom(*_):
        if armed[0] and (where == "backward" or torch.is_grad_enabled()):
            armed[0] = False
            raise KeyboardInterrupt

    hook = target.register_forward_pre_hook(boom) if where == "forward" else target.register_full_backward_hook(boom)
    ids = batch(seed=999, seq=16)
    with pytest.raises(KeyboardInterrupt):
        streamed(input_ids=ids, labels=ids).loss.backward()
    hook.remove()
    for p in streamed.parameters():
        p.grad = None
    assert_traces_equal(train_steps(streamed, 2, seq=20), train_steps(resident, 2, seq=20))


def test_shapes_padding_and_evaluation_changing_every_step_stay_exact():
    streamed, resident = _long_pair()
    traces = []
    for model in (streamed, resident):
        seen = []
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        for step, (size, seq) in enumerate([(2, 12), (3, 20), (1, 5), (2, 30), (1, 3)]):  # the arena regrows
            ids = batch(size=size, seq=seq, seed=step)
            mask = torch.ones_like(ids)
            mask[0, : seq // 3] = 0
            labels = ids.masked_fill(mask == 0, -100)  # whole chunks without a counted label
            model.train()
            out = model(input_ids=ids, attention_mask=mask, labels=labels)
            out.loss.backward()
            seen.append(out.loss.detach())
            seen += [p.grad.clone() for p in model.parameters() if p.requires_grad]
            opt.step()
            opt.zero_grad()
            model.eval()
            with torch.no_grad():
                seen.append(model(input_ids=ids, attention_mask=mask).logits)
        traces.append(seen)
    assert len(traces[0]) == len(traces[1])
    for i, (a, b) in enumerate(zip(*traces)):
        assert torch.equal(a, b), f"entry {i} differs"


def test_disk_tier_with_offload_chunks_and_tiles_matches_ram_fed(checkpoint):
    ram = _peft(_load(checkpoint, disk=False, **LONG))
    fed = _peft(_load(checkpoint, **LONG))
    assert_traces_equal(train_steps(ram, 2), train_steps(fed, 2))
    ids = torch.randint(3, 90, (2, 6), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(
            ram.generate(ids, max_new_tokens=5, do_sample=False), fed.generate(ids, max_new_tokens=5, do_sample=False)
        )
    assert_traces_equal(train_steps(ram, 1, seq=20, batch_size=3), train_steps(fed, 1, seq=20, batch_size=3))


@pytest.mark.parametrize("family", ["gemma", "qwen3", "mistral"])
def test_families_with_every_long_sequence_setting_and_streamed_embeddings_match_resident(family):
    streamed, resident = peft_pair(family, 5)
    stream(streamed, **LONG, stream_embeddings=True)
    chunked_loss.apply(resident, LONG["loss_chunk_tokens"])
    tiled_mlp.apply(resident, LONG["mlp_tile_tokens"])
    assert_traces_equal(train_steps(streamed, 2), train_steps(resident, 2))
