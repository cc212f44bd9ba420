"""The benchmark suite's bookkeeping (no GPU): cells parse or fail clearly, results merge
into one table, and cells not measured are listed, never dropped."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import schedule_sim  # noqa: E402
import suite  # noqa: E402


def test_cells_parse_and_bad_cells_say_how_to_write_them():
    assert suite.parse_cell("llama3-70b:nf4:2048:1:16GiB") == {
        "shape": "llama3-70b",
        "quantization": "nf4",
        "seq": 2048,
        "batch": 1,
        "budget": "16GiB",
    }
    with pytest.raises(ValueError, match="shape:quantization:seq:batch"):
        suite.parse_cell("llama3-8b:2048")
    with pytest.raises(ValueError, match="none or nf4"):
        suite.parse_cell("llama3-8b:int8:2048:1")


def test_measured_cells_merge_and_missing_ones_are_listed(tmp_path):
    measured = "llama3-8b:nf4:2048:1"
    shutil.copy(
        ROOT / "benchmarks/results/throughput/throughput-llama3-8b-nf4-seq2048.json",
        tmp_path / f"{suite.cell_name(measured)}.json",
    )
    merged = suite.merge(tmp_path, [measured, "llama3-70b:nf4:2048:1:16GiB"])
    source = json.loads((ROOT / "benchmarks/results/throughput/throughput-llama3-8b-nf4-seq2048.json").read_text())
    assert [r["config"] for r in merged["rows"]] == [f"{r['slots']}:{r['prefetch']}" for r in source["rows"]]
    assert merged["rows"][0]["fraction_of_resident"] == source["rows"][0]["fraction_of_resident"]
    assert merged["missing"] == ["llama3-70b:nf4:2048:1:16GiB"]
    text = suite.table(merged)
    assert "| llama3-70b:nf4:2048:1:16GiB | not measured |" in text
    assert suite.plot(merged, tmp_path / "suite.png") and (tmp_path / "suite.png").stat().st_size > 1000


def test_trace_overlap_counts_only_copy_time_that_runs_beside_kernels():
    import trace_overlap

    def span(cat, name, ts, dur):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}

    events = [
        span("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 0, 4000),  # half beside a kernel
        span("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 10000, 2000),  # alone
        span("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 20000, 10),  # too short: not a layer
        span("kernel", "gemm", 2000, 3000),
        span("kernel", "gemm", 4000, 1000),  # overlaps the one before: counted once
    ]
    summary = trace_overlap.summarise(events)
    assert summary["copies"] == 2
    assert summary["copy_ms"] == 6.0
    assert summary["kernel_busy_ms"] == 3.0
    assert summary["copy_overlapping_compute_ms"] == 2.0
    assert summary["overlap_fraction"] == 2.0 / 6.0
    assert summary["largest_copy_gaps_ms"] == [6.0]


def test_a_cell_that_wrote_its_result_before_its_limit_counts_as_measured(tmp_path, monkeypatch):
    import subprocess

    cell = "qwen3-30b-a3b:none:2048:1"

    def slow_teardown(command, **kwargs):
        (tmp_path / f"{suite.cell_name(cell)}.json").write_text("{}")
        raise subprocess.TimeoutExpired(command, kwargs["timeout"])

    monkeypatch.setattr(suite.subprocess, "run", slow_teardown)
    assert suite.run_cell(cell, tmp_path, "3:2", 5, 170).startswith("ok (result written")
    (tmp_path / f"{suite.cell_name(cell)}.json").unlink()

    def too_slow(command, **kwargs):
        raise subprocess.TimeoutExpired(command, kwargs["timeout"])

    monkeypatch.setattr(suite.subprocess, "run", too_slow)
    assert suite.run_cell(cell, tmp_path, "3:2", 5, 170) == "timed out after 170 s"


def test_phase_bound_takes_the_slower_of_copies_and_compute_in_each_phase():
    import throughput

    resident = {"step_s": 0.35, "forward_s": 0.10, "backward_s": 0.24, "optimizer_s": 0.01}
    gbps = 50.0
    # forward copies 0.2 s (copy-bound), backward copies 0.2 s (compute-bound at 0.24 s)
    row = {"step_s": 0.5, "copy_bound_s": 0.4, "bytes_per_step": 20e9, "forward_bytes": 10e9}
    throughput.add_bounds(row, resident, gbps)
    assert row["bound_s"] == 0.4 and row["fraction_of_bound"] == 0.4 / 0.5
    assert row["phase_bound_s"] == 0.2 + 0.24 + 0.01
    assert row["fraction_of_phase_bound"] == (0.2 + 0.24 + 0.01) / 0.5
    # rows of an older result (no phase split) keep only the step bound
    old = {"step_s": 0.5, "copy_bound_s": 0.4, "bytes_per_step": 20e9}
    throughput.add_bounds(old, {"step_s": 0.35}, gbps)
    assert "phase_bound_s" not in old and old["bound_s"] == 0.4


def test_the_schedule_simulator_matches_the_measured_step_and_each_backward_slot_saves_a_copy():
    """The planner played out with the measured 8B pieces (turnaround.py) predicts the
    measured all-streamed step within 2% (within 1% with a layer's backward as it runs in
    a step), and each backward slot removes one copy and about one copy's time."""
    pieces = json.loads((ROOT / "benchmarks/results/throughput/turnaround-llama3-8b-seq2048.json").read_text())
    measured = json.loads((ROOT / "benchmarks/results/suite/cell-llama3-8b-none-2048-1.json").read_text())
    row = next(r for r in measured["rows"] if (r["slots"], r["prefetch"]) == (3, 2))
    copy_ms = 436_224_000 / 55.3e9 * 1e3
    runs = [
        schedule_sim.simulate(
            32,
            3,
            2,
            count,
            pieces["layer_forward_ms"],
            pieces["layer_recompute_backward_ms"],
            pieces["ends_forward_ms"],
            pieces["ends_backward_ms"],
            1.5,
            copy_ms,
        )
        for count in range(5)
    ]
    assert abs(runs[0]["step_ms"] / 1e3 - row["step_s"]) / row["step_s"] < 0.02
    assert [r["copies"] for r in runs] == [58, 57, 56, 55, 54]
    for fewer, run in enumerate(runs):
        assert abs(runs[0]["step_ms"] - run["step_ms"] - fewer * copy_ms) < copy_ms
    # a layer's backward as it runs within a step (from the resident step's phases): the
    # step within 1%, and its fraction of the copy bound within 0.01 of the measured one
    phases = json.loads((ROOT / "benchmarks/results/throughput/throughput-llama3-8b-phases-seq2048.json").read_text())
    in_step = schedule_sim.backward_in_step_ms(phases, pieces, 32)
    assert in_step < pieces["layer_recompute_backward_ms"]
    calibrated = schedule_sim.simulate(
        32,
        3,
        2,
        0,
        pieces["layer_forward_ms"],
        in_step,
        pieces["ends_forward_ms"],
        pieces["ends_backward_ms"],
        1.5,
        copy_ms,
    )
    assert abs(calibrated["step_ms"] / 1e3 - row["step_s"]) / row["step_s"] < 0.01
    assert abs(calibrated["fraction_of_copy_bound"] - row["fraction_of_bound"]) < 0.01
    # the last layer without its recompute: at most its forward shorter, the copies the same
    skip = schedule_sim.simulate(
        32,
        3,
        2,
        0,
        pieces["layer_forward_ms"],
        schedule_sim.without_recompute(pieces["layer_forward_ms"], pieces["layer_recompute_backward_ms"], 32, {31}),
        pieces["ends_forward_ms"],
        pieces["ends_backward_ms"],
        1.5,
        copy_ms,
    )
    assert skip["copies"] == 58 and 0 < runs[0]["step_ms"] - skip["step_ms"] <= pieces["layer_forward_ms"] + 1e-9


