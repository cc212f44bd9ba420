"""rl.py, the online-RL and generation benchmark, on the CPU: ``--dry-run`` runs every part
on a tiny model (generation in process, TRL's grpo script resident and behind ``layerstream
run``, GRPOTrainer on a model built in memory) and its rows must say what a GPU run's would;
the rows and the merging of commands are checked on made-up runs too."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import rl  # noqa: E402
import rl_rows  # noqa: E402

ROW_KEYS = {
    "model",
    "quantization",
    "cap",
    "trainer",
    "generations",
    "completion_tokens",
    "step_s",
    "resident_step_s",
    "speed_vs_resident",
    "decode_ms_per_token_step",
    "window_layers",
    "target",
    "meets_target",
    "command",
}


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    work = tmp_path_factory.mktemp("rl")
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    argv = [sys.executable, str(ROOT / "benchmarks" / "rl.py"), "--dry-run", "--work", str(work)]
    argv += ["--profile-generate", str(work / "profiles")]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return dict(json.loads((work / "out" / "rl.json").read_text()), profiles=work / "profiles", traces=work / "traces")


def rows_of(result, trainer, **where):
    return [r for r in result["rows"] if r["trainer"] == trainer and all(r[k] == v for k, v in where.items())]


def test_every_row_has_the_columns_its_command_and_the_versions(dry_run):
    assert dry_run["rows"] and all(ROW_KEYS <= set(row) for row in dry_run["rows"])
    assert all(row["command"][0].startswith("python benchmarks/rl.py --dry-run") for row in dry_run["rows"])
    assert {"torch", "transformers", "trl", "peft", "bitsandbytes", "layerstream"} <= set(dry_run["machine"])
    assert all(row["step_s"] > 0 for row in dry_run["rows"])


def test_generation_rows_stream_what_the_window_leaves_and_decode_the_resident_tokens(dry_run):
    settings = rl.dry_settings()
    for batch in settings.batches:
        as_left = rows_of(dry_run, "generate", generations=batch, cap="whole GPU", window=rl_rows.WINDOWS["runtime"])
        all_in = rows_of(dry_run, "generate", generations=batch, cap="whole GPU", window=rl_rows.WINDOWS["all"])
        capped = rows_of(dry_run, "generate", generations=batch, cap="8GiB")
        assert len(as_left) == len(all_in) == len(capped) == 1, f"batch {batch}: one row per cap and window"
        (as_left,), (all_in,), (capped,) = as_left, all_in, capped
        for row in (as_left, all_in):
            assert row["same_tokens_as_resident"] is True
            assert row["resident_step_s"] > 0 and row["completion_tokens"] == settings.new_tokens
            assert row["target"].startswith("speed_vs_resident") == (row is as_left)
        for row in (as_left, capped):
            assert_streams_what_the_window_leaves(row)
        # with every layer in the window nothing is copied, and the decode term says so
        assert all_in["window_layers"] == all_in["layers"] and all_in["layer_loads_per_token_step"] == 0
        assert all_in["planner_layers_copied"] == 0 and all_in["copy_bound_ms_per_token_step"] == 0
        assert capped["cap_applied"] is False and capped["decode_ms_per_token_step"] > 0, "no GPU: no cap"
        # the command's resident rounds with the whole GPU bound the capped row too
        assert capped["bound_ms_per_token_step"] >= capped["resident_decode_ms_per_token_step"] > 0
        assert capped["fraction_of_bound"] > 0


def assert_streams_what_the_window_leaves(row):
    """Whatever window the runtime kept, the layers outside it are copied, every one each
    token step, and the planner's decode term counts them (none where the slots hold them all)."""
    streamed = row["layers"] - row["window_layers"]
    assert 0 <= row["window_layers"] <= row["layers"]
    assert row["planner_layers_copied"] == (streamed if streamed > row["slots"] else 0)
    if row["planner_layers_copied"]:
        assert row["layer_loads_per_token_step"] == row["planner_layers_copied"]
        assert row["copy_bound_ms_per_token_step"] > 0 and row["fraction_of_copy_bound"] > 0
    else:
        assert row["layer_loads_per_token_step"] == 0 and row["copy_bound_ms_per_token_step"] == 0


