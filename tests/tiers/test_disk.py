"""The disk tier: layers beyond host_budget are read from the checkpoint's own safetensors
files each time; a disk-fed run equals a RAM-fed one bit for bit, and every fault (a read
error, a short read, a file changed under the run, corrupted bytes) stops with an error
naming the file, never with wrong data."""

import errno
import logging
import os

import numpy as np
import pytest
import torch
from peft import get_peft_model

import layerstream
from layerstream.errors import DiskReadError, LoadingError, StreamConfigError, StreamingError
from layerstream.tiers import disk

from tiny import assert_traces_equal, batch, lora_config, save_tiny, tiny_model, train_steps

LAYERS = 6
SLOTS = 2


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("disk") / "ckpt", layers=LAYERS, dtype=torch.float32, shard="60KB")


def _layer_bytes(checkpoint) -> int:
    model = layerstream.from_pretrained(checkpoint, dtype=torch.float32, stream=layerstream.StreamConfig(device="cpu"))
    return layerstream.get_runtime(model).store.largest_layer_bytes


def _load(directory, budget=None, device="cpu", **stream):
    # no VRAM budget: on a GPU the resident window would otherwise keep every layer
    config = layerstream.StreamConfig(device=device, slots=SLOTS, host_budget=budget, vram_budget=None, **stream)
    return layerstream.from_pretrained(directory, dtype=torch.float32, stream=config).to(device)


def _small_budget(directory) -> int:
    """The ring and one layer: every other layer is read from disk."""
    return 5 * _layer_bytes(directory)


def _peft(model):
    torch.manual_seed(0)  # the same non-zero LoRA B (init_lora_weights=False) on both
    return get_peft_model(model, lora_config())


