"""The long-context harness on the CPU: its search, its baselines, its probes' environment and
out-of-memory handling, and what the allocator's events say about the peak."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))


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
    monkeypatch.setattr(long_context, "gpu_total_memory", lambda: 81559 * 2**20)  # an H100 80GB
    argv = ["--cells", "llama3-8b:nf4:12", "--state", str(tmp_path / "s.json"), "--out", str(tmp_path / "r.json")]
    assert long_context.main(argv + ["--hi", "2048", "--granularity", "1024", "--no-from-plan"]) == 0
    assert seen, "no probe ran"
    return seen


def test_a_cell_capped_above_the_gpu_is_refused_before_any_probe(monkeypatch, tmp_path):
    import long_context

    monkeypatch.setattr(long_context, "gpu_total_memory", lambda: 81559 * 2**20)  # an H100 80GB
    monkeypatch.setattr(long_context.subprocess, "run", lambda *a, **k: pytest.fail("a probe ran"))
    argv = ["--cells", "llama3-8b:nf4:80", "--state", str(tmp_path / "s.json"), "--out", str(tmp_path / "r.json")]
    with pytest.raises(SystemExit, match="80.0 GiB is more than this GPU's 79.6 GiB"):
        long_context.main(argv)
    assert not (tmp_path / "s.json").exists(), "no search bound kept"


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
