"""The disk tier: layers beyond host_budget are read from the checkpoint's own safetensors
files each time; a disk-fed run equals a RAM-fed one bit for bit, and every fault (a read
error, a short read, a file changed under the run, corrupted bytes) stops with an error
naming the file, never with wrong data."""

import errno
import logging
import os

import pytest
import torch
from disk_runs import SLOTS, disk_layer_tensor, flip_byte, layer_bytes, load_streamed, small_budget, with_lora

import layerstream
from layerstream.errors import DiskReadError, LoadingError, StreamConfigError, StreamingError
from layerstream.tiers import disk

from tiny import assert_traces_equal, batch, train_steps


def test_disk_fed_training_matches_ram_fed_bit_for_bit(checkpoint, device):
    ram = with_lora(load_streamed(checkpoint, device=device)).to(device)
    fed = with_lora(load_streamed(checkpoint, small_budget(checkpoint), device=device)).to(device)
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
    ram = with_lora(load_streamed(checkpoint))
    fed = with_lora(load_streamed(checkpoint, small_budget(checkpoint)))
    tier = layerstream.get_runtime(fed).disk
    chunks = [c for layer in tier.layers.values() for c in layer.chunks]
    assert len(chunks) > 10 * len(tier.layers), "many reads per layer"
    pieces = sum(len(c.pieces) for c in chunks)
    tensors = sum(len(layer.record.entries) for layer in tier.layers.values())
    assert all(c.hi - c.lo <= disk.IO_ALIGN for c in chunks)
    assert pieces > tensors, "some tensors are cut across chunk boundaries"
    assert_traces_equal(train_steps(ram, 2), train_steps(fed, 2))


