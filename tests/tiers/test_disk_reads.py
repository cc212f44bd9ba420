"""How the disk tier reads: the lookahead and its ring, how many reads fly at once, the
load's probe of the disk and the run's own measurement, and its budget on every surface."""

import errno
import os

import numpy as np
import pytest
from disk_runs import load_streamed, small_budget, with_lora

import layerstream
from layerstream.errors import DiskReadError, StreamConfigError
from layerstream.tiers import disk

from tiny import assert_traces_equal, tiny_model, train_steps


def test_the_lookahead_is_measured_and_the_ring_reused(checkpoint):
    fed = with_lora(load_streamed(checkpoint, small_budget(checkpoint)))
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
        model = with_lora(load_streamed(checkpoint, small_budget(checkpoint)))
    tier = layerstream.get_runtime(model).disk
    chosen = tier.reads_at_once
    assert chosen == max(probed, key=probed.get)
    assert sorted(tier.probed) == [1, disk.READERS] and all(rate > 0 for rate in tier.probed.values())
    assert f"reads {chosen} at a time" in caplog.text
    assert layerstream.get_runtime(model).stats()["disk_reads_at_once"] == chosen
    monkeypatch.setattr(disk.DiskTier, "_read_from_disk", counted)
    resident = with_lora(load_streamed(checkpoint))
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
        load_streamed(checkpoint, small_budget(checkpoint))
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
    model = with_lora(load_streamed(checkpoint, small_budget(checkpoint)))
    tier = layerstream.get_runtime(model).disk
    assert tier.reads_at_once == disk.READERS
    tier.choice.sample_bytes = 2 * max(r.nbytes for r in (layer.record for layer in tier.layers.values()))
    monkeypatch.undo()  # the real choice from here on
    monkeypatch.setattr(disk.DiskTier, "_read_from_disk", slower_with_several)
    resident = with_lora(load_streamed(checkpoint))
    with caplog.at_level("INFO", logger="layerstream"):
        got = train_steps(model, steps=3)
    stats = layerstream.get_runtime(model).stats()
    assert tier.reads_at_once == 1 and stats["disk_reads_at_once"] == 1
    assert set(tier.choice.rates) == {1, disk.READERS} and stats["disk_reads_at_once_changes"] == 1
    assert tier.choice.rates[1] > 1.5 * tier.choice.rates[disk.READERS]
    assert "now reads 1 at a time (measured in the run" in caplog.text
    assert_traces_equal(got, train_steps(resident, steps=3))
