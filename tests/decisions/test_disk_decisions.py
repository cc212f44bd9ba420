"""The disk tier's decisions (pure logic): the host budget in bytes, which layers stay in
host RAM, the staging ring, and the lookahead from measured read and visit times."""

import pytest

from layerstream.decisions.disk import (
    MIN_RING_REGIONS,
    RING_REGIONS,
    ReadAhead,
    ReaderChoice,
    busy_seconds,
    resolve_host_budget,
    split_tiers,
    system_reserve,
)
from layerstream.errors import StreamConfigError
from layerstream.units import GiB, MiB


def test_auto_budget_is_the_available_ram_less_a_reserve_for_the_system():
    assert resolve_host_budget("auto", (40 * GiB, 64 * GiB)) == 40 * GiB - system_reserve(64 * GiB)
    assert system_reserve(64 * GiB) == int(6.4 * GiB)
    assert system_reserve(16 * GiB) == 4 * GiB  # never less than 4 GiB
    assert resolve_host_budget("auto", (2 * GiB, 16 * GiB)) == 0
    assert resolve_host_budget(12 * GiB, None) == 12 * GiB
    assert resolve_host_budget(None, None) is None
    with pytest.raises(StreamConfigError, match="give host_budget a size"):
        resolve_host_budget("auto", None)


def test_no_disk_tier_when_every_layer_fits_the_budget():
    tiers = split_tiers([100] * 8, 800)
    assert tiers.ram == tuple(range(8)) and tiers.disk == () and tiers.ring_bytes == 0
    assert split_tiers([100] * 8, None).disk == ()


def test_the_ring_is_reserved_first_and_ram_layers_are_spread_through_the_stack():
    layer = 10 * MiB
    budget = RING_REGIONS * layer + 3 * layer + layer // 2  # the ring and three and a half layers
    tiers = split_tiers([layer] * 12, budget)
    assert tiers.ring_regions == RING_REGIONS and tiers.region_bytes == layer
    assert len(tiers.ram) == 3 and len(tiers.disk) == 9
    assert sorted(tiers.ram + tiers.disk) == list(range(12))
    assert tiers.ring_bytes + len(tiers.ram) * layer <= budget
    gaps = [b - a for a, b in zip(tiers.ram, tiers.ram[1:])]
    assert min(gaps) >= 3, f"RAM layers should be spread, got {tiers.ram}"


def test_a_tight_budget_gets_a_smaller_ring_and_no_ram_layers():
    tiers = split_tiers([100] * 6, 250)
    assert tiers.ring_regions == MIN_RING_REGIONS and tiers.ram == () and len(tiers.disk) == 6


def test_a_budget_that_cannot_hold_the_ring_is_refused_with_what_to_change():
    with pytest.raises(StreamConfigError, match=r"Raise host_budget to 2\.00 GiB") as unquantized:
        split_tiers([GiB] * 4, GiB + 1)
    with pytest.raises(StreamConfigError, match=r"Raise host_budget to 2\.00 GiB") as quantized:
        split_tiers([GiB] * 4, GiB + 1, quantized=True)
    assert "load in NF4" in str(unquantized.value), "NF4 is advised where the layers are not NF4 yet"
    assert "load in NF4" not in str(quantized.value), "and not to layers that are NF4 already"


def test_lookahead_follows_measured_read_and_visit_times():
    ahead = ReadAhead(ring_regions=8)
    assert ahead.depth == 7 and ahead.wanted is None  # the whole ring until measured
    for _ in range(3):
        ahead.read_took(0.030)
        ahead.visit_took(0.010)
    assert ahead.wanted == 3 and ahead.depth == 3 and not ahead.ring_too_small
    fast = ReadAhead(ring_regions=8)
    fast.read_took(0.001)
    fast.visit_took(0.010)
    assert fast.depth == 1
    slow = ReadAhead(ring_regions=3)
    slow.read_took(0.100)
    slow.visit_took(0.010)
    assert slow.wanted == 10 and slow.depth == 2 and slow.ring_too_small


def test_busy_time_counts_overlapping_reads_once():
    assert busy_seconds([(0.0, 1.0), (0.5, 1.5), (3.0, 4.0)]) == pytest.approx(2.5)
    assert busy_seconds([(0.0, 2.0), (0.5, 1.0)]) == pytest.approx(2.0)
    assert busy_seconds([]) == 0.0


def test_a_step_reads_each_disk_layer_as_often_as_it_is_copied():
    from layerstream.plan.disk import disk_bytes_per_step

    sizes = [10] * 8
    # slots 2: forward copies layers 2..7, backward 0..5; every layer on disk
    assert disk_bytes_per_step(sizes, range(8), 2) == 10 * (6 + 6)
    assert disk_bytes_per_step(sizes, [0, 7], 2) == 20  # the turnaround layers: once each
    assert disk_bytes_per_step(sizes, [], 2) == 0


