"""benchmarks/long_context_client.py, run as its CPU dry run: TRL's sft.py unchanged behind
`layerstream run` with no layerstream flag, against the plain script, and the rows it makes."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import long_context_client  # noqa: E402


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    work = tmp_path_factory.mktemp("long-context-client")
    out = work / "out"
    argv = ["--dry-run", "--cells", "1:256", "--baseline", "--work", str(work), "--out", str(out)]
    assert long_context_client.main(argv) == 0
    return json.loads((out / "long-context-client.json").read_text()), json.loads(
        (out / "long-context.json").read_text()
    )


def test_the_streamed_attempt_is_the_users_command_with_no_layerstream_flag(dry_run):
    attempts, _ = dry_run
    streamed = [a for a in attempts["attempts"] if a["streamed"]]
    plain = [a for a in attempts["attempts"] if not a["streamed"]]
    assert streamed and plain
    for a in streamed:
        assert a["client_command"].startswith("layerstream run -m trl.scripts.sft ")
        assert not any(word in a["client_command"] for word in ("--layer", "--offload", "--mlp", "--loss-chunk"))
    for a in plain:
        assert a["client_command"].startswith("python -m trl.scripts.sft ") or " -m trl.scripts.sft " in a["command"]
    assert all(a["verdict"] == "trained" for a in attempts["attempts"])


def test_the_row_names_its_client_and_keeps_the_harness_rows(dry_run):
    _, rows = dry_run
    committed = json.loads((ROOT / "benchmarks" / "results" / "long-context.json").read_text())
    harness = [r for r in committed if r["client"].startswith("harness")]
    assert all(r in rows for r in harness)
    (mine,) = [r for r in rows if r["client"].startswith("TRL ") and r["model"].startswith("tiny")]
    assert mine["command"].startswith("python benchmarks/long_context_client.py --dry-run")
    assert mine["max_tokens"] == 256 and mine["baseline_step_s"] > 0
    # the streamed script's losses are the plain script's on the CPU, where both are repeatable
    assert mine["losses_equal"] is True
    assert "TRL's fused log-prob head" in mine["long_settings"]["loss_head"]
