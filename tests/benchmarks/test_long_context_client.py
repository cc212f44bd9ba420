"""benchmarks/long_context_client.py, run as its CPU dry run for each client: TRL's sft.py
unchanged behind `layerstream run`, `layerstream train` with the long recipe, and a plain
Trainer script with `--layer_stream`, each against its plain baseline, and the rows made."""

import json
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import long_context_client  # noqa: E402
import long_context_clients  # noqa: E402
import plot_long_context  # noqa: E402

import common  # noqa: E402

STREAMED_START = {
    "sft": "layerstream run -m trl.scripts.sft ",
    "train": "layerstream train ",
    "trainer": "python ",
    "trainer-ends": "python ",
}
# the one flag beyond --layer_stream that a client is defined by (its row's options say it)
CLIENT_FLAG = {"trainer-ends": "--layer_stream_embeddings true"}
LAYERSTREAM_FLAGS = ("--layer_stream_", "--offload", "--mlp", "--loss-chunk", "--slots", "stream.offload")


def _argv(client, work):
    argv = ["--dry-run", "--client", client, "--cells", "1:256", "--baseline"]
    return argv + ["--work", str(work), "--out", str(work / "out")]


def _written(work):
    """The data's check file and the checkpoint's index, each (exists, mtime)."""
    paths = work / "data-words-256" / "checked.json", work / "tiny" / "model.safetensors.index.json"
    return [(p.exists(), p.exists() and p.stat().st_mtime_ns) for p in paths]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """The sft client's --work after its command with --prepare-only, and what that left before
    the run's command (sft_run) reuses it. Its tiny checkpoint is the dry runs' one, written
    once: the other clients copy it into their own --work, where the harness reuses a
    checkpoint whose index is there."""
    work = tmp_path_factory.mktemp("long-context-sft")
    assert long_context_client.main([*_argv("sft", work), "--prepare-only"]) == 0
    ran = (work / "runs").exists() or (work / "out" / "long-context-client.json").exists()
    return work, _written(work), ran


def _dry_run(client, work):
    assert long_context_client.main(_argv(client, work)) == 0
    attempts = json.loads((work / "out" / "long-context-client.json").read_text())
    rows = json.loads((work / "out" / "long-context.json").read_text())
    return client, attempts["attempts"], rows


@pytest.fixture(scope="module")
def sft_run(prepared):
    """The sft client's dry run, in the --work its --prepare-only command left."""
    return _dry_run("sft", prepared[0])


@pytest.fixture(scope="module", params=long_context_client.CLIENTS)
def dry_run(request, tmp_path_factory, prepared):
    client = request.param
    if client == "sft":
        return request.getfixturevalue("sft_run")
    work = tmp_path_factory.mktemp(f"long-context-{client}")
    shutil.copytree(prepared[0] / "tiny", work / "tiny")
    return _dry_run(client, work)


def test_the_streamed_run_is_the_users_command_with_no_layerstream_setting(dry_run):
    client, attempts, _ = dry_run
    streamed = [a for a in attempts if a["streamed"]]
    plain = [a for a in attempts if not a["streamed"]]
    assert streamed and plain and all(a["verdict"] == "trained" for a in attempts)
    assert all(a["alloc_retries"] == [] for a in attempts), "kept from the times file (none counted without CUDA)"
    for a in streamed:
        assert a["client"] == client and a["client_command"].startswith(STREAMED_START[client])
        command = a["client_command"]
        if client in CLIENT_FLAG:
            assert CLIENT_FLAG[client] in command
            command = command.replace(CLIENT_FLAG[client], "")
        assert not any(flag in command for flag in LAYERSTREAM_FLAGS)
        assert any(line.startswith("layerstream: streaming decoder layers") for line in a["layerstream_lines"])
    for a in plain:  # the baseline streams nothing
        assert a["client"] == long_context_clients.BASELINE_CLIENT[client]
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
    plain = long_context_clients.BASELINE_CLIENT[client]
    from importlib.metadata import version

    expected = (
        "Trainer script without --layer_stream"
        if plain == "trainer"
        else f"TRL {version('trl')} trl.scripts.sft, plain"
    )
    assert mine["baseline_client"].startswith(expected), "the run's own release, the plain script"
    assert 0.05 < mine["peak_host_rss_gib"] < 64, "the run's own peak host memory, in GiB"
    assert mine["options"] == long_context_client.CLIENT_OPTIONS.get(client, mine["options"])
    if client == "train":  # its baseline is TRL's script with other LoRA settings: no loss comparison
        assert "losses_equal" not in mine and mine["options"] == long_context_client.recipe_options()
    else:  # the streamed script's losses are the plain script's on the CPU, where both repeat
        assert mine["losses_equal"] is True