def test_the_grpo_rows_time_the_script_and_the_client_with_layerstreams_generation_figures(dry_run):
    settings = rl.dry_settings()
    (pair,) = rows_of(dry_run, "grpo", cap=settings.grpo_cap)
    assert pair["client"].startswith("trl.scripts.grpo") and pair["rounds"] == 1 and pair["failed_runs"] == []
    assert pair["resident_step_s"] > 0 and pair["speed_vs_resident"] > 0
    assert (pair["generations"], pair["completion_tokens"]) == (settings.generations, settings.completion_tokens)
    assert pair["losses_equal"] and pair["grad_norms_equal"], "the streamed script trains as the resident one"
    assert pair["adapters_equal"] is True and pair["adapter_step"] == settings.grpo_steps, pair.get("adapters_note")
    runs = [run for run in dry_run["runs"] if run.get("kind") == "grpo-pair"]
    assert all(any(norm > 0 for norm in run["grad_norms"]) for run in runs), "zero gradients: nothing to compare"
    generating, layers = pair["layerstream_generate"], rl.TINY["num_hidden_layers"]
    assert set(generating) == set(rl_rows.GENERATE_FIGURES) and generating["calls"] == 1
    assert (generating["layer_loads"] > 0) == (generating["window_layers"] < layers), "what the window leaves streams"
    assert set(pair["run_commands"]) == {"resident", "streamed"}
    (big,) = rows_of(dry_run, "grpo", cap=settings.big_cap)
    assert big["trains"] and big["resident_step_s"] is None
    where = big["where_time_goes"]
    assert 0 < where["generate_s"] < big["step_s"] and where["rest_of_step_s"] > 0
    assert (big["layerstream_generate"]["layer_loads"] > 0) == (big["window_layers"] < layers)
    assert where["generate_copy_s"] is None or where["generate_copy_s"] >= 0, "None: no copy was timed"
    assert big["completion_tokens"] == settings.big_completion_tokens


@pytest.fixture(scope="module")
def other_pair(tmp_path_factory):
    """The grpo-8b part alone with ``--grpo-quantization bf16 --grpo-trainer rloo
    --profile-grpo``: each run costs a minute, so the three options share one dry run (the
    module's dry run pairs the defaults, its GRPO runs unprofiled)."""
    work = tmp_path_factory.mktemp("rl-other-pair")
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    argv = [sys.executable, str(ROOT / "benchmarks" / "rl.py"), "--dry-run", "--work", str(work)]
    argv += ["--part", "grpo-8b", "--grpo-quantization", "bf16", "--grpo-trainer", "rloo"]
    argv += ["--profile-grpo", str(work / "profiles"), "--trace-decode", str(work / "traces")]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return dict(json.loads((work / "out" / "rl.json").read_text()), profiles=work / "profiles", traces=work / "traces")


def test_a_pair_of_another_trainer_and_quantization_has_its_own_row(other_pair):
    """``--grpo-quantization bf16`` runs the script without ``--load_in_4bit`` (LoRA on the bf16
    checkpoint); ``--grpo-trainer rloo`` runs TRL's rloo.py with the same arguments. The pair
    gets its own row, apart from the QLoRA GRPO pair's, its two runs training alike on
    gradients that are not zero."""
    trainer, quantization = "rloo", "bf16"
    result = other_pair
    (pair,) = rows_of(result, trainer, quantization=quantization)
    assert pair["client"] == f"trl.scripts.{trainer}, unchanged"
    assert pair["losses_equal"] and pair["grad_norms_equal"] and pair["failed_runs"] == []
    assert pair["adapters_equal"] is True, pair.get("adapters_note")
    runs = [run for run in result["runs"] if run.get("kind") == "grpo-pair"]
    assert {(run["trainer"], run["quantization"]) for run in runs} == {(trainer, quantization)}
    assert all(f"trl.scripts.{trainer}" in run["command"] for run in runs)
    assert all(("--load_in_4bit" in run["command"]) == (quantization == "nf4") for run in runs)
    assert all(any(norm > 0 for norm in run["grad_norms"]) for run in runs)


