"""The committed long-context results: each row is the run its result file recorded, the
table in docs/workloads.md is those rows, and the plot draws them (no GPU)."""

import json
import re
import statistics
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
ROWS = json.loads((RESULTS / "long-context.json").read_text())
sys.path.insert(0, str(ROOT / "benchmarks"))
import plot_long_context  # noqa: E402

KEYS = {
    "model",
    "quantization",
    "vram_gib",
    "max_tokens",
    "step_s",
    "tokens_per_s",
    "baseline_step_s",
    "client",
    "command",
}


# the docs table's client column
CLIENT_NAMES = {"harness": "harness", "sft": "TRL sft.py", "train": "layerstream train", "trainer": "Trainer script"}


def _label(row: dict) -> str:
    return (
        f"{plot_long_context.size_of(row)}, {row['vram_gib']:g} GiB, {CLIENT_NAMES[plot_long_context.client_of(row)]}"
    )


def _recorded(row: dict) -> list:
    """The runs the row's result file recorded at the row's cap and length: the harness's
    rows, or the streamed attempts of the client benchmark that trained."""
    recorded = json.loads((RESULTS / row["result_file"]).read_text())
    if isinstance(recorded, dict):  # long_context_client.py's attempts file
        recorded = [
            dict(a, step_s=a["median_timed_s"], step_s_list=a["step_s"], max_tokens=a["tokens"])
            for a in recorded["attempts"]
            if a["streamed"]
            and a["verdict"] == "trained"
            and a.get("client", "sft") == plot_long_context.client_of(row)
        ]
    return [
        r
        for r in recorded
        if r["vram_gib"] == row["vram_gib"] and r.get("tokens", r.get("max_tokens")) == row["max_tokens"]
    ]


@pytest.mark.parametrize("row", ROWS, ids=_label)
def test_each_row_is_the_run_its_result_file_recorded(row):
    assert KEYS <= set(row)
    # which command produced the row: the project's harness is labelled as such
    assert row["command"].startswith(("python ", "layerstream ", "accelerate ", "trl "))
    if plot_long_context.client_of(row) == "harness":
        assert row["command"].startswith("python benchmarks/long_context.py ")
    else:  # the benchmark ran the user's command, with no layerstream flag but the client's own
        assert row["command"].startswith("python benchmarks/long_context_client.py ")
        start = {"sft": "layerstream run -m trl.scripts.sft ", "train": "layerstream train ", "trainer": "python "}
        assert row["client_command"].startswith(start[plot_long_context.client_of(row)])
        assert "--layer_stream_" not in row["client_command"] and "--offload" not in row["client_command"]
    assert row["tokens_per_s"] == pytest.approx(row["max_tokens"] / row["step_s"])
    same = _recorded(row)
    assert same and _step_of(row, same) == row["step_s"]
    assert same[0].get("baseline_step_s") in (row["baseline_step_s"], None)


def _step_of(row: dict, recorded: list) -> float:
    """The row's step as its recorded runs give it: the harness's row itself, or the median of
    the timed steps (after each run's warm-up) of the client attempts the row names, pooled."""
    named = [r for r in recorded if r.get("name") in row.get("attempts", [])]
    if not named:
        return recorded[0]["step_s"]
    return statistics.median(t for r in named for t in r["step_s_list"][r["warmup_steps"] :])


def _docs_table() -> dict:
    page = (ROOT / "docs" / "workloads.md").read_text()
    section = page.split("## Long sequences on a small GPU", 1)[1].split("\n## ", 1)[0]
    cells = [
        [c.strip() for c in line.strip("|").split("|")]
        for line in section.splitlines()
        if re.match(r"\| (8|70)B, ", line)
    ]
    return {f"{c[0]}, {c[1]}": c for c in cells}


def test_the_docs_table_is_the_committed_rows():
    table = _docs_table()
    assert set(table) == {_label(row) for row in ROWS}
    for row in ROWS:
        _, _, tokens, _, step, baseline, ratio = table[_label(row)]
        assert int(tokens.replace(",", "")) == row["max_tokens"]
        assert step == f"{row['step_s']:.2f}"
        if row["baseline_step_s"] is None:
            assert baseline == "none fits" and ratio == ""
        else:
            assert baseline == f"{row['baseline_step_s']:.2f}"
            assert ratio == f"{row['baseline_step_s'] / row['step_s']:.3f}"


def test_the_plot_draws_every_row_with_its_speed_against_the_baseline(tmp_path):
    points = plot_long_context.measured_points(ROWS)
    assert sum(len(p) for by in points.values() for p in by.values()) == len(ROWS)
    for row in ROWS:
        series = points[plot_long_context.size_of(row)][plot_long_context.client_of(row)]
        (point,) = [p for p in series if p[0] == row["vram_gib"]]
        base = row["baseline_step_s"]
        assert point[1] == row["max_tokens"]
        assert point[2] == (pytest.approx(base / row["step_s"]) if base else None)
    picture = tmp_path / "long-context.png"
    assert plot_long_context.main(["--out", str(picture)]) == 0
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    empty = tmp_path / "empty.json"
    empty.write_text("[]")
    assert plot_long_context.main(["--results", str(empty), "--out", str(tmp_path / "never.png")]) == 1
    assert not (tmp_path / "never.png").exists()


def test_every_client_attempt_names_a_committed_log_or_says_why_not():
    """An attempt's log is what its figures can be checked against: committed beside the
    attempts file, or (attempts whose logs stayed on the machine) none, with a ``log_note``."""
    folder = RESULTS / "long-context"
    attempts = json.loads((folder / "long-context-client.json").read_text())["attempts"]
    for attempt in attempts:
        if attempt["log"] is None:
            assert attempt["log_note"], attempt["name"]
            continue
        assert (folder / attempt["log"]).is_file(), f"{attempt['name']}: {attempt['log']} is not committed"