@pytest.mark.parametrize("truth, planned", [(38912, 40000), (38912, 36000), (38912, 38912)])
def test_the_walk_from_the_plan_finds_the_longest_in_a_few_attempts(monkeypatch, truth, planned):
    """Started at the plan's longest (rounded down to the granularity), the walk steps up
    while a length trains and down while it runs out of memory."""
    tried = []

    def attempt(ctx, streamed, cap, tokens):
        tried.append(tokens)
        return {"verdict": long_context_client.TRAINED if tokens <= truth else long_context_client.OOM}

    monkeypatch.setattr(long_context_client, "attempt", attempt)
    monkeypatch.setattr(long_context_client, "planned_longest", lambda checkpoint, client, cap: planned)
    args = long_context_client.parse(["--cap", "12", "--from-plan", "--work", "/tmp/unused"])
    ctx = long_context_client.Context(args, Path("/tmp/unused"), None, "", None, 0.0)
    assert long_context_client.walk_from_plan(ctx, "12GiB") == truth
    start = planned // 2048 * 2048
    assert tried[0] == start and len(tried) <= abs(truth - start) // 2048 + 2, tried
    assert truth in tried and truth + 2048 in tried, "the longest is one that trained, the next one did not"


def test_the_plan_the_walk_starts_from_is_the_clients_run(monkeypatch):
    """For TRL's sft.py under 12 GiB the plan fits more than the 36,864 tokens measured to
    train, and less for the plain Trainer script, whose float32 adapters keep more. The
    script's float32 embedding and head move to host memory where the three long-sequence
    settings leave a step over ("auto", the default), as trainer-ends asks from the start:
    the same longest, and more than with them kept on the GPU."""
    import long_context_clients
    from long_context_clients import CLIENT_ADAPTERS, planned_longest

    shape = ROOT / "configs" / "shapes" / "llama-3.1-8b.json"
    sft, trainer = planned_longest(shape, "sft", 12), planned_longest(shape, "trainer", 12)
    assert 36864 < sft and trainer < sft
    assert planned_longest(shape, "trainer-ends", 12) == trainer
    kept = dict(CLIENT_ADAPTERS["trainer"], stream_embeddings=False)
    monkeypatch.setitem(long_context_clients.CLIENT_ADAPTERS, "trainer", kept)
    assert planned_longest(shape, "trainer", 12) < trainer


