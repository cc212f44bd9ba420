"""The benchmarks' caps: a fraction of the GPU they run on, never a cap larger than the GPU."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import common  # noqa: E402

GiB = 2**30
H100 = 81559 * 2**20  # what torch reports for an H100 80GB HBM3


def test_a_cap_within_the_gpu_is_its_share_of_the_gpu():
    assert common.cap_fraction(12 * GiB, H100) == 12 * GiB / H100
    assert common.cap_fraction(H100, H100) == 1.0


def test_a_cap_above_the_gpu_is_refused_rather_than_recorded_as_run():
    with pytest.raises(SystemExit, match="80.0 GiB is more than this GPU's 79.6 GiB"):
        common.cap_fraction(80 * GiB, H100)