def test_each_run_of_a_traced_pair_profiles_a_few_token_steps_of_its_second_step(other_pair):
    """``--trace-decode``: each side's second step's generation, token steps 2-4 on the dry run
    (its 8 completion tokens), under torch's profiler inside TRL's script, summarised in the
    run and the row."""
    runs = [run for run in other_pair["runs"] if run.get("kind") == "grpo-pair"]
    assert len(runs) == 2
    for run in runs:
        trace = run["decode_trace"]
        assert trace["traced_forwards"] == [2, 4] and trace["forwards"] >= 5 and trace["trainer_step"] == 1, trace
        assert trace["trace"]["token_steps"] == 3 and trace["trace"]["cpu_ops_per_token_step"] > 0
        assert trace["host_ms_per_forward_median"] > 0 and "host_ms_per_forward" not in trace
        folder = other_pair["traces"] / run["name"]
        assert (folder / "decode-ops.txt").exists() and not (folder / "decode-trace.json.gz").exists()
        assert len(json.loads((folder / "decode-trace.json").read_text())["host_ms_per_forward"]) == trace["forwards"]
    (pair,) = rows_of(other_pair, "rloo", quantization="bf16")
    assert set(pair["decode_trace"]) == {"streamed", "resident"}


@pytest.mark.parametrize("forwards, traced", [(5, [3, 5]), (3, [3, 3]), (2, None), (30, [3, 18])])
def test_a_decode_trace_counts_the_token_steps_it_profiled(tmp_path, forwards, traced):
    """A call that ends inside the profiled steps counts the steps it ran (forward 3 to its
    last); one that ends before them profiles none; a longer one stops after COUNT."""
    import decode_trace

    tracer = decode_trace.Tracer(str(tmp_path), start=3, count=16)
    for _ in range(forwards):
        tracer.before(None, ())
        torch.ones(8).sum()
        tracer.after(None, (), None)
    summary = tracer.close()
    assert summary["traced_forwards"] == traced and len(summary["host_ms_per_forward"]) == forwards
    steps = summary.get("trace", {}).get("token_steps")
    assert steps == (traced[1] - traced[0] + 1 if traced else None)


def test_the_script_runs_unchanged_behind_the_launcher():
    settings = rl.Settings()
    plain = rl.script_command(Path("ckpt"), Path("data"), settings, Path("out"), streamed=False)
    streamed = rl.script_command(Path("ckpt"), Path("data"), settings, Path("out"), streamed=True)
    assert plain[0] == sys.executable and streamed[:2] == ["layerstream", "run"]
    assert plain[1:] == streamed[2:] and plain[1:3] == ["-m", "trl.scripts.grpo"]
    for flag, value in (("--num_generations", "8"), ("--max_completion_length", "256"), ("--use_vllm", "false")):
        assert plain[plain.index(flag) + 1] == value


def grpo_run(round_index, streamed, steps, name=None, planned=None):
    """A run's record as rl.py keeps it: ``steps`` its step times, ``planned`` the steps its
    command asked for (where a deadline stopped it earlier)."""
    return {
        "name": name or f"grpo-r{round_index}-{streamed}",
        "kind": "grpo-pair",
        "model": "llama-3.1-8b",
        "streamed": streamed,
        "round": round_index,
        "cap": "12GiB" if streamed else rl_rows.WHOLE,
        "returncode": 0,
        "step_s": steps,
        "generate_s": [s / 2 for s in steps],
        "losses": [0.0] * len(steps),
        "grad_norms": [1.0] * len(steps),
        "completion_lengths": [256] * len(steps),
        "layerstream": {"layerstream/generate_window_layers": [0, 20, 24, 24]} if streamed else {},
        "settings_used": {"generations": 8, "completion_tokens": 256, "steps": planned or len(steps)},
        "rl_command": f"python benchmarks/rl.py --part grpo-8b --round {round_index}",
        "command": f"capped.py round {round_index}",
    }