def _disk_layer_tensor(model):
    """(file, offset) of a byte inside a weight of a disk layer, in the checkpoint's file."""
    tier = layerstream.get_runtime(model).disk
    index = tier.tiers.disk[len(tier.tiers.disk) // 2]
    chunk = tier.layers[index].chunks[0]
    begin, end, _ = chunk.pieces[0]
    return chunk.file.path, begin + (end - begin) // 2 + 3  # the high byte of a float32 value


def _flip(path, offset, keep_mtime=True):
    stat = os.stat(path)
    with open(path, "r+b") as handle:
        handle.seek(offset)
        value = handle.read(1)[0]
        handle.seek(offset)
        handle.write(bytes([value ^ 0x40]))
    if keep_mtime:  # silent corruption: the size and time checks cannot see it
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


@pytest.fixture
def copy_of(checkpoint, tmp_path):
    import shutil

    target = tmp_path / "copy"
    shutil.copytree(checkpoint, target)
    return target


def test_disk_fed_training_matches_ram_fed_bit_for_bit(checkpoint, device):
    ram = _peft(_load(checkpoint, device=device)).to(device)
    fed = _peft(_load(checkpoint, _small_budget(checkpoint), device=device)).to(device)
    stats_before = layerstream.get_runtime(fed).stats()
    assert stats_before["disk_layers"] > SLOTS and stats_before["ram_layers"] >= 1
    assert_traces_equal(train_steps(ram, 3, device=device), train_steps(fed, 3, device=device))
    stats = layerstream.get_runtime(fed).stats()
    assert stats["disk_reads"] > stats["disk_layers"] and stats["disk_read_bytes"] > 0
    assert stats["disk_read_gbps"] > 0 and stats["disk_stall_seconds"] >= 0
    assert layerstream.get_runtime(fed).store.host_bytes < layerstream.get_runtime(ram).store.host_bytes
    assert "read from disk" in layerstream.get_runtime(fed).summary()


def test_reads_cut_into_many_chunks_still_match_ram_fed_bit_for_bit(checkpoint, monkeypatch):
    """A layer is read in CHUNK_BYTES pieces; with chunks of one alignment unit, tensors
    straddle chunk boundaries (a piece starts inside one chunk and ends in the next), as the
    real 32 MiB reads of a real layer's tensors do."""
    from layerstream.tiers import disk

    monkeypatch.setattr(disk, "CHUNK_BYTES", disk.IO_ALIGN)
    ram = _peft(_load(checkpoint))
    fed = _peft(_load(checkpoint, _small_budget(checkpoint)))
    tier = layerstream.get_runtime(fed).disk
    chunks = [c for layer in tier.layers.values() for c in layer.chunks]
    assert len(chunks) > 10 * len(tier.layers), "many reads per layer"
    pieces = sum(len(c.pieces) for c in chunks)
    tensors = sum(len(layer.record.entries) for layer in tier.layers.values())
    assert all(c.hi - c.lo <= disk.IO_ALIGN for c in chunks)
    assert pieces > tensors, "some tensors are cut across chunk boundaries"
    assert_traces_equal(train_steps(ram, 2), train_steps(fed, 2))


def test_disk_fed_generation_matches_ram_fed(checkpoint, device):
    ram, fed = _load(checkpoint, device=device), _load(checkpoint, _small_budget(checkpoint), device=device)
    ids = torch.randint(3, 90, (2, 6), generator=torch.Generator().manual_seed(3)).to(device)
    with torch.no_grad():
        want = ram.generate(ids, max_new_tokens=8, do_sample=False)
        got = fed.generate(ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(want, got)


def test_the_host_tensors_of_disk_layers_hold_the_checkpoint_values(checkpoint):
    ram, fed = _load(checkpoint), _load(checkpoint, _small_budget(checkpoint))
    a, b = ram.state_dict(), fed.state_dict()
    assert list(a) == list(b)
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_silently_corrupted_bytes_change_the_run_negative_control(checkpoint, copy_of, device):
    """Without debug checksums a flipped byte on disk reaches the computation: the parity
    test above can fail."""
    ram = _peft(_load(checkpoint, device=device)).to(device)
    fed = _peft(_load(copy_of, _small_budget(copy_of), device=device)).to(device)
    _flip(*_disk_layer_tensor(fed))
    with pytest.raises(AssertionError):
        assert_traces_equal(train_steps(ram, 1, device=device), train_steps(fed, 1, device=device))


def test_debug_checksums_catch_a_corrupted_read_naming_the_file(copy_of, device):
    fed = _peft(_load(copy_of, _small_budget(copy_of), device=device, checksum=True)).to(device)
    path, offset = _disk_layer_tensor(fed)
    _flip(path, offset)
    with pytest.raises(DiskReadError, match="debug checksum") as caught:
        train_steps(fed, 1, device=device)
    assert str(path) in str(caught.value)


def test_a_file_changed_under_the_run_is_refused(copy_of):
    fed = _peft(_load(copy_of, _small_budget(copy_of)))
    path, offset = _disk_layer_tensor(fed)
    _flip(path, offset, keep_mtime=False)
    os.utime(path, ns=(os.stat(path).st_atime_ns, os.stat(path).st_mtime_ns + 10**9))
    with pytest.raises(DiskReadError, match="changed while the run used it") as caught:
        train_steps(fed, 1)
    assert str(path) in str(caught.value) and "Restore the file" in str(caught.value)


TRUNCATED_THEN_READ = """
import json, os, sys, torch, layerstream
from layerstream.errors import DiskReadError
directory, budget = sys.argv[1], int(sys.argv[2])
config = layerstream.StreamConfig(device="cpu", slots=2, host_budget=budget, vram_budget=None)
model = layerstream.from_pretrained(directory, dtype=torch.float32, stream=config)
runtime = layerstream.get_runtime(model)
ids = torch.tensor([[3, 4, 5, 6]])
with torch.no_grad():
    model(ids)
layer = runtime.disk.layers[runtime.disk.tiers.disk[1]]
weight = layer.record.host_values[0]
path = layer.chunks[0].file.path
os.truncate(path, 4096)
reads = {
    "a step": lambda: model(ids),
    "a weight's values": lambda: weight.sum(),
    "its .data": lambda: weight.data,
    "its text": lambda: repr(weight),
    "state_dict": lambda: model.state_dict(),
}
refused = {}
for what, read in reads.items():
    try:
        with torch.no_grad():
            read()
    except DiskReadError as exc:
        refused[what] = str(exc)
print(json.dumps({"path": str(path), "refused": refused}))
"""


def test_a_file_truncated_between_steps_is_named_when_a_disk_layers_weight_is_read(copy_of):
    """A disk layer's host tensors map the checkpoint's file: a page past the end of a file
    truncated since would kill the process with SIGBUS when read. Each read (the next step,
    the weight's values, ``.data``, its text, ``state_dict``) raises instead, naming the file
    and what to do. In a child process: without the check the read kills it."""
    import json
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=os.path.join(os.path.dirname(__file__), "..", "..", "src"))
    done = subprocess.run(
        [sys.executable, "-c", TRUNCATED_THEN_READ, str(copy_of), str(_small_budget(copy_of))],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, f"the child died (status {done.returncode}; -7: SIGBUS): {done.stderr[-2000:]}"
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert sorted(result["refused"]) == sorted(["a step", "a weight's values", "its .data", "its text", "state_dict"])
    for message in result["refused"].values():
        assert result["path"] in message and "changed while the run used it" in message
        assert "Restore the file, or restart the run" in message


def test_a_read_error_names_the_file_and_what_to_check(checkpoint, monkeypatch):
    fed = _peft(_load(checkpoint, _small_budget(checkpoint)))

    def failing(fd, buffers, offset):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "preadv", failing)
    with pytest.raises(DiskReadError, match="Input/output error") as caught:
        train_steps(fed, 1)
    assert ".safetensors" in str(caught.value) and "Check the disk" in str(caught.value)


@pytest.mark.parametrize("during", ["forward", "backward"])
def test_after_a_failed_read_the_next_steps_equal_an_uninterrupted_run(checkpoint, monkeypatch, during):
    """A read that fails once (a transient I/O error) stops its step with the disk tier's
    error; what the slot schedule had planned for the read is forgotten with it, so the
    next steps load on demand and train exactly as a run that never failed."""
    ram, fed = _peft(_load(checkpoint)), _peft(_load(checkpoint, _small_budget(checkpoint)))
    assert_traces_equal(train_steps(ram, 1), train_steps(fed, 1))
    failing, read = [], disk.DiskTier._read_chunk

    def read_chunk(self, chunk, region, gate=None):
        if failing:
            raise OSError(errno.EIO, "Input/output error")
        return read(self, chunk, region, gate)

    monkeypatch.setattr(disk.DiskTier, "_read_chunk", read_chunk)
    ids = batch(96)
    with pytest.raises(DiskReadError, match="Input/output error"):
        failing.append(during == "forward")
        loss = fed(input_ids=ids, labels=ids).loss
        failing.append(True)
        loss.backward()
    failing.clear()
    fed.zero_grad(set_to_none=True)
    runtime = layerstream.get_runtime(fed)
    assert runtime.prefetch.owner == runtime.pool.owner, "planner and pool agree on what the slots hold"
    assert_traces_equal(train_steps(ram, 2), train_steps(fed, 2))


def test_a_read_ahead_that_failed_with_the_read_in_use_is_not_handed_to_the_next_step(checkpoint, monkeypatch):
    """A transient error fails every read under way at that moment: the read the step was
    waiting for raises, and a read ahead for another layer failed beside it. That one must
    be dropped too, or the next step, long after the disk recovered, fails on it."""
    fed = _load(checkpoint, _small_budget(checkpoint))
    tier = layerstream.get_runtime(fed).disk
    first, second = sorted(tier.layers)[:2]
    failing, read = [True], disk.DiskTier._read_chunk

    def read_chunk(self, chunk, region, gate=None):
        if failing:
            raise OSError(errno.EIO, "Input/output error")
        return read(self, chunk, region, gate)

    monkeypatch.setattr(disk.DiskTier, "_read_chunk", read_chunk)
    monkeypatch.setattr(type(tier.lookahead), "depth", property(lambda self: 2))  # read both ahead
    tier.read_ahead([first, second])
    with pytest.raises(DiskReadError, match="Input/output error"):
        tier.take(first)
    failing.clear()
    staged = tier.take(second)  # read again on demand, now that the disk answers
    assert staged.numel() == tier.layers[second].record.nbytes
    tier.copied(second)


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
def test_a_short_read_is_refused(checkpoint, monkeypatch, direct):
    fed = _peft(_load(checkpoint, _small_budget(checkpoint)))
    layerstream.get_runtime(fed).disk.direct = direct
    real = os.preadv

    def short(fd, buffers, offset):
        got = real(fd, buffers, offset)
        return min(got, 16) if offset == 0 or got > 16 else 0

    monkeypatch.setattr(os, "preadv", short)
    with pytest.raises(DiskReadError, match="the file is shorter than when it was loaded") as caught:
        train_steps(fed, 1)
    # a read under way when the file is truncated meets this error, not the check's: it
    # must name the file and what to do the same way
    message = str(caught.value)
    assert ".safetensors changed while the run used it" in message
    assert "Restore the file, or restart the run" in message


def test_direct_io_refused_by_the_file_system_falls_back_to_buffered_reads_loudly(checkpoint, monkeypatch, caplog):
    real_open = os.open

    def no_direct(path, flags, *args):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", no_direct)
    with caplog.at_level(logging.WARNING, logger="layerstream.tiers.disk"):
        fed = _peft(_load(checkpoint, _small_budget(checkpoint)))
    monkeypatch.setattr(os, "open", real_open)
    warnings = [r for r in caplog.records if "buffered I/O instead of direct I/O" in r.getMessage()]
    assert len(warnings) == 1
    ram = _peft(_load(checkpoint))
    assert_traces_equal(train_steps(ram, 2), train_steps(fed, 2))
    assert layerstream.get_runtime(fed).stats()["direct_io"] is False


def test_a_direct_read_refused_mid_run_falls_back_and_stays_exact(checkpoint, monkeypatch, caplog):
    fed = _peft(_load(checkpoint, _small_budget(checkpoint)))
    tier = layerstream.get_runtime(fed).disk
    direct_fds = {f.fd for f in tier._files.values() if f.fd != f.buffered_fd}
    assert direct_fds, "this file system refused O_DIRECT at open; the open fallback test covers it"
    real = os.preadv

    def refuse_direct(fd, buffers, offset):
        if fd in direct_fds:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", refuse_direct)
    with caplog.at_level(logging.WARNING, logger="layerstream.tiers.disk"):
        trace = train_steps(fed, 2)
    assert sum("buffered I/O instead" in r.getMessage() for r in caplog.records) == 1
    assert_traces_equal(train_steps(_peft(_load(checkpoint)), 2), trace)


def test_a_tensor_stored_in_another_dtype_is_refused_by_name(checkpoint):
    config = layerstream.StreamConfig(device="cpu", slots=SLOTS, host_budget=_small_budget(checkpoint) // 2)
    with pytest.raises(LoadingError, match="does not cast"):
        layerstream.from_pretrained(checkpoint, dtype=torch.bfloat16, stream=config)


def test_a_budget_below_the_ring_is_refused_before_loading(checkpoint):
    with pytest.raises(StreamConfigError, match="cannot hold the disk tier's staging ring"):
        _load(checkpoint, _layer_bytes(checkpoint))


def test_a_change_to_a_disk_layer_weight_is_refused(checkpoint):
    fed = _load(checkpoint, _small_budget(checkpoint))
    index = layerstream.get_runtime(fed).disk.tiers.disk[0]
    with torch.no_grad():
        fed.model.layers[index].mlp.up_proj.weight.mul_(2)
    with pytest.raises(StreamingError, match="read from disk each time"):
        fed(torch.tensor([[3, 4, 5]]))


def _written_pages_kib(directory) -> int:
    """KiB of this process's private copies of pages mapped from files in ``directory``: a
    write into a private map copies the page into anonymous memory (RAM)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:  # a mapping's first line
                inside = len(fields) >= 6 and fields[5].startswith(str(directory))
            elif inside and fields[0] == "Anonymous:":
                total += int(fields[1])
    return total


def test_a_load_state_dict_of_the_values_it_holds_is_taken_without_writing_and_training_stays_exact(checkpoint):
    """``model.load_state_dict(model.state_dict())``, and the same values in other tensors (a
    checkpoint's), into a model with disk layers: accepted, no key reported missing, nothing
    written into the files' map, and the next steps equal a RAM-fed run's."""
    ram, fed = _peft(_load(checkpoint)), _peft(_load(checkpoint, _small_budget(checkpoint)))
    assert_traces_equal(train_steps(ram, 1), train_steps(fed, 1))
    written = _written_pages_kib(checkpoint)
    for model in (ram, fed):
        result = model.load_state_dict(model.state_dict())
        assert not result.missing_keys and not result.unexpected_keys
    result = fed.load_state_dict({key: value.clone() for key, value in fed.state_dict().items()})
    assert not result.missing_keys and not result.unexpected_keys
    assert _written_pages_kib(checkpoint) == written, "the load wrote into the checkpoint's pages"
    assert_traces_equal(train_steps(ram, 2), train_steps(fed, 2))


def test_a_load_state_dict_that_changes_a_disk_layer_is_refused_before_anything_changes(checkpoint):
    """A load that would change a disk layer's weight (whose new value could never reach the
    GPU) is refused naming the tensor and the file, before any tensor changed (the embedding,
    a RAM layer and an adapter in the same state dict, loaded before that layer, included);
    the model then trains as a RAM-fed one."""
    ram, fed = _peft(_load(checkpoint)), _peft(_load(checkpoint, _small_budget(checkpoint)))
    tier = layerstream.get_runtime(fed).disk
    before = {key: value.clone() for key, value in fed.state_dict().items()}
    layer, path = tier.tiers.disk[-1], tier.layers[tier.tiers.disk[-1]].files[0].path
    weight = f"base_model.model.model.layers.{layer}.mlp.down_proj.base_layer.weight"
    earlier = [
        "base_model.model.model.embed_tokens.weight",
        f"base_model.model.model.layers.{tier.tiers.ram[0]}.mlp.up_proj.base_layer.weight",
        f"base_model.model.model.layers.{layer}.mlp.up_proj.lora_A.default.weight",
    ]
    changed = dict(before)
    for key in [weight, *earlier]:
        changed[key] = before[key] + 1
    with pytest.raises(StreamingError, match="Nothing was loaded") as caught:
        fed.load_state_dict(changed)
    assert weight in str(caught.value) and str(path) in str(caught.value) and "host_budget" in str(caught.value)
    after = fed.state_dict()
    assert all(torch.equal(after[key], value) for key, value in before.items())
    assert_traces_equal(train_steps(ram, 2), train_steps(fed, 2))


def test_the_lookahead_is_measured_and_the_ring_reused(checkpoint):
    fed = _peft(_load(checkpoint, _small_budget(checkpoint)))
    tier = layerstream.get_runtime(fed).disk
    train_steps(fed, 2)
    assert tier.lookahead.read_seconds is not None and tier.lookahead.visit_seconds is not None
    assert 1 <= tier.lookahead.depth <= tier.tiers.ring_regions - 1
    assert len(tier.regions) == tier.tiers.ring_regions < len(tier.tiers.disk)


def test_host_budget_is_a_setting_on_every_surface():
    from layerstream.config import parse_setting

    assert parse_setting("host_budget", "48GiB") == 48 << 30
    assert parse_setting("host_budget", "auto") == "auto"
    assert parse_setting("host_budget", "none") is None
    assert layerstream.StreamConfig(device="cpu", host_budget="2GiB").host_budget == 2 << 30
    with pytest.raises(StreamConfigError, match="host_budget"):
        layerstream.StreamConfig(device="cpu", host_budget="lots")
    assert disk.READERS > 1


def test_stream_model_of_a_model_beyond_host_budget_is_refused_with_what_to_do():
    model = tiny_model("llama", layers=3)
    with pytest.raises(StreamConfigError, match="layerstream.from_pretrained"):
        layerstream.stream_model(model, device="cpu", host_budget="1KiB")
    layerstream.stream_model(tiny_model("llama", layers=3), device="cpu", host_budget="1GiB")


def test_reads_in_flight_are_the_fewest_within_reach_of_the_fastest():
    from layerstream.decisions.disk import pick_readers

    assert pick_readers({1: 2.39e9, 4: 1.30e9}) == 1  # the GPU machine's disk: one reader is faster
    assert pick_readers({1: 1.0e9, 4: 3.2e9}) == 4  # an NVMe drive wants several
    assert pick_readers({1: 1.0e9, 4: 1.05e9}) == 1  # several must be clearly faster


@pytest.mark.parametrize("probed", [{1: 2.0e9, 4: 1.0e9}, {1: 1.0e9, 4: 3.0e9}])
def test_the_load_probes_the_disk_and_reads_as_many_at_once_as_it_chose(checkpoint, monkeypatch, caplog, probed):
    """The loader measures one reader against several on the disk layers' own bytes and keeps
    the faster; reads then never run more at once than that (a read that sleeps makes overlap
    visible), and the run stays exact."""
    import threading
    import time as time_mod

    monkeypatch.setattr(disk, "pick_readers", lambda rates: min(probed, key=lambda n: -probed[n]))
    running, most, lock = [0], [0], threading.Lock()
    read_now = disk.DiskTier._read_from_disk

    def counted(self, chunk, region):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time_mod.sleep(0.002)
        try:
            return read_now(self, chunk, region)
        finally:
            with lock:
                running[0] -= 1

    with caplog.at_level("WARNING", logger="layerstream"):
        model = _peft(_load(checkpoint, _small_budget(checkpoint)))
    tier = layerstream.get_runtime(model).disk
    chosen = tier.reads_at_once
    assert chosen == max(probed, key=probed.get)
    assert sorted(tier.probed) == [1, disk.READERS] and all(rate > 0 for rate in tier.probed.values())
    assert f"reads {chosen} at a time" in caplog.text
    assert layerstream.get_runtime(model).stats()["disk_reads_at_once"] == chosen
    monkeypatch.setattr(disk.DiskTier, "_read_from_disk", counted)
    resident = _peft(_load(checkpoint))
    assert_traces_equal(train_steps(model, steps=2), train_steps(resident, steps=2))
    assert most[0] == 1 if chosen == 1 else most[0] > 1


def test_a_read_error_while_the_load_probes_the_disk_names_the_file_and_leaves_no_file_open(checkpoint, monkeypatch):
    """The load-time probe of reads in flight reads the disk layers' files: an I/O error there
    is the disk tier's error (file named, what to check), and the failed load closes them."""
    import gc

    def open_in_checkpoint():
        gc.collect()  # models of earlier tests close their files when collected
        links = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                links.append(os.readlink(f"/proc/self/fd/{fd}"))
            except OSError:  # closed meanwhile
                pass
        return sorted(link for link in links if link.startswith(str(checkpoint)))

    read = os.preadv

    def failing(fd, buffers, offset):
        if os.readlink(f"/proc/self/fd/{fd}").startswith(str(checkpoint)):
            raise OSError(errno.EIO, "Input/output error")
        return read(fd, buffers, offset)

    before = open_in_checkpoint()
    monkeypatch.setattr(os, "preadv", failing)
    with pytest.raises(DiskReadError, match="Input/output error") as caught:
        _load(checkpoint, _small_budget(checkpoint))
    message = str(caught.value)
    assert ".safetensors" in message and "Check the disk" in message
    monkeypatch.setattr(os, "preadv", read)
    del caught  # its traceback holds the half-loaded model, whose weights map the files
    assert open_in_checkpoint() == before


def test_with_one_read_in_flight_the_next_read_starts_while_the_last_chunk_is_copied_out():
    """The gate on reads in flight holds only the disk read: copying a chunk out of the bounce
    buffer runs beside the next read, so one read in flight keeps the disk busy."""
    import threading
    import time as time_mod
    from types import SimpleNamespace

    events, lock = [], threading.Lock()

    def note(what):
        with lock:
            events.append(what)

    class SlowCopy:  # the bounce buffer: reading pieces out of it takes a while
        def __getitem__(self, key):
            note("copy starts")
            time_mod.sleep(0.05)
            note("copy ends")
            return np.zeros(key.stop - key.start, dtype=np.uint8)

    def read_from_disk(chunk, region):
        note("read")
        return SlowCopy()

    tier = SimpleNamespace(_in_flight=threading.BoundedSemaphore(1), _read_from_disk=read_from_disk)
    chunk = SimpleNamespace(lo=0, pieces=[(0, 8, 0)])
    region = np.zeros(16, dtype=np.uint8)
    threads = [threading.Thread(target=disk.DiskTier._read_chunk, args=(tier, chunk, region)) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert events.count("read") == 2
    assert events.index("read", 1) < events.index("copy ends"), "the second read waited for the first copy"


def test_the_run_measures_its_own_reads_and_leaves_a_wrong_probe_choice(checkpoint, monkeypatch, caplog):
    """The probe at load picked several reads at once on a disk that reads slower with
    several allowed in flight: the run's own reads measure both counts, it drops to one
    read at a time, says so, and stays exact."""
    import time as time_mod

    read_now = disk.DiskTier._read_from_disk

    def slower_with_several(self, chunk, region):
        time_mod.sleep(0.002 if self.reads_at_once == 1 else 0.024)  # 4 at once: at most a third of the speed
        return read_now(self, chunk, region)

    monkeypatch.setattr(disk, "pick_readers", lambda rates: disk.READERS)  # the probe's misleading verdict
    model = _peft(_load(checkpoint, _small_budget(checkpoint)))
    tier = layerstream.get_runtime(model).disk
    assert tier.reads_at_once == disk.READERS
    tier.choice.sample_bytes = 2 * max(r.nbytes for r in (layer.record for layer in tier.layers.values()))
    monkeypatch.undo()  # the real choice from here on
    monkeypatch.setattr(disk.DiskTier, "_read_from_disk", slower_with_several)
    resident = _peft(_load(checkpoint))
    with caplog.at_level("INFO", logger="layerstream"):
        got = train_steps(model, steps=3)
    stats = layerstream.get_runtime(model).stats()
    assert tier.reads_at_once == 1 and stats["disk_reads_at_once"] == 1
    assert set(tier.choice.rates) == {1, disk.READERS} and stats["disk_reads_at_once_changes"] == 1
    assert tier.choice.rates[1] > 1.5 * tier.choice.rates[disk.READERS]
    assert "now reads 1 at a time (measured in the run" in caplog.text
    assert_traces_equal(got, train_steps(resident, steps=3))


def test_a_forked_child_running_a_disk_fed_model_is_refused_instead_of_hanging(checkpoint):
    """A DataLoader worker is a fork: it has none of the tier's reader threads, so a read it
    started would never complete; a prefetch left by the parent's step would be waited on
    forever."""
    import multiprocessing

    fed = _peft(_load(checkpoint, _small_budget(checkpoint)))
    train_steps(fed, 1)  # the parent's reader threads exist and reads are in flight
    ids = batch(seed=0)

    def child(queue):
        torch.set_num_threads(1)  # as a DataLoader worker does: torch's parent thread pool is gone
        try:
            with torch.no_grad():
                fed(input_ids=ids)
            queue.put("ran")
        except Exception as exc:  # the child reports what it raised
            queue.put(f"{type(exc).__name__}: {exc}")

    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    process = context.Process(target=child, args=(queue,))
    process.start()
    process.join(60)
    if process.is_alive():
        process.kill()
    assert not queue.empty(), "the forked child hung"
    said = queue.get()
    assert said.startswith("ForkedChildError") and "num_workers=0" in said and str(os.getpid()) in said
