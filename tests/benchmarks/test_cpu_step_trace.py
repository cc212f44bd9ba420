"""The CPU step trace's replay of allocation events (made-up ones here), and its committed
results: the measured layer working set within 5% of the planner's figure recorded beside it."""

import json
import sys
from pathlib import Path

import pytest
import torch

from layerstream.plan import working_set

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
RESULTS = ROOT / "benchmarks" / "results" / "cpu" / "step-trace"
T = 2048


def frame(path, line, name="forward"):
    return {"filename": path, "line": line, "name": name}


TORCH = frame("/x/torch/nn/functional.py", 1, "linear")
LINEAR = frame("/x/torch/nn/modules/linear.py", 130)  # torch's own: the allocation is charged to PEFT's
PEFT = frame("/x/peft/tuners/lora/bnb.py", 513)
LLAMA = frame("/x/transformers/models/llama/modeling_llama.py", 62)
CHECKPOINT = frame("/x/torch/utils/checkpoint.py", 9, "recompute_fn")
TILED = frame("/x/layerstream/long/tiled_mlp.py", 111, "backward")
LOSS = frame("/x/layerstream/long/chunked_loss.py", 133, "span_gradients")
OFFLOAD = frame("/x/layerstream/long/offload.py", 264, "_fetch")
DEQUANT = frame("/x/bitsandbytes/backends/cpu/ops.py", 139, "_")


def backward(*names):
    """The ops above an allocation in backward, innermost first."""
    return [f"autograd::engine::evaluate_function: {n}" for n in names]


def test_phases_and_kinds_from_frames_ops_and_shapes():
    """Each allocation is charged to the part of the step that made it, and to what it is
    to the planner (activation, dequantised weight, boundary, rotary, adapter-sized)."""
    from cpu_step_trace import kind_of, make_event

    def phase(frames, ops=()):
        return make_event("alloc", 1, 8, frames, ops)["phase"]

    assert phase([TORCH, LLAMA, LOSS]) == "loss", "the model's forward outside the layers runs under the loss"
    assert phase([LLAMA]) == "forward"
    assert phase([LLAMA, CHECKPOINT], backward("CheckpointFunctionBackward")) == "recompute"
    nested = backward("NativeDropoutBackward0", "TiledFunctionBackward")
    assert phase([TILED], nested) == "mlp-bw", "the tile's own backward nests inside the tiled MLP's"
    assert phase([LLAMA], backward("ScaledDotProductAttentionBackward0")) == "attn-bw"
    assert phase([LLAMA], backward("RsqrtBackward0")) == "norm-bw"
    assert phase([LLAMA], backward("MulBackward0")) == "bw:MulBackward0"

    def kind(frames, shape, ops=()):
        return kind_of(make_event("alloc", 1, 8, frames, ops, "float32", shape), T)

    assert kind([LOSS], (512, 32)) == "adapter-sized", "a LoRA matrix's gradient: rank by hidden"
    assert kind([LINEAR], (T, 32)) == "activation", "lora_A's output grows with the tokens"
    assert kind([DEQUANT], (1792, 512)) == "dequantised weight"
    assert kind([OFFLOAD], (1, T, 512)) == "boundary"
    assert kind([LLAMA, LOSS], (T, 512), ["aten::index_select", "aten::embedding"]) == "boundary"
    assert kind([LLAMA, LOSS], (T, 512), ["aten::mul"]) == "activation"
    assert kind([LLAMA, LOSS], (1, T, 64)) == "rotary cos/sin"
    assert kind([LLAMA, CHECKPOINT], (1, T, 64), backward("X")) == "activation", "in a layer: not the rotary"