def test_disk_fed_generation_matches_ram_fed(checkpoint, device):
    ram, fed = (
        load_streamed(checkpoint, device=device),
        load_streamed(checkpoint, small_budget(checkpoint), device=device),
    )
    ids = torch.randint(3, 90, (2, 6), generator=torch.Generator().manual_seed(3)).to(device)
    with torch.no_grad():
        want = ram.generate(ids, max_new_tokens=8, do_sample=False)
        got = fed.generate(ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(want, got)


def test_the_host_tensors_of_disk_layers_hold_the_checkpoint_values(checkpoint):
    ram, fed = load_streamed(checkpoint), load_streamed(checkpoint, small_budget(checkpoint))
    a, b = ram.state_dict(), fed.state_dict()
    assert list(a) == list(b)
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_silently_corrupted_bytes_change_the_run_negative_control(checkpoint, copy_of, device):
    """Without debug checksums a flipped byte on disk reaches the computation: the parity
    test above can fail."""
    ram = with_lora(load_streamed(checkpoint, device=device)).to(device)
    fed = with_lora(load_streamed(copy_of, small_budget(copy_of), device=device)).to(device)
    flip_byte(*disk_layer_tensor(fed))
    with pytest.raises(AssertionError):
        assert_traces_equal(train_steps(ram, 1, device=device), train_steps(fed, 1, device=device))


def test_debug_checksums_catch_a_corrupted_read_naming_the_file(copy_of, device):
    fed = with_lora(load_streamed(copy_of, small_budget(copy_of), device=device, checksum=True)).to(device)
    path, offset = disk_layer_tensor(fed)
    flip_byte(path, offset)
    with pytest.raises(DiskReadError, match="debug checksum") as caught:
        train_steps(fed, 1, device=device)
    assert str(path) in str(caught.value)


def test_a_file_changed_under_the_run_is_refused(copy_of):
    fed = with_lora(load_streamed(copy_of, small_budget(copy_of)))
    path, offset = disk_layer_tensor(fed)
    flip_byte(path, offset, keep_mtime=False)
    os.utime(path, ns=(os.stat(path).st_atime_ns, os.stat(path).st_mtime_ns + 10**9))
    with pytest.raises(DiskReadError, match="changed while the run used it") as caught:
        train_steps(fed, 1)
    assert str(path) in str(caught.value) and "Restore the file" in str(caught.value)


def test_a_file_changed_under_the_run_is_refused_at_the_pass_start(copy_of):
    """The check at each pass's start reads a disk layer's addresses through its tensors, which
    check their files: the change is refused there, before any layer of the pass computes."""
    fed = with_lora(load_streamed(copy_of, small_budget(copy_of)))
    runtime = layerstream.get_runtime(fed)
    path, _ = disk_layer_tensor(fed)  # in the middle disk layer's file
    record = runtime.disk.layers[runtime.disk.tiers.disk[len(runtime.disk.tiers.disk) // 2]].record
    assert record.host_region is None and record.fresh_deep()
    os.utime(path, ns=(os.stat(path).st_atime_ns, os.stat(path).st_mtime_ns + 10**9))
    with pytest.raises(DiskReadError, match="changed while the run used it"):
        record.fresh_deep()


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
        [sys.executable, "-c", TRUNCATED_THEN_READ, str(copy_of), str(small_budget(copy_of))],
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
    fed = with_lora(load_streamed(checkpoint, small_budget(checkpoint)))

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
    ram, fed = with_lora(load_streamed(checkpoint)), with_lora(load_streamed(checkpoint, small_budget(checkpoint)))
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
    fed = load_streamed(checkpoint, small_budget(checkpoint))
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
    fed = with_lora(load_streamed(checkpoint, small_budget(checkpoint)))
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
        fed = with_lora(load_streamed(checkpoint, small_budget(checkpoint)))
    monkeypatch.setattr(os, "open", real_open)
    warnings = [r for r in caplog.records if "buffered I/O instead of direct I/O" in r.getMessage()]
    assert len(warnings) == 1
    ram = with_lora(load_streamed(checkpoint))
    assert_traces_equal(train_steps(ram, 2), train_steps(fed, 2))
    assert layerstream.get_runtime(fed).stats()["direct_io"] is False


def test_a_direct_read_refused_mid_run_falls_back_and_stays_exact(checkpoint, monkeypatch, caplog):
    fed = with_lora(load_streamed(checkpoint, small_budget(checkpoint)))
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
    assert_traces_equal(train_steps(with_lora(load_streamed(checkpoint)), 2), trace)


def test_a_tensor_stored_in_another_dtype_is_refused_by_name(checkpoint):
    config = layerstream.StreamConfig(device="cpu", slots=SLOTS, host_budget=small_budget(checkpoint) // 2)
    with pytest.raises(LoadingError, match="does not cast"):
        layerstream.from_pretrained(checkpoint, dtype=torch.bfloat16, stream=config)


def test_a_budget_below_the_ring_is_refused_before_loading(checkpoint):
    with pytest.raises(StreamConfigError, match="cannot hold the disk tier's staging ring"):
        load_streamed(checkpoint, layer_bytes(checkpoint))


def test_a_change_to_a_disk_layer_weight_is_refused(checkpoint):
    fed = load_streamed(checkpoint, small_budget(checkpoint))
    index = layerstream.get_runtime(fed).disk.tiers.disk[0]
    with torch.no_grad():
        fed.model.layers[index].mlp.up_proj.weight.mul_(2)
    with pytest.raises(StreamingError, match="read from disk each time"):
        fed(torch.tensor([[3, 4, 5]]))


def test_a_cast_of_a_disk_layer_weight_is_refused_naming_the_cast(checkpoint):
    """A cast through ``.data`` of a weight too large to stay on the device: a disk layer
    cannot take it (a RAM layer takes the cast into the store; a disk layer's norms stay on
    the device, tests/tiers/test_disk_changes.py), and the refusal names the tensor and the
    two dtypes."""
    fed = load_streamed(checkpoint, small_budget(checkpoint))
    runtime = layerstream.get_runtime(fed)
    disk, ram = runtime.disk.tiers.disk[0], runtime.disk.tiers.ram[0]
    fed.model.layers[ram].mlp.up_proj.weight.data = fed.model.layers[ram].mlp.up_proj.weight.data.double()
    weight = fed.model.layers[disk].mlp.up_proj.weight
    weight.data = weight.data.double()
    with pytest.raises(StreamingError, match="read from disk each time") as refused:
        fed(torch.tensor([[3, 4, 5]]))
    said = str(refused.value)
    assert f"a cast of model.layers.{disk}.mlp.up_proj.weight from torch.float32 to torch.float64" in said
    assert "would not reach the copies on cpu" in said and "Keep the layers in host RAM" in said
    assert "model.layers.{}.".format(ram) not in said


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
    ram, fed = with_lora(load_streamed(checkpoint)), with_lora(load_streamed(checkpoint, small_budget(checkpoint)))
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
    ram, fed = with_lora(load_streamed(checkpoint)), with_lora(load_streamed(checkpoint, small_budget(checkpoint)))
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


def test_a_forked_child_running_a_disk_fed_model_is_refused_instead_of_hanging(checkpoint):
    """A DataLoader worker is a fork: it has none of the tier's reader threads, so a read it
    started would never complete; a prefetch left by the parent's step would be waited on
    forever."""
    import multiprocessing

    fed = with_lora(load_streamed(checkpoint, small_budget(checkpoint)))
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