def test_skipping_the_first_and_last_recompute_would_still_stay_under_the_target():
    """The simulator's what-if for keeping the first and the last layer's activations (no
    recompute for either): the same copies, the step shorter by at most their two
    forwards, and the ratio to the copy bound still under 0.95 with head and loss as
    measured, and with them 10% cheaper; only 20% cheaper as well reaches it."""
    pieces = json.loads((ROOT / "benchmarks/results/throughput/turnaround-llama3-8b-seq2048.json").read_text())
    phases = json.loads((ROOT / "benchmarks/results/throughput/throughput-llama3-8b-phases-seq2048.json").read_text())
    forward, backward = pieces["layer_forward_ms"], schedule_sim.backward_in_step_ms(phases, pieces, 32)
    copy_ms = 436_224_000 / 55.3e9 * 1e3
    skipped = schedule_sim.without_recompute(forward, backward, 32, {0, 31})

    def play(backward_ms, ends_scale=1.0):
        return schedule_sim.simulate(
            32,
            3,
            2,
            0,
            forward,
            backward_ms,
            ends_scale * pieces["ends_forward_ms"],
            ends_scale * pieces["ends_backward_ms"],
            1.5,
            copy_ms,
        )

    whole, both = play(backward), play(skipped)
    assert both["copies"] == whole["copies"] == 58
    assert 0 < whole["step_ms"] - both["step_ms"] <= 2 * forward + 1e-9
    assert whole["fraction_of_copy_bound"] < both["fraction_of_copy_bound"] < 0.95
    assert play(skipped, ends_scale=0.9)["fraction_of_copy_bound"] < 0.95
    assert play(skipped, ends_scale=0.8)["fraction_of_copy_bound"] >= 0.95


def test_backward_slots_taking_the_backwards_first_copies_shorten_the_step_at_the_same_copies():
    """Played out by the simulator: with 1-4 backward slots, taking the backward's first
    copies as well as keeping their layers shortens the step by at least 0.4 of a layer's
    backward against keeping alone, with the same copies and no demand loads."""
    pieces = json.loads((ROOT / "benchmarks/results/throughput/turnaround-llama3-8b-seq2048.json").read_text())
    phases = json.loads((ROOT / "benchmarks/results/throughput/throughput-llama3-8b-phases-seq2048.json").read_text())
    backward = schedule_sim.backward_in_step_ms(phases, pieces, 32)
    copy_ms = 436_224_000 / 55.3e9 * 1e3
    for count in (1, 2, 3, 4):
        kept, early = [
            schedule_sim.simulate(
                32,
                3,
                2,
                count,
                pieces["layer_forward_ms"],
                backward,
                pieces["ends_forward_ms"],
                pieces["ends_backward_ms"],
                1.5,
                copy_ms,
                planner_class=planner,
            )
            for planner in (schedule_sim.KeptOnlyBackwardSlotsPlanner, schedule_sim.PrefetchSchedule)
        ]
        assert early["copies"] == kept["copies"] and early["demand_loads"] == kept["demand_loads"] == 0
        assert 0.4 * backward < kept["step_ms"] - early["step_ms"] <= backward + 1e-9