def test_the_disk_term_bounds_the_step_and_says_from_how_many_tokens_it_hides():
    from layerstream.plan.disk import FLOPS_PER_TOKEN_PARAM, disk_term, tokens_that_hide_the_disk

    sizes, params = [GiB] * 10, 10 * 2**29
    term = disk_term(sizes, 6 * GiB, 2, 2.0, 0.5, params, tokens=1000, tflops=100.0)
    assert term.tiers.ring_regions == 4 and len(term.tiers.ram) == 2
    assert term.disk_seconds == pytest.approx(term.disk_bytes_per_step / 2e9)
    assert term.step_seconds == pytest.approx(max(term.disk_seconds, 0.5, term.compute_seconds))
    hide = tokens_that_hide_the_disk(term, params, 100.0)
    assert FLOPS_PER_TOKEN_PARAM * params * hide / 100e12 >= term.disk_seconds
    assert FLOPS_PER_TOKEN_PARAM * params * (hide - 1) / 100e12 <= term.disk_seconds


def test_plan_prints_the_disk_term_and_measures_a_directory(tmp_path, capsys):
    from transformers import LlamaConfig

    from layerstream.commands import cli

    LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=8, num_attention_heads=4).save_pretrained(
        tmp_path
    )
    argv = ["plan", "--model", str(tmp_path), "--vram-budget", "8GiB", "--seq", "512"]
    cli.main(argv + ["--host-budget", "7MiB", "--disk-gbps", "3", "--tflops", "100"])
    out = capsys.readouterr().out
    assert "read from disk" in out and "hides behind compute from" in out and "step         at least" in out
    with pytest.raises(SystemExit):
        cli.main(argv + ["--host-budget", "12MiB"])  # no bandwidth
    assert "--disk-gbps" in capsys.readouterr().err
    assert cli.main(["plan", "--measure-disk", str(tmp_path), "--measure-bytes", "16MiB"]) == 0
    out = capsys.readouterr().out
    assert out.count("GB/s sequential read") == 2 and not list(tmp_path.glob(".layerstream-disk-probe"))


def test_measure_disk_reads_the_stored_files_where_a_directory_holds_some(tmp_path, capsys):
    """A checkpoint's or NF4 cache's own files are read, not a file just written (a cache in
    front of the disk may serve that one faster than the bytes a disk tier reads)."""
    from layerstream.commands import cli
    from layerstream.commands.disk import measure_files_gbps, stored_layer_files

    cache = tmp_path / "nf4-cache"
    cache.mkdir()
    for index, size in enumerate((3 * 2**20, 5 * 2**20 + 100)):
        (cache / f"layer-{index:05d}.nf4").write_bytes(bytes([index + 1]) * size)
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 2**20)
    files = stored_layer_files(tmp_path)
    assert [f.name for f in files] == ["layer-00001.nf4", "layer-00000.nf4"], "the cache, not the checkpoint"
    assert measure_files_gbps(files, 2**30, 2, chunk=2**20)[2] == 8 * 2**20 + 100, "every byte, tails included"
    assert measure_files_gbps(files, 6 * 2**20, 1, chunk=2**20)[2] == 6 * 2**20 + 100, "stops once it has the size"
    assert cli.main(["plan", "--measure-disk", str(tmp_path), "--measure-bytes", "4MiB"]) == 0
    out = capsys.readouterr().out
    assert out.count("stored file(s)") == 2 and not list(tmp_path.glob(".layerstream-disk-probe"))
    for layer in cache.iterdir():
        layer.unlink()
    assert [f.name for f in stored_layer_files(tmp_path)] == ["model.safetensors"]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli.main(["plan", "--measure-disk", str(empty), "--measure-bytes", "4MiB"]) == 0
    assert capsys.readouterr().out.count("a file just written") == 2


class _Disk:
    """A disk whose speed depends on the reads in flight: feeds one layer's read at a time
    to a ReaderChoice as the tier would, with the times that speed gives."""

    def __init__(self, choice, speed, layer=100, gap=0.0):
        self.choice, self.speed, self.layer, self.gap = choice, speed, layer, gap
        self.now, self.used = 0.0, []

    def read(self, layers=1):
        for _ in range(layers):
            count = self.choice.current
            start, self.now = self.now, self.now + self.layer / self.speed[count]
            self.used.append(count)
            self.choice.observe(count, self.layer, start, self.now)
            self.now += self.gap  # the ring stood full: no read in flight