def test_a_pair_is_compared_over_the_rounds_both_sides_ran():
    runs = [
        grpo_run(1, False, [9.0, 9.0, 8.0, 8.0]),
        grpo_run(1, True, [20.0, 12.0, 10.0, 10.0]),
        grpo_run(2, False, [9.0, 9.0, 8.0, 8.0]),  # its streamed run never ran
    ]
    (row,) = rl_rows.grpo_pair_rows(runs)
    assert row["rounds"] == 1 and row["speed_vs_resident"] == pytest.approx(0.8) and row["meets_target"] is True
    assert row["step_s"] == 10.0 and row["resident_step_s"] == 8.0
    assert row["window_layers"] == 24, "the window of the timed steps, not of the first"
    assert row["decode_ms_per_token_step"] == pytest.approx(5.0 / 256 * 1e3)
    assert row["command"] == [
        "python benchmarks/rl.py --part grpo-8b --round 1",
        "python benchmarks/rl.py --part grpo-8b --round 2",
    ]
    slower = [*runs, grpo_run(2, True, [20.0, 12.0, 11.0, 11.0])]
    (row,) = rl_rows.grpo_pair_rows(slower)
    assert row["rounds"] == 2 and row["meets_target"] is False


def test_a_later_command_keeps_the_earlier_commands_runs(tmp_path):
    earlier = tmp_path / "earlier.json"
    earlier.write_text(json.dumps({"runs": [grpo_run(1, False, [9.0] * 4), grpo_run(1, True, [30.0] * 4)]}))
    results = rl.Results(tmp_path / "out", [str(earlier)])
    results.add([grpo_run(1, True, [10.0] * 4)])  # round 1's streamed run again: it replaces the earlier
    written = json.loads((tmp_path / "out" / "rl.json").read_text())
    assert sorted(run["name"] for run in written["runs"]) == ["grpo-r1-False", "grpo-r1-True"]
    (row,) = written["rows"]
    assert row["step_s"] == 10.0 and row["resident_step_s"] == 9.0


def test_a_dry_run_never_writes_into_the_results(tmp_path, monkeypatch):
    monkeypatch.delenv("OUT", raising=False)
    args = rl.parse(["--dry-run", "--work", str(tmp_path), "--out", str(ROOT / "benchmarks" / "results")])
    with pytest.raises(SystemExit, match="not results"):
        rl.output_folder(args)
    assert rl.output_folder(rl.parse(["--dry-run", "--work", str(tmp_path)])) == tmp_path / "out"


def test_each_capped_batch_leaves_one_profiled_call_of_its_streamed_generation(dry_run):
    capped = rows_of(dry_run, "generate", window=rl_rows.WINDOWS["runtime"])
    capped = [r for r in capped if r["cap"].endswith("GiB")]  # not the whole GPU
    assert capped
    for row in capped:
        stem = dry_run["profiles"] / f"generate-{row['cap']}-b{row['generations']}"
        assert Path(str(stem) + ".json.gz").stat().st_size > 0
        assert "aten::" in Path(str(stem) + ".txt").read_text()