def test_attention_and_mlp_units_would_stay_under_the_target_and_lengthen_the_step():
    """The simulator's what-if for streaming attention and MLP as separate units: with at
    least the slot memory of 3 layers (4 MLP-sized slots), the ratio to the copy bound rises
    but stays under 0.95, and the step is longer than with whole layers (fewer bytes fit the
    slots, so more are copied)."""
    pieces = json.loads((ROOT / "benchmarks/results/throughput/turnaround-llama3-8b-seq2048.json").read_text())
    phases = json.loads((ROOT / "benchmarks/results/throughput/throughput-llama3-8b-phases-seq2048.json").read_text())
    forward, backward = pieces["layer_forward_ms"], schedule_sim.backward_in_step_ms(phases, pieces, 32)
    layer_bytes, attention_bytes = 436_224_000, 83_886_080
    copy_ms = layer_bytes / 55.3e9 * 1e3
    ends = (pieces["ends_forward_ms"], pieces["ends_backward_ms"], 1.5)
    layers = schedule_sim.simulate(32, 3, 2, 0, forward, backward, *ends, copy_ms)
    assert 4 * (layer_bytes - attention_bytes) >= 3 * layer_bytes
    for share in (0.2, 0.3):
        unit_forward, unit_backward, unit_copy = schedule_sim.attention_mlp_units(
            32, forward, backward, copy_ms, share, attention_bytes / layer_bytes
        )
        units = schedule_sim.simulate(64, 4, 2, 0, unit_forward, unit_backward, *ends, unit_copy)
        assert units["copies"] == 2 * (64 - 4) and units["demand_loads"] == 0
        assert layers["fraction_of_copy_bound"] < units["fraction_of_copy_bound"] < 0.95
        assert units["step_ms"] > layers["step_ms"]


def test_long_context_benchmark_runs_its_whole_harness_on_the_cpu(tmp_path, monkeypatch):
    """--dry-run: binary search (a length limit stands in for out of memory), one
    subprocess per probe, timing, the baseline and the result rows, on a tiny model."""
    import long_context

    with pytest.raises(SystemExit) as exited:
        long_context.main(["--help"])
    assert exited.value.code == 0
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    assert long_context.main(["--dry-run"]) == 0
    (row,) = json.loads((tmp_path / "long-context.json").read_text())
    keys = {"model", "quantization", "vram_gib", "max_tokens", "step_s", "tokens_per_s", "baseline_step_s"}
    assert keys <= set(row)
    # the probe subprocess ran with expandable segments, as `layerstream run` sets them
    assert row["alloc_conf"] == "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
    assert row["options"]["loss_chunk_tokens"] == str(long_context.TINY_LOSS_CHUNK_TOKENS)
    assert row["max_tokens"] == 384, "the longest length under the dry run's limit, to 64 tokens"
    assert row["step_s"] > 0 and row["baseline_step_s"] > 0
    assert row["tokens_per_s"] == pytest.approx(row["max_tokens"] / row["step_s"])


def test_long_context_at_a_given_length_times_it_without_searching(tmp_path, monkeypatch):
    """--at: one timed probe and its baseline per cell at that length, no search probes,
    and the row says tokens (the length given), not max_tokens (it is not the longest)."""
    import long_context

    calls = []

    def fake_probe(cell, seq, mode, options, args, steps, cap):
        calls.append((seq, mode, steps, cap))
        window = {"window_changes": [[22528, 9]]} if cap else {}  # the capped run's own window
        return {"ok": True, "step_s": [2.0] * steps, "peak_allocated_gib": 1.0, "config": mode, **window}

    monkeypatch.setattr(long_context, "run_probe", fake_probe)
    out = tmp_path / "at.json"
    argv = ["--cells", "llama3-8b:nf4:12", "--at", "22528", "--out", str(out), "--state", str(tmp_path / "s")]
    assert long_context.main(argv) == 0
    assert calls == [(22528, "streamed", 4, True), (22528, "resident", 4, False)]
    (row,) = json.loads(out.read_text())
    assert row["tokens"] == 22528 and "max_tokens" not in row
    assert row["window_changes"] == [[22528, 9]], "below the limit the window takes what is left: said"
    calls.clear()
    assert long_context.main(argv + ["--no-baseline", "--steps", "1", "--warmup", "0"]) == 0
    assert calls == [(22528, "streamed", 1, True)], "one capped step, nothing else"
    (row,) = json.loads(out.read_text())
    assert row["step_s"] == 2.0 and row["baseline_step_s"] is None
    assert (row["timed_steps"], row["warmup_steps"]) == (1, 0)
    assert not (tmp_path / "s").exists(), "no search state written"


def test_the_chunked_loss_baseline_is_resident_with_only_the_cells_loss_chunk(tmp_path, monkeypatch):
    """--baseline-loss-chunk: where the full fp32 logits do not fit even the whole GPU, the
    baseline is the resident model with the same chunked loss and neither offload nor the
    tiled MLP; one baseline probe, and the row names it."""
    import long_context

    calls = []

    def fake_probe(cell, seq, mode, options, args, steps, cap):
        calls.append((mode, dict(options), cap))
        config = "resident, loss_chunk_tokens=512" if mode == "resident" and options else mode
        return {"ok": True, "step_s": [3.0] * steps, "peak_allocated_gib": 1.0, "config": config}

    monkeypatch.setattr(long_context, "run_probe", fake_probe)
    out = tmp_path / "at.json"
    argv = ["--cells", "llama3-8b:nf4:24", "--at", "92160", "--out", str(out), "--baseline-loss-chunk"]
    assert long_context.main(argv) == 0
    (streamed, baseline) = calls
    assert streamed[0] == "streamed" and streamed[1]["offload_activations"] == "true" and streamed[2]
    assert baseline == ("resident", {"loss_chunk_tokens": "512"}, False)
    (row,) = json.loads(out.read_text())
    assert row["baseline_config"] == "resident, loss_chunk_tokens=512" and row["baseline_step_s"] == 3.0