def test_a_row_pairs_runs_of_one_gpu_and_merging_keeps_both_cards(tmp_path):
    """Attempts of the same name measured on another card are kept beside the first when
    merged, and a row's baseline is the plain run on its own card: an H100 baseline never
    divides an H200 step."""

    def run(name, streamed, gpu, step):
        return {
            "name": name,
            "kind": "streamed" if streamed else "resident",
            "streamed": streamed,
            "cap": "12GiB" if streamed else "whole",
            "tokens": 4096,
            "round": 1,
            "client": "sft",
            "shape": "llama3-8b",
            "vram_gib": 12.0 if streamed else None,
            "bench_command": "python benchmarks/long_context_client.py",
            "client_command": "x",
            "warmup_steps": 0,
            "verdict": long_context_client.TRAINED,
            "step_s": [step],
            "losses": [],
            "peak_allocated_gib": 1.0,
            "peak_reserved_gib": 1.0,
            "long_settings": None,
            "gpu": gpu,
        }

    h200, h100 = "NVIDIA H200", "NVIDIA H100 80GB HBM3"
    first = {
        "attempts": [
            run("streamed-12GiB-4096-round1", True, h200, 2.0),
            run("resident-whole-4096-round1", False, h200, 1.0),
        ]
    }
    second = {"attempts": [run("resident-whole-4096-round1", False, h100, 1.9)]}
    for name, payload in (("first.json", first), ("second.json", second)):
        (tmp_path / name).write_text(json.dumps(payload))
    out = tmp_path / "out"
    results = long_context_client.Results(
        out / "attempts.json", out / "rows.json", [tmp_path / "first.json", tmp_path / "second.json"], False
    )
    assert set(results.attempts) == {
        "streamed-12GiB-4096-round1",
        "resident-whole-4096-round1",
        "resident-whole-4096-round1-h200",
    }
    (row,) = results.rows()
    assert row["gpu"] == h200 and row["baseline_step_s"] == 1.0 and row["speed_vs_resident"] == 0.5
    assert results.attempts["resident-whole-4096-round1"]["gpu"] == h100
    assert common.card_of(h100) == "h100" and common.card_of(None) == "gpu"
    results.add(run("streamed-12GiB-4096-round1", True, h100, 3.0))  # measured now, on the H100
    assert results.attempts["streamed-12GiB-4096-round1-h200"]["step_s"] == [2.0], "the H200 attempt dropped"
    (row,) = results.rows()  # one row per client and cap, of one card's runs
    assert (row["step_s"], row["baseline_step_s"]) == ((2.0, 1.0) if row["gpu"] == h200 else (3.0, 1.9))


def test_prepare_only_writes_the_checkpoint_and_data_that_the_next_command_reuses(prepared, sft_run):
    """--prepare-only leaves the checkpoint and the rows in --work and runs no attempt; the next
    command with the same --work and cells (the sft client's dry run) reads them instead of
    writing them again."""
    work, written, ran = prepared
    assert [exists for exists, _ in written] == [True, True] and not ran
    assert _written(work) == written, "written again"
    _, attempts, _ = sft_run
    assert [(a["streamed"], a["verdict"]) for a in attempts] == [(True, "trained"), (False, "trained")]


def test_an_ablation_runs_the_streamed_command_with_its_flags_and_makes_no_row(prepared, tmp_path):
    """--streamed-flags appends arguments to the streamed run (what one setting costs, against
    the same client's auto run): they reach the run, its attempt is named by them, and it
    makes no row, since a row stands for the user's command with no layerstream flag."""
    shutil.copytree(prepared[0] / "tiny", tmp_path / "tiny")  # the dry runs' checkpoint, reused
    out = tmp_path / "out"
    flags = "--layer_stream_mlp_tile_tokens 64"
    argv = ["--dry-run", "--client", "trainer", "--cells", "1:256", "--work", str(tmp_path), "--out", str(out)]
    assert long_context_client.main(argv + ["--steps", "1", "--streamed-flags", flags]) == 0
    [ablation] = json.loads((out / "long-context-client.json").read_text())["attempts"]
    assert ablation["verdict"] == "trained" and ablation["streamed_flags"] == flags.split()
    assert ablation["name"] == "trainer-ablation-layer-stream-mlp-tile-tokens-64-streamed-1GiB-256-round1"
    assert ablation["client_command"].endswith(flags)
    assert any("mlp_tile_tokens=64" in line for line in ablation["layerstream_lines"]), "the flag reached the run"
    rows = json.loads((out / "long-context.json").read_text())
    assert not [row for row in rows if row["model"] == long_context_client.MODELS["tiny"]]