def test_the_adapters_compare_bit_for_bit_and_a_missing_one_is_named(tmp_path):
    """Each run's last saved adapter is digested by its tensors' bytes: one value changed in
    one run's adapter makes the pair unequal, and a run that saved none leaves the
    comparison open, naming it, instead of passing."""
    import torch
    from safetensors.torch import save_file

    tensors = {"a.lora_A.weight": torch.randn(4, 8, dtype=torch.bfloat16), "a.lora_B.weight": torch.randn(8, 4)}
    digests = []
    for name, change in (("plain", False), ("same", False), ("changed", True)):
        folder = tmp_path / name / "checkpoint-5"
        folder.mkdir(parents=True)
        saved = {k: v.clone() for k, v in tensors.items()}
        if change:
            saved["a.lora_B.weight"][0, 0] = torch.nextafter(saved["a.lora_B.weight"][0, 0], torch.tensor(1e9))
        save_file(saved, str(folder / "adapter_model.safetensors"))
        (tmp_path / name / "checkpoint-2").mkdir()  # an earlier, adapter-less checkpoint is passed over
        digests.append(dict(name=name, adapter=rl.adapter_digest(tmp_path / name)))
    assert digests[0]["adapter"]["step"] == 5 and digests[0]["adapter"]["tensors"] == 2
    assert rl_rows.adapters_compared(digests[:2]) == {"adapters_equal": True, "adapter_step": 5}
    assert rl_rows.adapters_compared([digests[0], digests[2]])["adapters_equal"] is False
    assert rl.adapter_digest(tmp_path / "nothing") is None
    missing = rl_rows.adapters_compared([digests[0], dict(name="stopped", adapter=None)])
    assert missing["adapters_equal"] is None and "stopped" in missing["adapters_note"]


def on_card(run: dict, gpu: str, **changes) -> dict:
    return dict(run, gpu=gpu, **changes)


H100, H200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"


def test_a_run_from_another_card_is_kept_apart_and_a_row_pairs_one_card(tmp_path):
    """Round 1 measured again on an H100 over an H200 file: the H200's round 1 stays under
    its card's name, and each card gets its own row, so no row pairs an H100 step with an
    H200 one. Control: the same runs as one card's make one row of two rounds."""
    earlier = tmp_path / "earlier.json"
    h200 = [grpo_run(r, s, [9.0] * 4 if not s else [30.0] * 4) for r in (1, 2) for s in (False, True)]
    earlier.write_text(json.dumps({"runs": [on_card(run, H200) for run in h200]}))
    results = rl.Results(tmp_path / "out", [str(earlier)])
    results.add([on_card(grpo_run(1, s, [8.0] * 4 if not s else [10.0] * 4), H100) for s in (False, True)])
    written = json.loads((tmp_path / "out" / "rl.json").read_text())
    names = sorted(run["name"] for run in written["runs"])
    assert names == sorted(
        ["grpo-r1-False", "grpo-r1-True", "grpo-r1-False-h200", "grpo-r1-True-h200", "grpo-r2-False", "grpo-r2-True"]
    )
    by_card = {row["gpu"]: row for row in written["rows"]}
    assert set(by_card) == {H100, H200}
    assert by_card[H100]["rounds"] == 1 and by_card[H100]["step_s"] == 10.0
    assert by_card[H100]["speed_vs_resident"] == pytest.approx(0.8)
    assert by_card[H200]["rounds"] == 2 and by_card[H200]["speed_vs_resident"] == pytest.approx(0.3)
    mixed = [on_card(run, H200) for run in h200[:2]] + [on_card(run, H200) for run in h200[2:]]
    (one,) = rl_rows.grpo_pair_rows(mixed)
    assert one["rounds"] == 2


def test_runs_with_no_gradient_are_not_compared_and_a_script_that_does_not_repeat_is_named():
    """Runs whose every gradient norm is 0 trained nothing: the row says so instead of
    comparing them. Where the resident runs of two rounds saved different adapters, the
    script itself does not repeat (``resident_adapters_repeat`` False)."""
    zero = [dict(grpo_run(1, s, [9.0] * 4), grad_norms=[0.0] * 4) for s in (False, True)]
    (row,) = rl_rows.grpo_pair_rows(zero)
    assert row["losses_equal"] is None and row["adapters_equal"] is None and "trained nothing" in row["adapters_note"]

    def saved(run, sha):
        return dict(run, adapter={"step": 4, "sha256": sha, "tensors": 2})

    runs = [
        saved(grpo_run(r, s, [9.0] * 4), "a" if (r, s) != (2, False) else "b") for r in (1, 2) for s in (False, True)
    ]
    (row,) = rl_rows.grpo_pair_rows(runs)
    assert row["losses_equal"] and row["adapters_equal"] is False and row["resident_adapters_repeat"] is False
    same = [saved(run, "a") for run in runs]
    (row,) = rl_rows.grpo_pair_rows(same)
    assert row["adapters_equal"] is True and row["resident_adapters_repeat"] is True


