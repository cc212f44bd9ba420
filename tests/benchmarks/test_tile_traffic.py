"""The tile-traffic benchmark's byte count (an operation's inputs and outputs, views left out)
and its committed result: the parts add up to the tiled step's extra bytes."""

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
RESULT = ROOT / "benchmarks" / "results" / "cpu" / "tile-traffic" / "tile-traffic-8192.json"

import tile_traffic  # noqa: E402


def test_a_product_counts_its_operands_and_output_and_a_view_nothing():
    a, b = torch.ones(8, 16), torch.ones(16, 4)
    with tile_traffic.Traffic() as traffic:
        out = a @ b
        out.view(-1)
    assert traffic.bytes == {"mm": (8 * 16 + 16 * 4 + 8 * 4) * 4}


def test_the_committed_parts_add_up_to_the_tiled_steps_extra_bytes():
    result = json.loads(RESULT.read_text())
    parts = result["extra_gb_by_part"]
    tiled = result["extra_gb_over_untiled"]["tiled"]
    three = [v for k, v in parts.items() if "dequantised" not in k]
    assert sum(three) == pytest.approx(tiled)
    assert all(v > 0 for v in three)
    untiled = result["variants"]["untiled"]["total_bytes"]
    assert result["untiled_gb"] == pytest.approx(untiled / 1e9)
    assert result["command"].startswith("python benchmarks/tile_traffic.py ")