def test_the_same_loss_baseline_runs_with_the_streamed_runs_loss_chunk(prepared, tmp_path, monkeypatch):
    """--same-loss-baseline: the Trainer script's baseline runs with --layer_stream on the whole
    GPU, given the loss chunk its streamed run decided (here made to decide 64: the CPU's plan
    turns nothing on), and the row divides by it and names it."""
    monkeypatch.setattr(long_context_clients, "chunk_of", lambda attempt: 64)
    shutil.copytree(prepared[0] / "tiny", tmp_path / "tiny")
    out = tmp_path / "out"
    argv = ["--dry-run", "--client", "trainer", "--cells", "1:256", "--baseline", "--same-loss-baseline"]
    assert long_context_client.main([*argv, "--steps", "1", "--work", str(tmp_path), "--out", str(out)]) == 0
    streamed, baseline = json.loads((out / "long-context-client.json").read_text())["attempts"]
    assert baseline["name"] == "trainer-same-loss-chunk64-resident-whole-256-round1" and baseline["cap"] == "whole"
    assert baseline["verdict"] == "trained" and baseline["same_loss_for"] == streamed["name"] == baseline["follows"]
    given = " ".join(["--layer_stream true --layer_stream_loss_chunk_tokens 64", *long_context_clients.NOTHING_ELSE_ON])
    assert baseline["client_command"].endswith(given), "the chunk given, every other setting off"
    assert any("loss_chunk_tokens=64" in line for line in baseline["layerstream_lines"]), "the flag reached the run"
    (row,) = [r for r in json.loads((out / "long-context.json").read_text()) if r["model"].startswith("tiny")]
    assert row["baseline_client"] == long_context_clients.client_label("trainer-same-loss")
    assert row["baseline_step_s"] == baseline["median_timed_s"]


def test_a_same_loss_baseline_of_a_run_that_chunked_nothing_is_the_plain_script(prepared, tmp_path):
    shutil.copytree(prepared[0] / "tiny", tmp_path / "tiny")
    out = tmp_path / "out"
    argv = ["--dry-run", "--client", "trainer", "--cells", "1:256", "--baseline", "--same-loss-baseline"]
    assert long_context_client.main([*argv, "--steps", "1", "--work", str(tmp_path), "--out", str(out)]) == 0
    _, baseline = json.loads((out / "long-context-client.json").read_text())["attempts"]
    assert (
        baseline["name"] == "trainer-resident-whole-256-round1" and "--layer_stream" not in baseline["client_command"]
    )
    with pytest.raises(SystemExit):  # TRL's clients compute the same loss on both sides already
        long_context_client.parse(["--client", "sft", "--cells", "12:4096", "--same-loss-baseline"])
    with pytest.raises(SystemExit):  # the ends client streams its ends on purpose: its baseline is plain
        long_context_client.parse(["--client", "trainer-ends", "--cells", "12:4096", "--same-loss-baseline"])


def _run(name, streamed, client, chunk=None, round_=1, verdict="trained", gpu=None, flags=None):
    decided = {"loss_chunk_tokens": chunk} if chunk else {}
    record = {"name": name, "streamed": streamed, "client": client, "tokens": 4096, "round": round_}
    record.update(verdict=verdict, gpu=gpu, cap="12GiB" if streamed else "whole", streamed_flags=[])
    record["long_settings"] = {"auto_decided": decided} if streamed else None
    if flags is not None:
        record["baseline_flags"] = flags
    return record


def test_a_row_divides_by_the_same_loss_runs_given_its_own_chunk_on_its_own_card():
    streamed = _run("s", True, "trainer", chunk=512, gpu="H100")
    given = lambda chunk: ["--layer_stream_loss_chunk_tokens", str(chunk)]  # noqa: E731
    same = _run("same-512", False, "trainer-same-loss", gpu="H100", flags=given(512))
    other_chunk = _run("same-2048", False, "trainer-same-loss", gpu="H100", flags=given(2048))
    other_card = _run("same-512-h200", False, "trainer-same-loss", gpu="H200", flags=given(512))
    plain = _run("plain", False, "trainer", gpu="H100")
    runs = [same, other_chunk, other_card, plain]
    _, trained, whose = long_context_client.baseline_runs(runs, "trainer", 4096, streamed)
    assert (whose, [a["name"] for a in trained]) == ("trainer-same-loss", ["same-512"])
    same["verdict"] = "out of memory"  # where it did not train, the plain script's run is the baseline
    _, trained, whose = long_context_client.baseline_runs(runs, "trainer", 4096, streamed)
    assert (whose, [a["name"] for a in trained]) == ("trainer", ["plain"])
    unchunked = _run("s0", True, "trainer", gpu="H100")  # its loss is the plain script's
    _, trained, whose = long_context_client.baseline_runs(runs, "trainer", 4096, unchunked)
    assert (whose, [a["name"] for a in trained]) == ("trainer", ["plain"])
    _, trained, whose = long_context_client.baseline_runs([plain], "sft", 4096, streamed)
    assert whose == "sft" and trained == []