def test_full_determinism_reaches_both_runs_and_makes_its_own_row():
    settings = rl.Settings(full_determinism=True)
    for streamed in (False, True):
        command = rl.script_command(Path("ckpt"), Path("data"), settings, Path("out"), streamed=streamed)
        assert command[command.index("--full_determinism") + 1] == "true"
    assert "--full_determinism" not in rl.script_command(Path("c"), Path("d"), rl.Settings(), Path("o"), False)
    assert rl.settings_from(rl.parse(["--full-determinism"])).full_determinism
    plain = [grpo_run(1, s, [9.0] * 4) for s in (False, True)]
    strict = [
        dict(
            grpo_run(1, s, [9.0] * 4, name=f"d{s}"),
            settings_used={**plain[0]["settings_used"], "full_determinism": True},
        )
        for s in (False, True)
    ]
    rows = rl_rows.grpo_pair_rows(plain + strict)
    assert sorted(row["full_determinism"] for row in rows) == [False, True]


def test_rows_only_remakes_the_rows_and_keeps_the_measuring_machine(tmp_path):
    measured = tmp_path / "measured.json"
    runs = [on_card(grpo_run(1, s, [9.0] * 4), H100) for s in (False, True)]
    measured.write_text(json.dumps({"rows": [], "runs": runs, "machine": {"gpu": H100}, "when": "then"}))
    assert rl.main(["--rows-only", "--merge", str(measured), "--out", str(tmp_path / "out")]) == 0
    written = json.loads((tmp_path / "out" / "rl.json").read_text())
    assert written["machine"] == {"gpu": H100} and len(written["rows"]) == 1 and written["runs"] == runs
    # the output folder's own older rl.json does not overwrite the merged runs
    newer = [dict(run, step_s=[7.0] * 4) for run in runs]
    measured.write_text(json.dumps({"rows": [], "runs": newer, "machine": {"gpu": H100}, "when": "later"}))
    assert rl.main(["--rows-only", "--merge", str(measured), "--out", str(tmp_path / "out")]) == 0
    assert json.loads((tmp_path / "out" / "rl.json").read_text())["runs"] == newer


def test_profile_grpo_leaves_each_runs_python_profile_and_no_torch_profile(other_pair, dry_run):
    """``--profile-grpo DIR``: each run of the pair writes where one steady step's host time
    went (Python's profiler), resident and streamed alike, so the two can be compared; not
    torch's, whose summary of GRPO steps outlasted a command on the GPU; without it, no
    profiler runs."""
    for side in ("resident", "streamed"):
        folder = other_pair["profiles"] / f"rloo-tiny-bf16-{side}-round1"
        assert "1 steps from step 0" in (folder / "python-profile.txt").read_text()
        assert "generate" in (folder / "python-profile.txt").read_text()
        assert not (folder / "torch-profile.txt").exists()
    unasked = [p.name for p in dry_run["profiles"].iterdir() if not p.name.startswith("generate-")]
    assert unasked == [], "the module's dry run, without --profile-grpo, profiled its GRPO runs"
    assert rl.profile_arguments(rl.Settings(), "x") == []
    assert rl.profile_arguments(rl.Settings(profile_grpo="p"), "x")[-1] == "2,1,0", "from the third of five steps"