def test_a_resident_probe_with_a_loss_chunk_computes_the_chunked_loss(tmp_path, monkeypatch, capsys):
    """The baseline probe itself (tiny model, CPU): resident, and its loss is the chunked one."""
    import long_context

    from layerstream.long import chunked_loss

    applied = []
    monkeypatch.setattr(chunked_loss, "apply", lambda model, tokens: applied.append(tokens) or model)
    argv = ["--probe", "tiny:none:1", "--seq", "64", "--mode", "resident", "--steps", "1", "--dry-run"]
    assert long_context.main(argv + ["--options", json.dumps({"loss_chunk_tokens": "32"})]) == 0
    result = json.loads(capsys.readouterr().out.split("PROBE ")[-1])
    assert result["ok"] and result["config"] == "resident, loss_chunk_tokens=32" and applied == [32]
    assert long_context.main(argv + ["--options", "{}"]) == 0
    assert json.loads(capsys.readouterr().out.split("PROBE ")[-1])["config"] == "resident" and applied == [32]


def test_a_length_that_fails_when_timed_is_not_published_and_is_searched_below_again(tmp_path, monkeypatch):
    """The search's probes run fewer steps than the timed run: a length whose timed run
    fails gets no row (its failure is said) and the next run searches below it."""
    import long_context

    calls = []

    def fake_probe(cell, seq, mode, options, args, steps, cap):
        calls.append((seq, mode, steps))
        if mode == "streamed" and steps > 2:
            return {"ok": False, "why": "out of memory: the third step"}
        if seq > 4096:
            return {"ok": False, "why": "out of memory"}
        return {"ok": True, "step_s": [1.0] * steps, "peak_allocated_gib": 1.0, "config": mode}

    monkeypatch.setattr(long_context, "run_probe", fake_probe)
    state, out = tmp_path / "state.json", tmp_path / "rows.json"
    argv = ["--cells", "llama3-8b:nf4:12", "--state", str(state), "--out", str(out), "--hi", "8192"]
    assert long_context.main(argv + ["--granularity", "1024"]) == 0
    assert not out.exists(), "no row for a length that did not train when timed"
    assert json.loads(state.read_text())["llama3-8b:nf4:12"] == {"fits": 0, "fails": 4096}
    assert all(steps == 2 for _, mode, steps in calls[:-1]), "search probes run two steps"
    assert not [c for c in calls if c[1] == "resident"], "no baseline timed for a length that failed"


def test_the_long_context_loss_chunk_is_the_planners_default_for_the_shapes_vocabulary():
    import long_context

    options = long_context.stream_options([])
    assert "loss_chunk_tokens" not in options, "chosen per cell"
    assert long_context.cell_options("llama3-8b:nf4:12", options)["loss_chunk_tokens"] == "512"  # 128,256 tokens
    assert long_context.cell_options("llama3-70b:nf4:24", options)["loss_chunk_tokens"] == "512"
    tiny = long_context.cell_options("tiny:none:1", options)
    assert tiny["loss_chunk_tokens"] == str(long_context.TINY_LOSS_CHUNK_TOKENS)
    assert tiny["mlp_tile_tokens"] == options["mlp_tile_tokens"]
    given = long_context.stream_options(["loss_chunk_tokens=2048"])
    assert long_context.cell_options("llama3-8b:nf4:12", given)["loss_chunk_tokens"] == "2048", "as given"


def _probe_environments(monkeypatch, tmp_path):
    """Run the harness on one cell with subprocess.run replaced; the environment each probe got."""
    import long_context

    seen = []

    def fake_run(command, **kwargs):
        seen.append((command, kwargs.get("env")))
        result = {"ok": False, "why": "out of memory"}
        return subprocess.CompletedProcess(command, 0, stdout="PROBE " + json.dumps(result), stderr="")

    monkeypatch.setattr(long_context.subprocess, "run", fake_run)
    argv = ["--cells", "llama3-8b:nf4:12", "--state", str(tmp_path / "s.json"), "--out", str(tmp_path / "r.json")]
    assert long_context.main(argv + ["--hi", "2048", "--granularity", "1024", "--no-from-plan"]) == 0
    assert seen, "no probe ran"
    return seen


def test_the_long_context_probes_run_with_expandable_segments(monkeypatch, tmp_path):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    for command, env in _probe_environments(monkeypatch, tmp_path):
        assert env is not None and env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
        assert json.loads(command[command.index("--options") + 1])["loss_chunk_tokens"] == "512"


@pytest.mark.parametrize(
    "name, value", [("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False"), ("PYTORCH_ALLOC_CONF", "backend:native")]
)
def test_the_long_context_probes_keep_an_allocator_setting_the_user_made(monkeypatch, tmp_path, name, value):
    import long_context

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setenv(name, value)
    for _, env in _probe_environments(monkeypatch, tmp_path):
        assert env[name] == value
        if name == "PYTORCH_ALLOC_CONF":
            assert "PYTORCH_CUDA_ALLOC_CONF" not in env, "torch's allocator is configured already"
    assert long_context.alloc_conf(long_context.alloc_env()) == f"{name}={value}"