def test_a_rows_losses_are_compared_with_the_streamed_run_each_baseline_followed():
    """A row pools the streamed rounds of one code at its length, but a baseline's losses are
    compared with the run it followed: the one it names (a same-loss run), else the one of its round.
    Compared with an earlier round (other code, other masks), a pair that differs would pass
    for equal, and the other way round."""
    older = dict(_run("s-round2", True, "trainer", round_=2), losses=[1.0, 2.0])
    newer = dict(_run("s-round3", True, "trainer", round_=3), losses=[1.0, 2.5])
    same = dict(_run("same-round1", False, "trainer-same-loss"), same_loss_for="s-round3", losses=[1.0, 2.5])
    bases, runs = long_context_client.followed([same], [older, newer])
    assert (bases, runs) == ([same], [newer])
    plain = dict(_run("plain-round2", False, "trainer", round_=2), losses=[1.0, 2.0])
    assert long_context_client.followed([plain], [older, newer]) == ([plain], [older])
    orphan = _run("plain-round7", False, "trainer", round_=7)
    assert long_context_client.followed([orphan], [older, newer]) == ([], [])


def test_a_plain_baseline_names_the_trl_release_its_run_kept():
    label = long_context_client.baseline_label
    assert label("sft", {"versions": {"trl": "1.16.0"}}) == "TRL 1.16.0 trl.scripts.sft, plain, the whole GPU"
    assert label("sft", {"versions": None}) == "TRL's trl.scripts.sft, plain, the whole GPU"
    assert label("trainer", {}) == "Trainer script without --layer_stream, the whole GPU"


def test_a_same_loss_run_given_the_chunk_alone_counts_only_where_auto_turned_nothing_else_on():
    """Same-loss baselines are given every other long-sequence setting off (left at "auto",
    a length near the whole GPU would turn them on). An earlier run given the chunk alone ran
    the same settings where "auto" turned nothing on, and is still its row's baseline and a
    round of the series; where "auto" did turn something on, it is neither."""
    streamed = _run("s", True, "trainer", chunk=512, gpu="H100")
    given = long_context_clients.same_loss_flags(streamed)
    assert (
        given[:2] == ["--layer_stream_loss_chunk_tokens", "512"] and given[2:] == long_context_clients.NOTHING_ELSE_ON
    )
    older = _run("trainer-same-loss-chunk512-resident-whole-4096-round1", False, "trainer-same-loss", gpu="H100")
    older.update(baseline_flags=given[:2], long_settings={"auto_decided": None}, kind="resident", streamed_flags=[])
    _, trained, whose = long_context_client.baseline_runs([older], "trainer", 4096, streamed)
    assert (whose, trained) == ("trainer-same-loss", [older])
    attempts = {older["name"]: older}
    name, round_ = long_context_clients.attempt_name(
        attempts, "resident", "whole", 4096, "trainer-same-loss", [], given
    )
    assert (name, round_) == ("trainer-same-loss-chunk512-resident-whole-4096-round2", 2)
    older["long_settings"] = {"auto_decided": {"offload_activations": 1}}  # it ran offloaded: not resident
    _, trained, whose = long_context_client.baseline_runs([older], "trainer", 4096, streamed)
    assert trained == [] and whose == "trainer-same-loss"
    name, round_ = long_context_clients.attempt_name(
        attempts, "resident", "whole", 4096, "trainer-same-loss", [], given
    )
    assert (name, round_) == ("trainer-same-loss-chunk512-resident-whole-4096-round2", 2), "a taken name is skipped"