def test_a_side_stopped_early_is_compared_over_the_steps_it_logged():
    """A deadline stopped the streamed run after 3 of 5 steps: the row does not call the
    losses unequal for that, but says over how many steps they agree. Control: a differing
    loss within those steps is named as not equal."""
    plain, stopped = grpo_run(1, False, [9.0] * 5), grpo_run(1, True, [9.0] * 3, planned=5)
    (row,) = rl_rows.grpo_pair_rows([plain, stopped])
    assert row["losses_equal"] is None and "over the first 3 the losses are equal" in row["losses_note"]
    (row,) = rl_rows.grpo_pair_rows([plain, dict(stopped, losses=[0.0, 0.5, 0.0])])
    assert "over the first 3 the losses are not equal" in row["losses_note"]
    (row,) = rl_rows.grpo_pair_rows([plain, grpo_run(1, True, [9.0] * 5)])
    assert row["losses_equal"] is True and "losses_note" not in row


def test_runs_of_other_lengths_make_rows_of_their_own():
    """A round of 4 steps and one of 5 log other losses and save adapters at other steps:
    pooled into one row, they would read as a streamed run that trained differently. Each
    length is a row of its own, with its step count; control: two rounds of one length pool."""

    def saved(run, sha):
        return dict(run, adapter={"step": len(run["losses"]), "sha256": sha, "tensors": 2})

    five = [saved(grpo_run(1, s, [9.0] * 5), "a") for s in (False, True)]
    four = [saved(dict(grpo_run(2, s, [9.0] * 4), losses=[1.0] * 4), "b") for s in (False, True)]
    rows = rl_rows.grpo_pair_rows(five + four)
    assert sorted(row["steps"] for row in rows) == [4, 5]
    assert all(row["losses_equal"] and row["grad_norms_equal"] and row["adapters_equal"] for row in rows)
    (pooled,) = rl_rows.grpo_pair_rows(five + [saved(grpo_run(2, s, [9.0] * 5), "a") for s in (False, True)])
    assert pooled["rounds"] == 2 and pooled["adapters_equal"] is True


def test_sides_measure_one_side_and_the_row_says_the_round_was_measured_apart(tmp_path):
    """``--sides streamed`` runs the streamed side only; a row whose round pairs runs of two
    commands says so. Unknown sides are refused."""
    assert rl.parse(["--sides", "streamed"]).sides == "streamed"
    with pytest.raises(SystemExit):
        rl.parse(["--sides", "streamed,plain"])
    plain = grpo_run(1, False, [9.0] * 4)
    later = dict(grpo_run(1, True, [9.0] * 4), rl_command=plain["rl_command"] + " --sides streamed")
    (row,) = rl_rows.grpo_pair_rows([plain, later])
    assert row["rounds_measured_apart"] == [1]
    (row,) = rl_rows.grpo_pair_rows([plain, grpo_run(1, True, [9.0] * 4)])
    assert row["rounds_measured_apart"] == []


def test_sides_streamed_runs_only_the_streamed_script(tmp_path, monkeypatch):
    ran = []
    monkeypatch.setattr(rl, "write_prompts", lambda work: work / "prompts")
    monkeypatch.setattr(rl, "write_checkpoint", lambda work, shape: work / shape)
    monkeypatch.setattr(rl, "mean_layer_bytes", lambda *a: 1)
    monkeypatch.setattr(rl, "run_capped", lambda name, *a, **k: ran.append(name) or {"name": name})
    saved = []
    for sides, expected in (("streamed", ["streamed"]), ("resident,streamed", ["resident", "streamed"])):
        ran.clear()
        args = rl.parse(["--part", "grpo-8b", "--sides", sides, "--work", str(tmp_path), "--out", str(tmp_path)])
        rl.measure_grpo_pair(rl.settings_from(args), args, "cmd", saved.extend, time.monotonic() + 3600)
        assert [name.split("-")[-2] for name in ran] == expected


