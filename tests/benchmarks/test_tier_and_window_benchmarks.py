"""The disk-tier, offload-cost, window, shared-store and host-overhead benchmarks on the CPU:
each runs its harness whole and refuses what would measure the wrong thing."""

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))


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