def _pair_run(name, streamed, client, losses, follows=None, **fields):
    record = _run(name, streamed, client, gpu="H100", **fields)
    if follows:
        record["follows"] = follows
    record.update(kind="streamed" if streamed else "resident", shape="llama3-8b", bench_command="b")
    record.update(client_command="c", warmup_steps=1, step_s=[10.0] * 3, losses=losses, peak_allocated_gib=1.0)
    record.update(peak_reserved_gib=1.0, vram_gib=12.0 if streamed else None, versions={"trl": "1.16.0"})
    return record


def test_a_row_compares_each_baseline_with_its_own_run_only():
    """Two pairs, each equal within itself, differ between them (other code): the row's losses
    are equal. A baseline named after another round's run is paired with the run it names."""
    given = long_context_clients.same_loss_flags({"long_settings": {"auto_decided": {"loss_chunk_tokens": 512}}})
    first = _pair_run("s-round3", True, "trainer", [12.50, 12.46], chunk=512, round_=3)
    second = _pair_run("s-round4", True, "trainer", [12.47, 12.44], chunk=512, round_=4)
    bases = [
        _pair_run("b-round1", False, "trainer-same-loss", [12.50, 12.46], flags=given, follows="s-round3"),
        _pair_run("b-round2", False, "trainer-same-loss", [12.47, 12.44], flags=given, follows="s-round4", round_=2),
    ]
    (row,) = long_context_client.rows_from([first, second, *bases])
    assert row["losses_equal"] is True and row["max_loss_difference"] == 0.0
    bases[1]["losses"] = [12.47, 12.45]  # the control: one pair differs, and the row says by how much
    (row,) = long_context_client.rows_from([first, second, *bases])
    assert row["losses_equal"] is False and row["max_loss_difference"] == pytest.approx(0.01)


def test_a_rows_rounds_are_its_last_rounds_code_with_the_baselines_beside_them(monkeypatch):
    """Rounds of older code measured that code: a row pools the rounds whose src/ is its last
    round's (commits that changed only docs or benchmarks ran the same code), divided by the
    baselines that ran beside those rounds."""
    trees = {"c-old": "tree-1", "c-new": "tree-2", "c-docs": "tree-2"}
    monkeypatch.setattr(common, "code_of", lambda commit: trees.get(commit, commit))
    given = long_context_clients.same_loss_flags({"long_settings": {"auto_decided": {"loss_chunk_tokens": 512}}})
    old = dict(_pair_run("s-round1", True, "trainer", [12.5], chunk=512), commit="c-old", step_s=[20.0] * 3)
    new = dict(_pair_run("s-round2", True, "trainer", [12.5], chunk=512, round_=2), commit="c-new")
    docs = dict(_pair_run("s-round3", True, "trainer", [12.5], chunk=512, round_=3), commit="c-docs")
    old_base = dict(
        _pair_run("b-round1", False, "trainer-same-loss", [12.5], flags=given, follows="s-round1"),
        commit="c-old",
        step_s=[5.0] * 3,
    )
    new_base = dict(
        _pair_run("b-round2", False, "trainer-same-loss", [12.5], flags=given, follows="s-round3", round_=2),
        commit="c-docs",
        step_s=[9.0] * 3,
    )
    (row,) = long_context_client.rows_from([old, new, docs, old_base, new_base])
    assert row["attempts"] == ["s-round2", "s-round3", "b-round2"]
    assert (row["step_s"], row["baseline_step_s"]) == (10.0, 9.0)
    trees["c-old"] = "tree-2"  # the control: the same code, every round and baseline pooled
    (row,) = long_context_client.rows_from([old, new, docs, old_base, new_base])
    assert row["attempts"] == ["s-round1", "s-round2", "s-round3", "b-round1", "b-round2"]
    assert row["step_s"] == 10.0 and row["baseline_step_s"] == 7.0


