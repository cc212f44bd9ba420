"""benchmarks/long_context_client.py, run as its CPU dry run for each client: TRL's sft.py
unchanged behind `layerstream run`, `layerstream train` with the long recipe, and a plain
Trainer script with `--layer_stream`, each against its plain baseline, and the rows made."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import long_context_client  # noqa: E402
import plot_long_context  # noqa: E402

STREAMED_START = {
    "sft": "layerstream run -m trl.scripts.sft ",
    "train": "layerstream train ",
    "trainer": "python ",
}
LAYERSTREAM_FLAGS = ("--layer_stream_", "--offload", "--mlp", "--loss-chunk", "--slots", "stream.offload")


@pytest.fixture(scope="module", params=long_context_client.CLIENTS)
def dry_run(request, tmp_path_factory):
    client = request.param
    work = tmp_path_factory.mktemp(f"long-context-{client}")
    out = work / "out"
    argv = ["--dry-run", "--client", client, "--cells", "1:256", "--baseline", "--work", str(work), "--out", str(out)]
    assert long_context_client.main(argv) == 0
    attempts = json.loads((out / "long-context-client.json").read_text())
    rows = json.loads((out / "long-context.json").read_text())
    return client, attempts["attempts"], rows


def test_the_streamed_run_is_the_users_command_with_no_layerstream_setting(dry_run):
    client, attempts, _ = dry_run
    streamed = [a for a in attempts if a["streamed"]]
    plain = [a for a in attempts if not a["streamed"]]
    assert streamed and plain and all(a["verdict"] == "trained" for a in attempts)
    for a in streamed:
        assert a["client"] == client and a["client_command"].startswith(STREAMED_START[client])
        assert not any(flag in a["client_command"] for flag in LAYERSTREAM_FLAGS)
        assert any(line.startswith("layerstream: streaming decoder layers") for line in a["layerstream_lines"])
    for a in plain:  # the baseline streams nothing
        assert a["client"] == long_context_client.BASELINE_CLIENT[client]
        assert "layerstream" not in a["client_command"].split()[0] and "--layer_stream" not in a["client_command"]
        assert not any("streaming decoder layers" in line for line in a["layerstream_lines"])


def test_the_row_names_its_client_and_keeps_the_committed_rows(dry_run):
    client, _, rows = dry_run
    committed = json.loads((ROOT / "benchmarks" / "results" / "long-context.json").read_text())
    assert all(r in rows for r in committed)
    (mine,) = [r for r in rows if r["model"].startswith("tiny")]
    assert plot_long_context.client_of(mine) == client
    assert mine["command"].startswith(f"python benchmarks/long_context_client.py --dry-run --client {client}")
    assert mine["max_tokens"] == 256 and mine["baseline_step_s"] > 0
    if client == "train":  # its baseline is TRL's script with other LoRA settings: no loss comparison
        assert "losses_equal" not in mine and mine["options"] == long_context_client.recipe_options()
    else:  # the streamed script's losses are the plain script's on the CPU, where both repeat
        assert mine["losses_equal"] is True