def test_the_replay_finds_the_peaks_and_groups_what_is_alive():
    """The step's peak, each phase's peak, the bytes by kind and the rows grouped by kind,
    dtype, shape, phase and source line; step_insight's by-source table from the same events."""
    from cpu_step_trace import make_event, summarise

    mb = 1 << 20
    recompute = ([LINEAR, PEFT, CHECKPOINT], backward("CheckpointFunctionBackward"))
    tile = ([TILED], backward("TiledFunctionBackward"))
    events = [
        make_event("alloc", 1, 4 * mb, *recompute, "bfloat16", (1, T, 512)),
        make_event("alloc", 2, 4 * mb, *recompute, "bfloat16", (1, T, 512)),
        make_event("alloc", 3, 2 * mb, [DEQUANT], backward("TiledFunctionBackward"), "bfloat16", (1792, 512)),
        make_event("alloc", 4, 8 * mb, [OFFLOAD], backward("TiledFunctionBackward"), "float32", (1, T, 512)),
        make_event("alloc", 5, 1 * mb, *tile, "float32", (1, 512, 512)),  # the step's peak: 19 MiB
        make_event("free_completed", 5, 1 * mb, *tile),
        make_event("free_completed", 4, 8 * mb, *tile),
        make_event("alloc", 6, 3 * mb, [LLAMA], backward("RsqrtBackward0"), "float32", (1, T, 384)),
        make_event("free_completed", 99, 5 * mb, [LLAMA]),  # not allocated in the trace: ignored
    ]
    got = summarise(events, T)
    assert got["peak_bytes"] == 19 * mb and got["peak_phase"] == "mlp-bw"
    assert got["phase_peaks"] == {"recompute": 8 * mb, "mlp-bw": 19 * mb, "norm-bw": 13 * mb}
    kinds = got["at_peak"]["kinds"]
    assert kinds["activation"] == 9 * mb and kinds["dequantised weight"] == 2 * mb and kinds["boundary"] == 8 * mb
    assert got["activation_bytes"] == 9 * mb
    assert got["layer_working_bytes"] == 11 * mb, "activations and dequantised weights, no boundary"
    first = got["at_peak"]["rows"][0]
    assert first == {
        "kind": "activation",
        "dtype": "bfloat16",
        "shape": "(1,T,512)",
        "allocated_in": "recompute",
        "source": "lora/bnb.py:513 (forward)",
        "bytes": 8 * mb,
        "tensors": 2,
    }
    assert got["by_source"][0] == {"source": "lora/bnb.py:513 (forward)", "bytes": 8 * mb, "blocks": 2}
    assert sum(r["bytes"] for r in got["by_source"]) == got["peak_bytes"]


def test_two_lengths_split_each_figure_into_bytes_per_token_and_a_constant():
    from cpu_step_trace import KINDS, slopes

    def summary(tokens):
        row = dict(kind="activation", dtype="bool", shape="(1,T,512)", allocated_in="recompute", source="x.py:1 (f)")
        kinds = dict.fromkeys(KINDS, 0) | {"activation": 512 * tokens + 1000, "dequantised weight": 700}
        return {
            "tokens": tokens,
            "phase_peaks": {"mlp-bw": 900 * tokens + 5000, "loss": 10},
            "at_peak": {"kinds": kinds, "rows": [dict(row, bytes=512 * tokens, tensors=1)]},
            "layer_working_bytes": 512 * tokens + 1700,
            "planned_bytes": 500 * tokens + 2000,
        }

    got = slopes(summary(2048), summary(4096))
    assert got["phase_peaks"]["mlp-bw"] == {"per_token": 900, "constant": 5000}
    assert got["phase_peaks"]["loss"] == {"per_token": 0, "constant": 10}
    assert got["kinds_at_peak"]["activation"] == {"per_token": 512, "constant": 1000}
    assert got["layer_working_bytes"] == {"per_token": 512, "constant": 1700}
    assert got["planned_bytes"] == {"per_token": 500, "constant": 2000}
    assert got["rows_at_peak"][0]["per_token"] == 512 and got["rows_at_peak"][0]["dtype"] == "bool"