def test_long_context_benchmark_refuses_a_bad_stream_option_before_any_probe():
    import long_context

    from layerstream.errors import StreamConfigError

    with pytest.raises(StreamConfigError, match="unknown setting"):
        long_context.stream_options(["offload_everything=true"])
    with pytest.raises(StreamConfigError, match="loss_chunk_tokens must be an integer"):
        long_context.stream_options(["loss_chunk_tokens=lots"])
    with pytest.raises(ValueError, match="shape:quantization:vram_gib"):
        long_context.parse_cell("llama3-8b:24")


def test_the_offload_cost_benchmark_imports_and_parses_its_arguments_without_a_gpu(capsys):
    import offload_cost

    args = offload_cost._arguments(["--tokens", "8192", "--quantization", "nf4", "--layers", "4"])
    assert (args.tokens, args.quantization, args.layers, args.shape) == ("8192", "nf4", 4, "llama3-8b")
    with pytest.raises(SystemExit) as done:
        offload_cost._arguments(["--help"])
    assert done.value.code == 0 and "with and without offloading" in capsys.readouterr().out


@pytest.mark.parametrize("quantization", ["none", "nf4"])
def test_disk_tier_benchmark_runs_its_whole_harness_on_the_cpu(tmp_path, monkeypatch, quantization):
    """--dry-run: write (NF4: a sparse checkpoint and a complete layer cache), probe, the
    RAM-fed and disk-fed steps, the row; NF4 loads only from the cache (quantising raises)
    and the disk-fed first loss equals the RAM-fed one (the same packed layer in both)."""
    import disk_tier

    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    args = ["--dry-run", "--quantization", quantization, "--dir", str(tmp_path)]
    assert disk_tier.main(args + ["--phase", "write"]) == 0
    assert disk_tier.main(args) == 0
    (row,) = json.loads((tmp_path / "out" / "disk-tier-dry-run.json").read_text())["rows"]
    keys = {"model", "quantization", "host_budget_gib", "disk_gbps", "step_s", "ram_step_s", "disk_bound_s"}
    assert keys <= set(row) and row["quantization"] == quantization
    assert row["step_s"] > 0 and row["ram_step_s"] > 0 and row["disk_bound_s"] > 0
    assert row["disk_layers"] > 0 and row["first_loss_equals_ram_fed"] is True
    phases = json.loads((tmp_path / f"tiny-{quantization}" / "phases.json").read_text())
    before, after = (phases[p]["disk_gbps_by_readers"] for p in ("probe", "probe_after"))
    assert row["disk_gbps"] == pytest.approx(max((before[n] + after[n]) / 2 for n in before)), "probes both sides"
    assert row["strict_disk_bound_s"] <= row["disk_bound_s"]
    own = [phases[p]["files_gbps_by_readers"] for p in ("probe", "probe_after")]
    assert row["files_gbps"] == pytest.approx(max((own[0][n] + own[1][n]) / 2 for n in own[0])), "the tier's files"
    assert row["files_disk_bound_s"] > 0
    if quantization == "nf4":
        layer = tmp_path / "tiny-nf4" / "layer-00003.safetensors"
        assert layer.stat().st_blocks * 512 < layer.stat().st_size  # sparse: the loader never reads it


@pytest.mark.parametrize("quantization", ["none", "nf4"])
def test_disk_tier_benchmark_stops_before_writing_what_the_disk_cannot_take(tmp_path, monkeypatch, quantization):
    """A disk with too little free space stops the write phase with what to do, before the
    layers are written (bf16: the checkpoint's shards; NF4: the cache's layers, beside a
    sparse checkpoint that takes no space)."""
    import shutil

    import disk_tier

    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=1000))
    with pytest.raises(SystemExit, match="GB free. Remove an earlier case"):
        disk_tier.main(["--dry-run", "--quantization", quantization, "--dir", str(tmp_path), "--phase", "write"])
    case = tmp_path / f"tiny-{quantization}"
    written = case.glob(f"{disk_tier.CACHE}/layer-*.nf4" if quantization == "nf4" else "layer-*.safetensors")
    assert not list(written)


def test_disk_tier_benchmark_refuses_a_stale_nf4_cache_before_loading_negative_control(tmp_path, monkeypatch):
    """A checkpoint file touched after the cache was written changes the fingerprint: the
    disk phase stops with what to do instead of letting the loader clear and rebuild."""
    import disk_tier

    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    args = ["--dry-run", "--quantization", "nf4", "--dir", str(tmp_path)]
    assert disk_tier.main(args + ["--phase", "write"]) == 0
    layer = tmp_path / "tiny-nf4" / "layer-00002.safetensors"
    os.utime(layer, ns=(layer.stat().st_atime_ns, layer.stat().st_mtime_ns + 10**9))
    with pytest.raises(SystemExit, match="does not match its checkpoint"):
        disk_tier.main(args + ["--phase", "disk"])
    assert list((tmp_path / "tiny-nf4" / "nf4-cache").glob("layer-00000.*.nf4"))


def test_disk_tier_benchmark_refuses_a_load_that_would_quantise_negative_control(tmp_path, monkeypatch):
    """A cache missing a layer (fingerprint intact) would make the loader quantise the zero
    layer file: the benchmark stops instead of timing that."""
    import disk_tier

    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    args = ["--dry-run", "--quantization", "nf4", "--dir", str(tmp_path)]
    assert disk_tier.main(args + ["--phase", "write"]) == 0
    (layer,) = (tmp_path / "tiny-nf4" / "nf4-cache").glob("layer-00005.*.nf4")
    layer.unlink()
    with pytest.raises(RuntimeError, match="NF4 cache was not used"):
        disk_tier.main(args + ["--phase", "disk"])


