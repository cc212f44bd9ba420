"""mxfp4_dequantise.py on the CPU: the harness checks layerstream's dequantisation against
transformers' function before timing either, and writes what it timed."""

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import mxfp4_dequantise  # noqa: E402


def test_the_benchmark_compares_before_it_times_and_writes_its_rows(tmp_path):
    out = tmp_path / "rows.json"
    assert mxfp4_dequantise.main(["--device", "cpu", "--experts", "1", "--repeats", "1", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {row["shape"] for row in rows} == set(mxfp4_dequantise.SHAPES)
    assert all(row["exact"] and row["transformers_ms"] > 0 and row["layerstream_ms"] > 0 for row in rows)


def test_the_benchmark_stops_where_the_values_differ(monkeypatch):
    """Negative control: a dequantisation that gives other values is not timed."""
    real = mxfp4_dequantise.packed_experts.dequantise
    monkeypatch.setattr(
        mxfp4_dequantise.packed_experts,
        "dequantise",
        lambda b, s, dtype: real(b, s, dtype) * torch.tensor(2.0, dtype=dtype),
    )
    with pytest.raises(SystemExit, match="differ"):
        mxfp4_dequantise.main(["--device", "cpu", "--experts", "1", "--repeats", "1"])