@pytest.mark.parametrize("start", [1, 4])
def test_the_run_keeps_the_count_its_own_reads_find_fastest(start):
    """Whatever the probe at load chose, the reads measure each count and keep the faster;
    a wrong start costs one sample."""
    for fast, slow in ((1, 4), (4, 1)):
        choice = ReaderChoice((1, 4), start, sample_bytes=300, recheck_bytes=10**9)
        disk = _Disk(choice, {fast: 2.0, slow: 1.0})
        disk.read(20)
        assert choice.current == fast and disk.used[-8:] == [fast] * 8
        assert choice.rates == pytest.approx({fast: 2.0, slow: 1.0})
        assert disk.used.count(slow) <= 4  # one sample (3 reads) and the read skipped after the change


def test_the_counts_not_in_use_are_measured_again_and_a_drift_is_followed():
    choice = ReaderChoice((1, 4), 4, sample_bytes=300, recheck_bytes=3000)
    disk = _Disk(choice, {1: 2.0, 4: 1.0})
    disk.read(20)
    assert choice.current == 1
    disk.speed = {1: 1.0, 4: 3.0}  # the disk changed: several reads in flight now pay
    disk.read(40)
    assert choice.current == 4 and choice.rates[4] == pytest.approx(3.0)
    slow_reads = len(disk.used) - 20 - disk.used[20:].count(4)
    assert slow_reads < 40  # it did not wait for the end to notice
    negative = ReaderChoice((1, 4), 4, sample_bytes=300, recheck_bytes=10**9)
    fixed = _Disk(negative, {1: 2.0, 4: 1.0})
    fixed.read(20)
    fixed.speed = {1: 1.0, 4: 3.0}
    fixed.read(40)
    assert negative.current == 1, "without a recheck the drift is not seen (control)"


def test_time_with_no_read_in_flight_is_not_charged_to_the_disk():
    """Compute-bound: the ring stands full between reads. The rate is bytes over the time a
    read was in flight, so a count is not judged slow for the waiting."""
    choice = ReaderChoice((1, 4), 4, sample_bytes=300, recheck_bytes=10**9)
    disk = _Disk(choice, {1: 1.0, 4: 2.0}, gap=5.0)
    disk.read(20)
    assert choice.current == 4 and choice.rates == pytest.approx({1: 1.0, 4: 2.0})


def test_reads_started_at_the_old_count_do_not_count_for_the_new_one():
    choice = ReaderChoice((1, 4), 4, sample_bytes=200, recheck_bytes=10**9)
    assert choice.observe(4, 100, 0.0, 1.0) is None
    assert choice.observe(4, 100, 1.0, 2.0) == 1  # 4 measured; 1 not yet: try it
    assert choice.observe(4, 100, 2.0, 9.0) is None  # queued before the change: ignored
    assert choice.observe(1, 100, 3.0, 9.5) is None  # queued behind it: charged from 9.0
    assert 1 not in choice.rates
    assert choice.observe(1, 100, 9.5, 10.0) is None and choice.rates[1] == pytest.approx(200)
    assert choice.current == 1 and "1 at once" in str(choice)


@pytest.mark.parametrize("queued", [1, 3])
def test_reads_queued_behind_each_other_are_charged_only_their_own_disk_time(queued):
    """Disk-bound, reads wait in line: each is queued when the one ``queued`` places ahead
    ends. Measured from when it was queued, a read would also carry the reads ahead of it
    (a rate of a third); charged from the end of the one before, the rate is the disk's."""
    choice = ReaderChoice((1, 4), 1, sample_bytes=500, recheck_bytes=10**9)
    ends = [0.0] * queued
    for _ in range(12):
        start = ends[-queued]
        ends.append(ends[-1] + 100 / 2.0)  # 2 bytes/s, one read after the other
        choice.observe(1, 100, start, ends[-1])
        if choice.current != 1:
            break
    assert choice.rates[1] == pytest.approx(2.0)


def test_noise_does_not_flip_the_count_between_rechecks():
    """Four readers within the 10% margin of one, each read's time off by up to 3%: a count
    is left only for another that reads faster than it by the margin, so after the first
    comparison noise does not flip it (deciding each sample afresh by the fewest within 10%
    of the fastest flipped it six times here)."""
    import random

    rng = random.Random(0)
    choice = ReaderChoice((1, 4), 1, sample_bytes=300, recheck_bytes=10**9)
    disk = _Disk(choice, {1: 1.0, 4: 1.08})
    for _ in range(300):
        disk.speed = {1: rng.uniform(0.97, 1.03), 4: 1.08 * rng.uniform(0.97, 1.03)}
        disk.read()
    assert choice.changes <= 2