def test_the_window_sweep_times_each_size_twice_and_stops_at_the_first_out_of_memory():
    """Sizes go up from just below the automatic size until one runs out of memory; the ones
    that fitted are timed again in reverse order and take the median of both rounds; the size
    the automatic window chose is compared with the best."""
    import window_matrix

    calls = []
    times = {3: [1.0, 1.2], 4: [0.9, 0.8], 5: [0.95, 0.85]}

    def timed_at(size):
        calls.append(size)
        if size == 6:
            raise MemoryError
        return [times[size][calls.count(size) - 1]]

    result = window_matrix.sweep(timed_at, auto_window=4, layers=32, sizes=8)
    assert calls == [3, 4, 5, 6, 5, 4, 3]
    assert result["noise"] == pytest.approx(0.125), "window 4: rounds of 0.9 and 0.8"
    calls.clear()
    times.update({3: [1.0] * 4, 4: [0.9, 0.8, 0.9, 0.8], 5: [1.0] * 4})
    four = window_matrix.sweep(timed_at, auto_window=4, layers=32, sizes=8, rounds=4)
    assert calls == [3, 4, 5, 6, 5, 4, 3, 3, 4, 5, 5, 4, 3], "passes alternate direction"
    assert four["best_hand_step_s"] == pytest.approx(0.85) and four["noise"] == 0.0
    assert [h["window"] for h in result["hand"]] == [3, 4, 5, 6] and result["hand"][-1]["out_of_memory"]
    assert result["best_hand_window"] == 4 and result["best_hand_step_s"] == pytest.approx(0.85)
    assert result["auto_size_vs_best"] == 1.0
    capped = window_matrix.sweep(lambda size: [1.0 + size], auto_window=0, layers=32, sizes=2)
    assert [h["window"] for h in capped["hand"]] == [0, 1] and capped["auto_size_vs_best"] == 1.0


def test_the_paired_window_ratio_cancels_drift_that_the_medians_do_not():
    """The host turns 1.5x slower once, part way through the sweep. Size 5 is 10% faster
    than the automatic size 4, but more of its steps fall after the change, so the medians
    over all steps rank it slower; pass by pass it is 0.9x the automatic size in every pass
    but the one the change splits."""
    import window_matrix

    own = {3: 1.0, 4: 1.0, 5: 0.9}
    calls = []

    def timed_at(size):
        calls.append(size)
        return [own[size] * (1.5 if len(calls) > 8 else 1.0)]

    result = window_matrix.sweep(timed_at, auto_window=4, layers=5, sizes=3, rounds=5)
    assert calls == [3, 4, 5, 5, 4, 3, 3, 4, 5, 5, 4, 3, 3, 4, 5]
    assert result["auto_size_vs_best"] == 1.0, "the medians miss it (the negative control)"
    assert result["paired_best_window"] == 5
    assert result["auto_size_vs_best_paired"] == pytest.approx(0.9)
    hand = {h["window"]: h for h in result["hand"]}
    assert hand[4]["paired_vs_auto"] == 1.0 and hand[3]["paired_vs_auto"] == pytest.approx(1.0)
    even = window_matrix.sweep(lambda size: [1.0], auto_window=4, layers=5, sizes=3, rounds=2)
    assert even["auto_size_vs_best_paired"] == 1.0, "a tie keeps the automatic size as good as the best"


def test_window_matrix_cells_take_stream_settings_as_every_surface_parses_them():
    import window_matrix

    assert window_matrix.cell_options("loss_chunk_tokens=512+stream_embeddings=true") == {
        "loss_chunk_tokens": 512,
        "stream_embeddings": True,
    }
    with pytest.raises(Exception, match="unknown setting"):
        window_matrix.cell_options("chunk=1")


def test_a_timed_pair_pools_its_alternated_rounds_and_needs_equal_losses_in_every_run():
    import zero_edit

    def runs(times, losses=(1.0, 0.5)):
        return {"step_s": [9.0, 9.0] + times, "losses": list(losses)}

    case = ("sft", "llama3.2-3b", "bf16", "24GiB", True)
    plains = [runs([1.0, 1.0]), runs([2.0, 2.0])]  # the machine slowed between rounds ...
    streameds = [runs([1.0, 1.0]), runs([2.0, 2.0])]  # ... for both sides alike
    verdict = zero_edit.compare(case, plains, streameds)
    assert verdict["speed_vs_plain"] == 1.0 and verdict["speed_vs_plain_by_round"] == [1.0, 1.0]
    assert verdict["losses_equal"] and verdict["steps_compared"] == 4
    streameds[1] = runs([2.0, 2.0], losses=(1.0, 0.4))
    assert not zero_edit.compare(case, plains, streameds)["losses_equal"], "one round's losses differ"


def test_the_long_context_search_starts_at_the_planners_guess_and_strides_from_it():
    import long_context

    Bounds, step = long_context.Bounds, 1024
    assert long_context.next_length(Bounds(0, 524288), step, 51200) == 51200, "the guess first"
    assert long_context.next_length(Bounds(51200, 524288), step, 51200) == 51200 + 12288, "it fitted: a quarter up"
    assert long_context.next_length(Bounds(0, 51200), step, 51200) == 51200 - 12288, "it failed: a quarter down"
    assert long_context.next_length(Bounds(51200, 63488), step, 51200) == 57344, "bracketed: bisection"
    assert long_context.next_length(Bounds(0, 524288), step, 0) == 262144, "no guess: bisection"
    options = long_context.cell_options("llama3-8b:nf4:12", long_context.stream_options([]))
    guess = long_context.planned_tokens("llama3-8b:nf4:12", options, step)
    without = long_context.planned_tokens("llama3-8b:nf4:12", {}, step)
    assert guess % step == 0 and guess > 21848 > without > 0, "the options lengthen what the planner predicts"


