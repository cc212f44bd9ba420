"""The NF4 layer cache: an NF4 load under host_budget writes each layer's packed bytes as it
quantises them, reads the layers beyond the budget from there, and a later load of the
same checkpoint quantises nothing. A cache-fed run equals a RAM-fed one bit for bit; a
stale, damaged, interrupted or unwritable cache is detected, never used."""

import errno
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from peft import get_peft_model

import layerstream
from layerstream.errors import DiskCacheError, StreamConfigError
from layerstream.modules import nf4
from layerstream.tiers import nf4_cache

from tiny import WIDE, assert_traces_equal, lora_config, save_model_of, save_tiny, tiny_config, train_steps

LAYERS = 6
SLOTS = 2


def _save(directory):
    return save_tiny(directory, layers=LAYERS, dtype=torch.bfloat16, wide=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return _save(tmp_path_factory.mktemp("nf4cache") / "ckpt")


@pytest.fixture(scope="module")
def ram_model_bytes(checkpoint):
    model = layerstream.from_pretrained(checkpoint, quantization="nf4", stream=layerstream.StreamConfig(device="cpu"))
    return layerstream.get_runtime(model).store.largest_layer_bytes


def _load(directory, budget=None, cache=None, device="cpu", **kwargs):
    """Quantised on ``device`` (the stream device); vram_budget=None: on a GPU every tiny
    layer would otherwise sit in the resident window instead of streaming."""
    config = layerstream.StreamConfig(
        device=device, slots=SLOTS, host_budget=budget, disk_cache_dir=cache, vram_budget=None
    )
    model = layerstream.from_pretrained(directory, quantization="nf4", stream=config, **kwargs)
    return model.to(device)


def _peft(model, device="cpu"):
    torch.manual_seed(0)  # the same non-zero LoRA B (init_lora_weights=False) on both
    return get_peft_model(model, lora_config()).to(device)


def _assert_streamed_on(model, cache, device):
    """The layers were quantised on ``device`` and, on CUDA, the disk ring is pinned."""
    assert _manifest(cache)["source"]["quantization"]["quantized_on"] == torch.device(device).type
    if device != "cpu":
        assert layerstream.get_runtime(model).disk.pinned


@pytest.fixture
def counted(monkeypatch):
    """The layers quantised by the loads that follow."""
    calls = []
    real = nf4.quantise_layer

    def counting(layer, *args):
        calls.append(layer)
        return real(layer, *args)

    monkeypatch.setattr(nf4, "quantise_layer", counting)
    return calls


@pytest.fixture
def fed(checkpoint, ram_model_bytes, tmp_path):
    """A loader of cache-fed models: the ring and one layer in RAM, the rest from the cache."""
    cache = tmp_path / "cache"

    def load(directory=checkpoint, **kwargs):
        return _load(directory, 5 * ram_model_bytes, str(cache), **kwargs)

    load.cache = cache
    return load


def _manifest_path(cache):
    (path,) = cache.glob("manifest.*.json")
    return path


def _manifest(cache):
    return json.loads(_manifest_path(cache).read_text())


def _write_manifest(cache, manifest, reseal=True):
    """Write an edited manifest; ``reseal``: with its digest recomputed, as if it were consistent."""
    if reseal:
        manifest["digest"] = nf4_cache.digest({"source": manifest["source"], "layers": manifest["layers"]})
    _manifest_path(cache).write_text(json.dumps(manifest))


def _disk_layer_file(model):
    tier = layerstream.get_runtime(model).disk
    return tier.layers[tier.tiers.disk[len(tier.tiers.disk) // 2]].files[0].path


def _flip(path, offset=100):
    with open(path, "r+b") as handle:
        handle.seek(offset)
        value = handle.read(1)[0]
        handle.seek(offset)
        handle.write(bytes([value ^ 0x21]))


def test_cache_fed_training_matches_ram_fed_and_a_second_load_quantises_nothing(checkpoint, fed, counted, device):
    ram = _peft(_load(checkpoint, device=device), device)
    counted.clear()
    writing = _peft(fed(device=device), device)
    assert len(counted) == LAYERS
    _assert_streamed_on(writing, fed.cache, device)
    stats = layerstream.get_runtime(writing).stats()
    assert stats["disk_layers"] > SLOTS and stats["ram_layers"] >= 1
    assert sorted(_manifest(fed.cache)["layers"]) == [str(i) for i in range(LAYERS)]
    counted.clear()
    reading = _peft(fed(device=device), device)
    assert counted == []
    want = train_steps(ram, 3, device=device)
    assert_traces_equal(want, train_steps(writing, 3, device=device))
    assert_traces_equal(want, train_steps(reading, 3, device=device))
    assert layerstream.get_runtime(reading).stats()["disk_read_bytes"] > 0
    assert str(fed.cache) in str(_disk_layer_file(reading))


def test_cache_fed_generation_matches_ram_fed(checkpoint, fed, device):
    fed(device=device)
    ram, cached = _load(checkpoint, device=device), fed(device=device)
    _assert_streamed_on(cached, fed.cache, device)
    ids = torch.randint(3, 90, (2, 6), generator=torch.Generator().manual_seed(3)).to(device)
    with torch.no_grad():
        assert torch.equal(
            ram.generate(ids, max_new_tokens=8, do_sample=False),
            cached.generate(ids, max_new_tokens=8, do_sample=False),
        )


def test_a_flipped_byte_in_a_layer_file_is_caught_at_open_and_the_layer_quantised_again(
    checkpoint, fed, counted, caplog, device
):
    path = _disk_layer_file(fed(device=device))
    _flip(path)
    counted.clear()
    with caplog.at_level(logging.WARNING, logger="layerstream.tiers.nf4_cache"):
        model = _peft(fed(device=device), device)
    assert len(counted) == 1
    assert [r for r in caplog.records if "damaged" in r.getMessage() and str(path) in r.getMessage()]
    ram = _peft(_load(checkpoint, device=device), device)
    assert_traces_equal(train_steps(ram, 1, device=device), train_steps(model, 1, device=device))
    counted.clear()
    fed(device=device)
    assert counted == []  # the rebuilt layer is in the manifest again


def test_a_truncated_layer_file_is_caught_and_quantised_again(fed, counted, caplog):
    path = _disk_layer_file(fed())
    os.truncate(path, os.path.getsize(path) - 512)
    counted.clear()
    with caplog.at_level(logging.WARNING, logger="layerstream.tiers.nf4_cache"):
        fed()
    assert len(counted) == 1 and any("bytes, the manifest" in r.getMessage() for r in caplog.records)


def test_the_parity_check_fails_when_the_checksum_is_bypassed_negative_control(checkpoint, fed):
    """A flipped byte whose CRC the manifest is made to agree with reaches the computation:
    the checksum is what keeps the parity above."""
    path = _disk_layer_file(fed())
    _flip(path)
    manifest = _manifest(fed.cache)
    for entry in manifest["layers"].values():
        if entry["file"] == str(path):
            entry["crc32"] = zlib_crc(path)
    _write_manifest(fed.cache, manifest)
    with pytest.raises(AssertionError):
        assert_traces_equal(train_steps(_peft(_load(checkpoint)), 1), train_steps(_peft(fed()), 1))


def _edit_block_size(cache, reseal):
    manifest = _manifest(cache)
    quant = manifest["layers"]["0"]["layout"]["quantised"]["self_attn.q_proj"]
    quant["blocksize"] = quant["state_blocksize"] = 2 * quant["blocksize"]
    _write_manifest(cache, manifest, reseal)


@pytest.mark.parametrize("reseal", [False, True], ids=["edited", "edited-and-resealed"])
def test_a_hand_edited_block_size_in_the_manifest_is_never_used(checkpoint, fed, counted, caplog, reseal):
    """Edited alone, the manifest no longer matches its digest: the cache is rebuilt. With the
    digest recomputed too, the block size disagrees with the absmax the file holds: that layer
    is quantised again. Either way the run equals a RAM-fed one."""
    fed()
    _edit_block_size(fed.cache, reseal)
    counted.clear()
    with caplog.at_level(logging.WARNING, logger="layerstream.tiers.nf4_cache"):
        model = _peft(fed())
    said = " ".join(r.getMessage() for r in caplog.records)
    if reseal:
        assert len(counted) == 1 and "blocksize 128 (32 blocks) but 64 absmax values" in said
    else:
        assert len(counted) == LAYERS and "was edited or damaged" in said
    assert_traces_equal(train_steps(_peft(_load(checkpoint)), 1), train_steps(model, 1))


def test_a_resealed_block_size_edit_reaches_the_computation_without_the_layout_check_negative_control(
    checkpoint, fed, monkeypatch
):
    fed()
    _edit_block_size(fed.cache, reseal=True)
    monkeypatch.setattr(nf4_cache, "layout_problem", lambda *_: None)
    with pytest.raises(AssertionError):
        assert_traces_equal(train_steps(_peft(_load(checkpoint)), 1), train_steps(_peft(fed()), 1))


def zlib_crc(path):
    import zlib

    return zlib.crc32(path.read_bytes()) & 0xFFFFFFFF


def test_a_changed_checkpoint_makes_the_cache_stale_with_one_warning(checkpoint, fed, counted, caplog, tmp_path):
    source = tmp_path / "source"
    shutil.copytree(checkpoint, source)
    fed(source)
    _save(source)  # written again: new files, the same names, shapes and values
    counted.clear()
    with caplog.at_level(logging.WARNING, logger="layerstream.tiers.nf4_cache"):
        model = _peft(fed(source))
    assert len(counted) == LAYERS
    assert sum("another checkpoint or other settings" in r.getMessage() for r in caplog.records) == 1
    assert_traces_equal(train_steps(_peft(_load(source)), 1), train_steps(model, 1))


def test_another_checkpoint_copied_over_with_its_times_kept_makes_the_cache_stale(fed, counted, caplog, tmp_path):
    """Two checkpoints of the same shapes have equal sizes and headers; ``cp -p`` or ``rsync
    -a`` keeps the mtime too. The cache of the first must not feed the second."""
    source, other = tmp_path / "source", tmp_path / "other"
    _save(source)
    save_model_of(tiny_config("llama", LAYERS, **WIDE), other, dtype=torch.bfloat16, seed=7)
    fed(source)
    weights = source / "model.safetensors"
    times = os.stat(weights)
    shutil.copy2(other / "model.safetensors", weights)
    os.utime(weights, ns=(times.st_atime_ns, times.st_mtime_ns))
    assert os.stat(weights).st_size == times.st_size and os.stat(weights).st_mtime_ns == times.st_mtime_ns
    counted.clear()
    with caplog.at_level(logging.WARNING, logger="layerstream.tiers.nf4_cache"):
        model = _peft(fed(source))
    assert len(counted) == LAYERS, "quantised again from the files now there"
    assert sum("another checkpoint or other settings" in r.getMessage() for r in caplog.records) == 1
    assert_traces_equal(train_steps(_peft(_load(other)), 1), train_steps(model, 1))


def test_other_quantisation_settings_make_the_cache_stale(checkpoint, ram_model_bytes, tmp_path, counted, caplog):
    budget = 3 * ram_model_bytes  # below either load's layers (single quantisation packs fewer bytes here)
    _load(checkpoint, budget, str(tmp_path))
    counted.clear()
    with caplog.at_level(logging.WARNING, logger="layerstream.tiers.nf4_cache"):
        model = _load(checkpoint, budget, str(tmp_path), bnb_4bit_use_double_quant=False)
    assert layerstream.get_runtime(model).disk is not None
    assert len(counted) == LAYERS and any("other settings" in r.getMessage() for r in caplog.records)
    key = nf4_cache.cache_key(_manifest(tmp_path)["source"])
    assert all(key in p.name for p in tmp_path.glob("*.nf4")), "the other settings' files were cleared"


def _logits(model):
    ids = torch.randint(3, 90, (2, 6), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_a_load_with_other_settings_running_in_the_same_directory_meanwhile_maps_none_of_its_files(
    checkpoint, ram_model_bytes, tmp_path, monkeypatch
):
    """Between writing its first layer file and mapping it, a double-quantised load waits for a
    whole single-quantised load into the same directory, in another thread: each model must
    read only files of its own settings (before, they shared names and the first mapped the
    second's file)."""
    budget, cache = 3 * ram_model_bytes, str(tmp_path)
    real_write, other = nf4_cache.LayerCache.write, []

    def write_then_load_the_other(self, index, data, layout):
        written = real_write(self, index, data, layout)
        if not other:
            other.append(None)
            with ThreadPoolExecutor(1) as pool:
                other[0] = pool.submit(_load, checkpoint, budget, cache, bnb_4bit_use_double_quant=False).result()
        return written

    monkeypatch.setattr(nf4_cache.LayerCache, "write", write_then_load_the_other)
    nested = _load(checkpoint, budget, cache)
    monkeypatch.undo()
    single = other[0]
    assert all(layerstream.get_runtime(m).disk.holds(0) for m in (nested, single))
    ram_nested, ram_single = _load(checkpoint), _load(checkpoint, bnb_4bit_use_double_quant=False)
    assert not torch.equal(_logits(ram_nested), _logits(ram_single)), "the settings give other numbers"
    assert torch.equal(_logits(nested), _logits(ram_nested))
    assert torch.equal(_logits(single), _logits(ram_single))


@pytest.mark.parametrize("same_bytes", [True, False], ids=["same-bytes", "other-bytes"])
def test_a_layer_file_replaced_before_it_is_mapped_is_used_only_with_the_bytes_written(
    checkpoint, fed, monkeypatch, same_bytes
):
    """Another process writing the same cache may replace a layer file between this load's
    write and its mapping: the same bytes are fine, other bytes are refused naming the file."""
    real_write = nf4_cache.LayerCache.write

    def write_then_replace(self, index, data, layout):
        written = real_write(self, index, data, layout)
        if index == 0:
            path = self.path(index)
            replacement = path.with_name("replacement")
            shutil.copyfile(path, replacement)
            if not same_bytes:
                _flip(replacement)
            os.replace(replacement, path)
        return written

    monkeypatch.setattr(nf4_cache.LayerCache, "write", write_then_replace)
    if not same_bytes:
        with pytest.raises(DiskCacheError, match=r"layer-00000\.[0-9a-f]+\.nf4 was replaced with other bytes"):
            fed()
        return
    model = fed()
    assert layerstream.get_runtime(model).disk.holds(0)
    assert torch.equal(_logits(model), _logits(_load(checkpoint)))


def test_an_interrupted_load_leaves_completed_layers_that_the_next_load_reuses(checkpoint, fed, counted, monkeypatch):
    counting = nf4.quantise_layer

    def interrupted(layer, *args):
        if len(counted) == 3:  # layers 0-2 are quantised and cached: interrupt layer 3
            raise KeyboardInterrupt
        return counting(layer, *args)

    counted.clear()
    with monkeypatch.context() as patch:
        patch.setattr(nf4, "quantise_layer", interrupted)
        with pytest.raises(KeyboardInterrupt):
            fed()
    assert sorted(_manifest(fed.cache)["layers"]) == ["0", "1", "2"]
    assert not [p for p in fed.cache.iterdir() if p.name.endswith(".tmp")]
    counted.clear()
    model = _peft(fed())
    assert len(counted) == LAYERS - 3
    assert_traces_equal(train_steps(_peft(_load(checkpoint)), 1), train_steps(model, 1))


def test_a_full_disk_names_the_directory_and_leaves_no_half_written_layer(fed, counted, monkeypatch):
    real = os.write

    def full(fd, data):
        if "layer-00002" in os.readlink(f"/proc/self/fd/{fd}"):
            real(fd, bytes(data)[: len(data) // 2])  # half the layer reached the disk
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data)

    with monkeypatch.context() as patch:
        patch.setattr(os, "write", full)
        with pytest.raises(DiskCacheError, match="is full") as caught:
            fed()
    message = str(caught.value)
    assert str(fed.cache) in message and "Free space" in message and "disk_cache_dir" in message
    assert "host_budget" in message
    assert sorted(_manifest(fed.cache)["layers"]) == ["0", "1"]
    key = nf4_cache.cache_key(_manifest(fed.cache)["source"])
    assert sorted(p.name for p in fed.cache.iterdir() if not p.name.startswith(".lock")) == [
        f"layer-00000.{key}.nf4",
        f"layer-00001.{key}.nf4",
        f"manifest.{key}.json",
    ]
    counted.clear()
    fed()
    assert len(counted) == LAYERS - 2


# -- a load killed mid-write ----------------------------------------------------------------------
_WRITER = """
import fcntl, os, sys, time
name, lock = sys.stdin.readline().split()
if lock != "-":  # a load under way holds its key's lock
    held = os.open(lock, os.O_RDWR | os.O_CREAT)
    fcntl.flock(held, fcntl.LOCK_SH)
with open(name, "wb") as handle:
    handle.write(b"\\xa5" * 20000)  # part of a layer
print("written", flush=True)
time.sleep(60)
"""


def _writing(path, lock=None):
    """A process writing cache file ``path`` under its temporary name (with its own pid, as a
    load does), holding ``lock`` if given, stopped part way: (process, its temporary file)."""
    writer = subprocess.Popen([sys.executable, "-c", _WRITER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    temporary = nf4_cache.temporary_path(path, writer.pid, 1)
    writer.stdin.write(f"{temporary} {lock or '-'}\n")
    writer.stdin.flush()
    assert writer.stdout.readline().strip() == "written"
    return writer, temporary


def _killed(process):
    process.send_signal(signal.SIGKILL)
    process.wait()


def _temporaries(cache):
    return sorted(p.name for p in cache.iterdir() if p.name.endswith(".tmp"))


def test_temporary_files_of_loads_killed_mid_write_are_removed_by_the_next_and_never_read(checkpoint, fed):
    """Loads killed with SIGKILL while writing a layer file and the manifest (this key) and a
    layer of other settings (another key) leave their temporary files: the next load removes
    them, and computes as a RAM-fed model."""
    fed()
    key = nf4_cache.cache_key(_manifest(fed.cache)["source"])
    other = nf4_cache.cache_key({"other": "settings"})
    paths = [fed.cache / f"layer-00002.{key}.nf4", fed.cache / f"manifest.{key}.json"]
    paths.append(fed.cache / f"layer-00001.{other}.nf4")
    for path in paths:
        _killed(_writing(path)[0])
    assert len(_temporaries(fed.cache)) == 3
    model = fed()
    assert _temporaries(fed.cache) == []
    assert torch.equal(_logits(model), _logits(_load(checkpoint)))


def test_a_temporary_file_a_live_load_may_be_writing_is_left_alone(fed):
    """Only what is provably stale goes: nothing of a key whose lock a live load holds (not
    even a dead writer's file: the lock says a load is under way), nor a file whose writer
    lives. Once the live load is gone, the next load removes its file and the dead one's."""
    fed()
    key = nf4_cache.cache_key(_manifest(fed.cache)["source"])
    live, live_file = _writing(fed.cache / f"layer-00003.{key}.nf4", lock=fed.cache / f".lock.{key}")
    dead, dead_file = _writing(fed.cache / f"layer-00004.{key}.nf4")
    _killed(dead)
    unlocked, unlocked_file = _writing(fed.cache / f"layer-00001.{nf4_cache.cache_key({'o': 1})}.nf4")
    try:
        fed()
        assert _temporaries(fed.cache) == sorted([live_file.name, dead_file.name, unlocked_file.name])
    finally:
        _killed(live)
        _killed(unlocked)
    fed()
    assert _temporaries(fed.cache) == []


def test_a_comma_list_stripes_the_layers_over_directories(checkpoint, ram_model_bytes, tmp_path):
    first, second = tmp_path / "a", tmp_path / "b"
    model = _peft(_load(checkpoint, 5 * ram_model_bytes, f"{first},{second}"))
    key = nf4_cache.cache_key(_manifest(first)["source"])
    assert sorted(p.name for p in second.iterdir()) == [f"layer-{i:05d}.{key}.nf4" for i in range(1, LAYERS, 2)]
    assert not list(second.glob("manifest*"))
    assert_traces_equal(train_steps(_peft(_load(checkpoint)), 1), train_steps(model, 1))


def test_the_default_cache_directory(tmp_path, monkeypatch):
    assert nf4_cache.cache_directories(None, tmp_path) == [tmp_path / nf4_cache.DEFAULT_SUBDIRECTORY]
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    (found,) = nf4_cache.cache_directories(None, tmp_path)
    assert found.parent == tmp_path / "home" / ".cache" / "layerstream"
    assert nf4_cache.cache_directories(None, tmp_path) == [found]  # the same checkpoint, the same cache


def test_disk_cache_dir_is_a_setting_on_every_surface(tmp_path):
    from layerstream.config import parse_setting

    assert parse_setting("disk_cache_dir", "/a,/b") == "/a,/b"
    assert parse_setting("disk_cache_dir", "none") is None
    assert layerstream.StreamConfig(device="cpu", disk_cache_dir=tmp_path).disk_cache_dir == str(tmp_path)
    with pytest.raises(StreamConfigError, match="disk_cache_dir"):
        layerstream.StreamConfig(device="cpu", disk_cache_dir=" , ")


def test_a_read_only_cache_directory_is_refused_before_any_layer_is_quantised(fed, counted, read_only):
    """A cache directory the load cannot write (a read-only mount) is named, with what to do,
    before any layer is quantised, not after the first layer's work with a bare OSError. A
    cache that already holds every layer (the control) is read from such a directory."""
    fed.cache.mkdir()
    read_only(fed.cache)
    with pytest.raises(DiskCacheError, match="cannot be written") as refused:
        fed()
    message = str(refused.value)
    assert str(fed.cache) in message and "disk_cache_dir" in message and "host_budget" in message
    assert counted == [] and list(fed.cache.iterdir()) == []


def test_a_complete_cache_is_read_from_a_read_only_directory(checkpoint, fed, counted, read_only):
    """The control of the refusal above: nothing needs writing, so nothing is refused."""
    fed()
    read_only(fed.cache)
    counted.clear()
    reading = _peft(fed())
    assert counted == []
    assert_traces_equal(train_steps(_peft(_load(checkpoint)), 2), train_steps(reading, 2))


def test_a_stale_manifest_naming_files_elsewhere_deletes_none_of_them(tmp_path):
    """A cache directory copied from another cache (or a hand-edited manifest) names files
    elsewhere; finding it stale must not delete them: only this directory's own cache files
    (by name) are ever removed."""
    elsewhere = tmp_path / "other-cache" / "layer-00000.nf4"
    elsewhere.parent.mkdir()
    elsewhere.write_bytes(b"another run's layer")
    cache = tmp_path / "cache"
    cache.mkdir()
    entries = {"0": {"file": str(elsewhere)}}
    source = {"new": 1}
    (cache / nf4_cache.manifest_name(source)).write_text(json.dumps({"source": {"old": 1}, "layers": entries}))
    nf4_cache.LayerCache([cache], source)
    assert elsewhere.read_bytes() == b"another run's layer"


def test_the_manifest_spells_entries_and_settings_as_existing_caches_hold_them(fed):
    """Caches on disk were written with these names; a load reads them back only while the
    manifest still spells quant-state entries and 4-bit settings the same way."""
    fed()
    layout = _manifest(fed.cache)["layers"]["0"]["layout"]
    kinds = {kind for _, kind, *_ in layout["entries"]}
    assert "quant" in kinds and kinds <= {"_parameters", "_buffers", "quant"}
    names = {name for _, kind, name, *_ in layout["entries"] if kind == "quant"}
    assert "absmax" in names and names <= {"absmax", "code", "offset", "state2.absmax", "state2.code"}
    assert layout["quantised"]
    for settings in layout["quantised"].values():
        assert set(settings) == {
            "blocksize",
            "compress_statistics",
            "quant_type",
            "quant_storage",
            "shape",
            "state_blocksize",
            "state_dtype",
            "state2",
        }