def test_a_pair_streamed_with_the_whole_gpu_is_a_row_of_its_own():
    """``--grpo-cap whole`` (the streamed run uncapped, to tell the cap's cost from
    streaming's): its runs, resident side included, pair with each other and not with the
    12 GiB pair's. Control: without the recorded cap, the four runs would make one row."""
    capped = [grpo_run(1, False, [9.0] * 4), grpo_run(1, True, [12.0] * 4)]
    uncapped = [grpo_run(1, False, [9.5] * 4, name="w-r"), dict(grpo_run(1, True, [10.0] * 4, name="w-s"), cap="whole")]
    for run in uncapped:
        run["settings_used"] = dict(run["settings_used"], streamed_cap="whole")
    rows = rl_rows.grpo_pair_rows(capped + uncapped)
    assert sorted(row["cap"] for row in rows) == ["12GiB", "whole GPU"]
    by_cap = {row["cap"]: row for row in rows}
    assert by_cap["whole GPU"]["step_s"] == 10.0 and by_cap["whole GPU"]["resident_step_s"] == 9.5
    assert by_cap["12GiB"]["step_s"] == 12.0 and by_cap["12GiB"]["resident_step_s"] == 9.0
    for run in uncapped:
        del run["settings_used"]["streamed_cap"]
    assert len(rl_rows.grpo_pair_rows(capped + uncapped)) == 1
    settings = rl.settings_from(rl.parse(["--grpo-cap", "whole"]))
    assert settings.grpo_cap == "whole" and rl.settings_from(rl.parse([])).grpo_cap == "12GiB"


def test_the_row_counts_each_sides_allocator_retries_by_its_last_step():
    """A cap near the step's peak makes the caching allocator free its cache and retry
    (``num_alloc_retries``), which synchronises: the row keeps each side's count, so a slow
    capped side can be told from a slow streamed one. Runs that did not record it give None."""
    runs = [grpo_run(1, False, [9.0] * 4), grpo_run(1, True, [12.0] * 4)]
    (row,) = rl_rows.grpo_pair_rows(runs)
    assert row["alloc_retries"] == {"streamed": None, "resident": None}
    runs[0]["alloc_retries"], runs[1]["alloc_retries"] = [0, 0, 0, 0], [0, 3, 5, 9]
    (row,) = rl_rows.grpo_pair_rows(runs)
    assert row["alloc_retries"] == {"streamed": 9, "resident": 0}


def test_rounds_alternate_which_side_runs_first():
    """A drift of the host's speed over a round falls on each side alike over two rounds."""
    assert rl.side_order(1) == ("resident", "streamed")
    assert rl.side_order(2) == ("streamed", "resident")
    assert rl.side_order(3) == rl.side_order(1)


def _generate_record(mode, cap, decode_ms, copy_bound=None, command="c"):
    record = {
        "name": f"generate-{mode}-{cap}",
        "kind": "generate",
        "model": "m",
        "batch": 8,
        "cap": cap,
        "mode": mode,
        "window": "none" if mode == "resident" else "runtime",
        "new_tokens": 4,
        "prompt_tokens": 4,
        "command": command,
        "generate_s": [1.0],
        "prefill_s": [0.1],
        "decode_ms_per_token_step": [decode_ms],
        "loads_per_token_step": [0.0],
        "bytes_per_token_step": [0.0],
    }
    if copy_bound is not None:
        record.update(copy_bound_ms_per_token_step=copy_bound, window_layers=29, layers=32, slots=3)
    return record


@pytest.mark.parametrize("copy_bound, bound", [(6.0, 50.0), (80.0, 80.0)])
def test_a_capped_generation_is_measured_against_the_slower_of_resident_decoding_and_its_copies(copy_bound, bound):
    """Under a cap a token step can at best match the resident one (same kernels) or the copy
    of the layers outside the window, whichever is slower; a row pairs with the resident run
    of its own command only."""
    resident = _generate_record("resident", rl_rows.WHOLE, 50.0)
    capped = _generate_record("streamed", "8GiB", 64.0, copy_bound)
    (row,) = rl_rows.generation_rows([resident, capped])
    assert row["bound_ms_per_token_step"] == bound
    assert row["fraction_of_bound"] == pytest.approx(bound / 64.0)
    assert row["fraction_of_copy_bound"] == pytest.approx(copy_bound / 64.0)
    (alone,) = rl_rows.generation_rows([dict(resident, command="other"), capped])
    assert alone["bound_ms_per_token_step"] is None and alone["fraction_of_bound"] is None