def test_the_shared_store_benchmark_runs_its_ranks_under_torchrun_on_the_cpu(tmp_path):
    """--dry-run: a tiny checkpoint, one process, then two ranks started by torchrun that
    share one host store (one builds, both map it), and the row the issue asks for."""
    import shared_store as bench

    assert bench.main(["--dry-run", "--work", str(tmp_path / "work"), "--out", str(tmp_path)]) == 0
    (row,) = json.loads((tmp_path / "shared-host-store.json").read_text())
    keys = {"ranks", "model", "quantization", "host_bytes_per_node", "host_bytes_one_copy", "h2d_gbps_per_rank"}
    assert keys | {"step_s", "single_process_step_s"} <= set(row)
    assert row["ranks"] == 2 and row["shared"] == [True, True] and row["builders"] == 1
    assert row["host_bytes_one_copy"] > 0 and row["step_s"] > 0
    # the node's used memory is measured, but a tiny model's share of it is below the noise
    # of the other processes on a shared CPU machine: it may even come out negative here
    assert isinstance(row["host_bytes_per_node"], int)
    assert not list((tmp_path / "work" / "shm").iterdir()), "the last rank to leave removed the segment"


def test_a_long_context_probe_step_that_runs_out_of_memory_shrinks_the_window_and_runs_again(monkeypatch):
    """As under the Trainer: out of memory with a resident window shrinks it and the step
    runs again; with no window left, the error reaches the probe (a length that does not fit)."""
    import long_context
    import torch

    import layerstream

    class ResidentWindow:
        def __init__(self, layers):
            self.layers, self.shrinks = layers, []

        def recover_from_oom(self, wanted):
            self.shrinks.append(wanted)
            self.layers = self.layers[:-1]
            return True

    class Runtime:
        def __init__(self, window):
            self.resident_window = ResidentWindow(window)

        @property
        def window(self):
            return self.resident_window.layers

    class Model:
        def __init__(self, failures):
            self.failures = failures

        def __call__(self, **kwargs):
            if self.failures:
                self.failures -= 1
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            return type("Out", (), {"loss": torch.ones((), requires_grad=True) * 1})()

    class Optimizer:
        def step(self):
            pass

        def zero_grad(self, set_to_none=True):
            pass

    runtime = Runtime([3, 7])
    monkeypatch.setattr(layerstream, "is_streamed", lambda model: True)
    monkeypatch.setattr(layerstream, "get_runtime", lambda model: runtime)
    model = Model(failures=1)
    assert long_context._step_or_shrink(model, Optimizer(), None) is False
    assert runtime.resident_window.shrinks == [2 << 30] and runtime.window == [3]
    assert long_context._step_or_shrink(model, Optimizer(), None) is True
    runtime.resident_window.layers = []
    with pytest.raises(torch.OutOfMemoryError):
        long_context._step_or_shrink(Model(failures=1), Optimizer(), None)


def test_step_insight_replays_the_allocators_events_to_the_peak():
    """The tensors alive at the allocated peak, by the first source line outside torch;
    blocks from before the trace count apart, and their frees lower them."""
    import step_insight

    model = [{"filename": "/x/torch/nn/functional.py", "line": 1, "name": "linear"}]
    model.append({"filename": "/x/transformers/models/llama/modeling_llama.py", "line": 7, "name": "forward"})
    ours = [{"filename": "/x/src/layerstream/tiled_mlp.py", "line": 9, "name": "backward"}]
    events = [
        {"action": "alloc", "addr": 1, "size": 100, "frames": model},
        {"action": "alloc", "addr": 2, "size": 50, "frames": ours},
        {"action": "free_requested", "addr": 1, "size": 100},
        {"action": "free_completed", "addr": 1, "size": 100},
        {"action": "free_completed", "addr": 99, "size": 30},  # allocated before the trace
        {"action": "alloc", "addr": 3, "size": 120, "frames": ours},
        {"action": "alloc", "addr": 4, "size": 20, "frames": model},  # the peak: 1160 > 1150 earlier
        {"action": "free_completed", "addr": 3, "size": 120},
    ]
    got = step_insight.live_at_peak(events, start_allocated=1000)
    assert got["peak_bytes"] == 1000 - 30 + 50 + 120 + 20
    assert got["before_trace_bytes"] == 970
    assert got["by_source"] == [
        {"source": "layerstream/tiled_mlp.py:9 (backward)", "bytes": 170, "blocks": 2},
        {"source": "llama/modeling_llama.py:7 (forward)", "bytes": 20, "blocks": 1},
    ]
    # each source's blocks, largest first, with their stacks; and the allocation that made the peak
    assert [b["bytes"] for b in got["largest_blocks"]["layerstream/tiled_mlp.py:9 (backward)"]] == [120, 50]
    assert got["largest_blocks"]["layerstream/tiled_mlp.py:9 (backward)"][0]["stack"] == [
        "layerstream/tiled_mlp.py:9 (backward)"
    ]
    assert got["peak_reached_by"] == ["nn/functional.py:1 (linear)", "llama/modeling_llama.py:7 (forward)"]


