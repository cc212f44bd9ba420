"""The committed generation results: the table in docs/workloads.md is rl.json's rows as
measured (no GPU)."""

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ROWS = json.loads((ROOT / "benchmarks" / "results" / "rl.json").read_text())["rows"]
RUNTIME_WINDOW = "as the runtime leaves it"


def _docs_rows() -> list:
    page = (ROOT / "docs" / "workloads.md").read_text()
    section = page.split("## Generation", 1)[1].split("\n## ", 1)[0]
    return [
        [c.strip() for c in line.strip("|").split("|")]
        for line in section.splitlines()
        if re.match(r"\| (whole GPU|\d+ GiB) \|", line)
    ]


def test_the_generation_table_is_the_committed_rows_with_the_runtimes_window():
    measured = [r for r in ROWS if r["trainer"] == "generate" and r["window"] == RUNTIME_WINDOW]
    table = _docs_rows()
    assert len(table) == len(measured) > 0
    for cells, row in zip(table, measured):
        cap, batch, window, step, resident, ratio, ms, bound = cells
        assert cap == row["cap"].replace("GiB", " GiB")
        assert int(batch) == row["generations"]
        assert window == f"{row['window_layers']} of {row['layers']}"
        assert step == f"{row['step_s']:.2f}"
        if row["resident_step_s"] is None:  # no resident run in the streamed run's process
            assert resident == ratio == "-"
        else:
            assert resident == f"{row['resident_step_s']:.2f}"
            assert ratio == f"{row['speed_vs_resident']:.2f}"
        assert ms == f"{row['decode_ms_per_token_step']:.1f}"
        bound_ms = row["copy_bound_ms_per_token_step"]
        assert bound == (f"{bound_ms:.1f}" if bound_ms else "0")


def test_each_row_names_the_command_that_measured_it():
    for row in ROWS:
        assert all(c.startswith("python benchmarks/rl.py ") for c in row["command"])