@pytest.mark.parametrize("setup", ["prepared", "reference"])
def test_the_committed_trace_is_within_5_percent_of_the_planner(setup, tmp_path):
    """The measured layer working set (activations and dequantised weights alive at the
    step's peak) of the committed run at each length, against layer_working_bytes then."""
    result = json.loads((RESULTS / f"{setup}.json").read_text())
    assert result["setup"] == setup and len(result["lengths"]) >= 2
    from cpu_step_trace import planned as planned_now

    config = dict(result["model"])
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    for length in result["lengths"]:
        measured, planned = length["layer_working_bytes"], length["planned_bytes"]
        assert measured == pytest.approx(planned, rel=0.05), (setup, length["tokens"], measured, planned)
        assert length["peak_bytes"] >= measured
        # and against the planner as it is now, not only as the run recorded it
        now = planned_now(str(tmp_path), setup, length["tokens"], result["tile"])
        assert measured == pytest.approx(now, rel=0.05), (setup, length["tokens"], measured, now)


def test_tiling_float32_norms_changes_the_norms_phase_as_the_planner_says(tmp_path, monkeypatch):
    """The prepared setup (a float32 residual stream) traced with its norms untiled
    (prepared-untiled-float32-norms.json) and tiled (prepared-float32-norms-tiled.json), its
    adapters keeping their inputs in both: at each length the second
    norm's phase moved by what the planner's norm phase moves, one float32 width a token
    fewer and the tile's temporaries more."""
    from cpu_step_trace import LORA, planner_arguments
    from transformers import AutoConfig

    from layerstream.plan.lora import lora_adapters
    from layerstream.plan.shapes import layer_shapes

    monkeypatch.setattr(working_set, "adapter_inputs_recomputed", lambda mlp_tiled: False)  # as both ran
    untiled = json.loads((RESULTS / "prepared-untiled-float32-norms.json").read_text())
    tiled = json.loads((RESULTS / "prepared-float32-norms-tiled.json").read_text())
    assert untiled["model"] == tiled["model"] and untiled["tile"] == tiled["tile"]
    (tmp_path / "config.json").write_text(json.dumps(tiled["model"]))
    config = AutoConfig.from_pretrained(tmp_path)
    shapes = layer_shapes(config, torch.bfloat16)
    adapted, _ = lora_adapters(config, shapes, LORA["target_modules"], LORA["r"], torch.bfloat16)

    def norm_phase(tokens):
        arguments = planner_arguments("prepared", tiled["tile"])
        return working_set.layer_phase_bytes(config, shapes[0], adapted[0], tokens, **arguments)["norm"]

    for before, after in zip(untiled["lengths"], tiled["lengths"]):
        tokens = after["tokens"]
        assert before["tokens"] == tokens
        measured = after["phase_peaks"]["norm-bw"] - before["phase_peaks"]["norm-bw"]
        planned_tiled = norm_phase(tokens)
        with monkeypatch.context() as patch:
            patch.setattr(working_set, "norms_are_tiled", lambda mlp_tiled: False)
            planned = planned_tiled - norm_phase(tokens)
        assert measured == pytest.approx(planned, abs=0.02 * before["phase_peaks"]["norm-bw"]), (
            tokens,
            measured,
            planned,
        )


def test_drawing_the_attention_adapters_dropout_again_frees_what_the_planner_says(tmp_path, monkeypatch):
    """The prepared setup traced with its attention adapters keeping their dropped inputs
    (prepared-float32-norms-tiled.json) and drawing their dropout again (prepared.json): at
    each length the layer working set at the step's peak moved by what the plan's moves."""
    from cpu_step_trace import planned

    kept = json.loads((RESULTS / "prepared-float32-norms-tiled.json").read_text())
    drawn = json.loads((RESULTS / "prepared.json").read_text())
    assert kept["model"] == drawn["model"] and kept["tile"] == drawn["tile"]
    (tmp_path / "config.json").write_text(json.dumps(drawn["model"]))
    for before, after in zip(kept["lengths"], drawn["lengths"]):
        tokens = after["tokens"]
        measured = after["layer_working_bytes"] - before["layer_working_bytes"]
        now = planned(str(tmp_path), "prepared", tokens, drawn["tile"])
        with monkeypatch.context() as patch:
            patch.setattr(working_set, "adapter_inputs_recomputed", lambda mlp_tiled: False)
            freed = now - planned(str(tmp_path), "prepared", tokens, drawn["tile"])
        assert freed < 0 and measured < 0
        assert measured == pytest.approx(freed, rel=0.25), (tokens, measured, freed)