def test_long_context_insight_goes_to_timed_probes_only(tmp_path, monkeypatch):
    import long_context

    commands = []

    def fake_run(command, **kwargs):
        commands.append(command)
        return subprocess.CompletedProcess(command, 0, stdout='PROBE {"ok": true}\n', stderr="")

    monkeypatch.setattr(long_context.subprocess, "run", fake_run)
    args = long_context.argparse.Namespace(layers=None, insight=str(tmp_path), dry_run=False, probe_timeout_s=9)
    for steps in (2, 4):
        assert long_context.run_probe("llama3-8b:nf4:12", 2048, "streamed", {}, args, steps, True) == {"ok": True}
    search, timed = commands
    assert "--insight" not in search and timed[timed.index("--insight") + 1] == str(tmp_path)


def test_the_host_overhead_benchmark_runs_its_stages_on_the_cpu(tmp_path):
    """--dry-run: the micro-timings and a few training steps per stage, resident then
    streamed, written as one row per stage (the page-locking stages need CUDA)."""
    import host_overhead

    out = tmp_path / "host.json"
    assert host_overhead.main(["--dry-run", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["stage"] for r in rows] == [
        "fresh",
        "resident",
        "streamed, window",
        "interleaved, resident then streamed",
    ]
    for row in rows[:3]:
        assert row["launch_us"] > 0 and row["empty_us"] > 0 and row["python_ns_per_turn"] > 0
    assert all(len(r["step_s"]) == 5 and r["median_step_s"] > 0 for r in rows[1:3])
    alternated = rows[3]
    assert len(alternated["resident_step_s"]) == len(alternated["streamed_step_s"]) == 6
    assert alternated["streamed_speed_vs_resident"] > 0


def test_packed_pairs_give_trl_long_wrapped_sequences_of_the_repeated_data(monkeypatch, tmp_path):
    """--pair-tokens: the timed SFT pair packs sequences of that many tokens from the
    repeated data (a step bound by the GPU, not the host); without it, the short examples."""
    import zero_edit

    paths = {"llama3.2-3b": tmp_path / "m", "sft": tmp_path / "sft", "sft-packed": tmp_path / "packed"}
    plain = zero_edit.command(paths, "sft", "llama3.2-3b", "bf16", tmp_path / "o", 4, True)
    assert plain[plain.index("--max_length") + 1] == "256" and "--packing" not in plain
    monkeypatch.setattr(zero_edit, "PAIR_TOKENS", [2048])
    packed = zero_edit.command(paths, "sft", "llama3.2-3b", "bf16", tmp_path / "o", 4, True)
    assert packed[packed.index("--max_length") + 1] == "2048"
    assert packed[packed.index("--dataset_name") + 1] == str(tmp_path / "packed")
    assert packed[packed.index("--packing") :][:4] == ["--packing", "true", "--packing_strategy", "wrapped"]
    assert packed[:2] == ["layerstream", "run"], "the launcher form is unchanged"


def test_each_variant_puts_its_flags_right_after_the_launcher(tmp_path):
    import zero_edit

    paths = {"llama3-8b": tmp_path / "m", "sft": tmp_path / "sft"}
    for variant, (flags, _, _) in zero_edit.VARIANTS.items():
        line = zero_edit.command(paths, "sft", "llama3-8b", "4bit", tmp_path / "o", 4, True, variant)
        assert line[:2] == ["layerstream", "run"] and line[2 : 2 + len(flags)] == flags
        assert (
            line[2 + len(flags) :] == zero_edit.command(paths, "sft", "llama3-8b", "4bit", tmp_path / "o", 4, True)[2:]
        )
    accelerate = zero_edit.command(
        paths, "accelerate-sft", "llama3-8b", "4bit", tmp_path / "o", 4, True, "stream-embeddings"
    )
    at = accelerate.index("run") + 1
    assert accelerate[at - 3 : at + 1] == ["-m", "layerstream", "run", "--stream-embeddings"]


def test_a_variant_pair_runs_the_streamed_command_with_its_flags_and_compares_all_three(tmp_path):
    """``--variant``: each round also runs ``layerstream run`` with the variant's flags (the
    summary shows them taken), judged against the streamed run without them, with the losses
    of all three runs. (One variant runs here: a run costs half a minute; the other's command
    line is checked above.)"""
    import zero_edit

    variant = "stream-embeddings"
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    argv = [sys.executable, str(ROOT / "benchmarks" / "zero_edit.py"), "--dry-run", "--work", str(tmp_path)]
    argv += ["--out", str(tmp_path / "out"), "--part", "pairs", "--variant", variant, "--pair-rounds", "1"]
    argv += ["--pair-steps", "4", "--full-determinism", "--only", "sft-llama3.2-3b-bf16-24GiB"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    result = json.loads((tmp_path / "out" / f"zero-edit-pairs-deterministic-{variant}.json").read_text())
    names = [r["name"] for r in result["rows"]]
    assert [n.split("24GiB-")[-1] for n in names] == ["plain", "streamed", f"streamed-{variant}"]
    assert all(r["returncode"] == 0 and len(r["losses"]) == 4 for r in result["rows"])
    log = (tmp_path / "runs" / f"{names[-1]}.log").read_text()
    assert "the streamed head is fetched to the device for it" in log, "the variant's flags reached the launcher"
    plain, verdict = result["pairs"]
    assert plain["against"] == "the streamed run against the plain script"
    assert verdict["case"].endswith(variant) and verdict["against"] == zero_edit.VARIANTS[variant][2]
    assert verdict["losses_equal_to_plain"] and verdict["speed_vs_plain"] > 0