def test_attempts_recorded_code_decides_and_a_modified_tree_matches_only_itself(monkeypatch):
    """Each attempt records a hash of its code as it runs, which decides with no git at hand;
    without one, a commit with uncommitted changes, or none beside a recorded one, is another code."""
    monkeypatch.setattr(common, "code_of", lambda commit: "one-tree")  # every commit: the same src/
    run = lambda **fields: dict(_pair_run("s", True, "trainer", [1.0]), **fields)  # noqa: E731
    assert common.same_code(run(code="a", commit="c1"), run(code="a", commit="c2"))
    assert not common.same_code(run(code="a", commit="c1"), run(code="b", commit="c1")), "the hash decides"
    assert common.same_code(run(commit="c1"), run(code="b", commit="c2")), "an older attempt: by git"
    assert not common.same_code(run(commit="c1+modified"), run(commit="c1+modified"))
    modified = run(commit="c1+modified")
    assert common.same_code(modified, modified)
    assert common.same_code(run(), run()), "attempts from before commits were kept pool as before"
    assert not common.same_code(run(), run(code="a")) and not common.same_code(run(commit=None), run(commit="c1"))
    assert len(common.code_hash()) == 16 and common.code_hash() == common.code_hash()


def test_a_row_says_where_a_later_run_did_not_fit_and_where_its_baselines_ran_apart():
    given = long_context_clients.same_loss_flags({"long_settings": {"auto_decided": {"loss_chunk_tokens": 512}}})
    trained = _pair_run("s-round1", True, "trainer", [12.5], chunk=512)
    base = _pair_run("b-round1", False, "trainer-same-loss", [12.5], flags=given, follows="s-round1")
    (row,) = long_context_client.rows_from([trained, base])
    assert "failed_since" not in row and "baseline_note" not in row
    later = dict(_pair_run("s-round2", True, "trainer", [], chunk=512, round_=2), verdict="out of memory")
    (row,) = long_context_client.rows_from([trained, base, later])
    assert row["failed_since"] == ["s-round2"] and row["max_tokens"] == 4096
    base["follows"] = "s-round0"  # a baseline that ran beside no round of the row
    (row,) = long_context_client.rows_from([trained, base])
    assert row["baseline_step_s"] == 10.0 and "ran beside" in row["baseline_note"]


def test_an_attempts_code_is_the_src_tree_at_its_commit():
    import subprocess

    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    tree = subprocess.run(["git", "rev-parse", "HEAD:src"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    assert common.code_of(head) == tree and common.code_of(head[:7]) == tree
    assert common.code_of(f"{head[:7]}+modified") == f"{tree}+modified"
    assert common.code_of("not-a-commit") == "not-a-commit", "a commit this checkout lacks stands for itself"
    assert common.code_of(None) is None and common.same_code({}, {"commit": None})


def test_a_run_renamed_for_its_card_keeps_the_baselines_that_follow_it():
    """Merged beside a namesake from another card, a run takes its card's name, and its own
    card's baselines that named it name it still; the other card's keep the plain name."""
    runs = {}
    h100 = dict(_run("s-round1", True, "trainer", gpu="H100"))
    base = dict(_run("b-round1", False, "trainer-same-loss", gpu="H100"), follows="s-round1", same_loss_for="s-round1")
    common.keep_by_card(runs, h100)
    common.keep_by_card(runs, base)
    common.keep_by_card(runs, dict(_run("s-round1", True, "trainer", gpu="H200")))
    assert set(runs) == {"s-round1", "s-round1-h100", "b-round1"}
    assert runs["b-round1"]["follows"] == runs["b-round1"]["same_loss_for"] == "s-round1-h100"


def test_an_older_same_loss_run_whose_log_turned_a_setting_on_is_not_its_baseline():
    """A chunk-only run that stopped before its first log records no decision, but its lines
    say what "auto" turned on: it did not run resident, so it is not a same-loss baseline."""
    given = long_context_clients.same_loss_flags({"long_settings": {"auto_decided": {"loss_chunk_tokens": 512}}})
    older = dict(_run("b", False, "trainer-same-loss"), baseline_flags=given[:2])
    older["long_settings"] = {"auto_decided": None, "lines": []}
    assert long_context_clients.ran_as_given(older, given)
    older["long_settings"]["lines"] = ["layerstream: ... offload_activations='auto' is on (frees 19.94 GiB)"]
    assert not long_context_clients.ran_as_given(older, given)
