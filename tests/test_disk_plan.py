"""The disk tier's decisions (pure logic): the host budget in bytes, which layers stay in
host RAM, the staging ring, and the lookahead from measured read and visit times."""

import pytest

from layerstream.disk_plan import (
    MIN_RING_REGIONS,
    RING_REGIONS,
    ReadAhead,
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
    with pytest.raises(StreamConfigError, match=r"Raise host_budget to 2\.00 GiB"):
        split_tiers([GiB] * 4, GiB + 1)


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
