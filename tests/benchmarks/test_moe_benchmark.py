"""benchmarks/moe.py on the CPU: the dry run's three routes on tiny mixture-of-experts
models (TRL's SFTTrainer in the process on the model built in memory, with decoding; TRL's
sft.py behind `layerstream run` against the plain script; and a stack cut to what the host
RAM holds), the size arithmetic of the real cases, and the by-need copy bound."""

import json
import math
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import moe  # noqa: E402
import moe_measure  # noqa: E402

ROW_KEYS = {"case", "model", "quantization", "cap", "route", "kind", "layers", "command", "machine", "sizes"}
TRAIN_KEYS = {"tokens", "step_s", "resident_step_s", "speed_vs_resident", "copy_bound_s", "bytes_per_step"}
DECODE_KEYS = {"batch", "decode_ms", "resident_decode_ms", "copy_bound_ms", "by_need_copy_bound_ms"}
COUNTED_KEYS = {"peak_allocated_gib", "experts_copied", "expert_visits", "experts_copied_per_visit"}


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """The whole dry run once, one intra-op thread (a busy two-core runner), its rows by case."""
    work = tmp_path_factory.mktemp("moe")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert moe.main(["--dry-run", "--work", str(work), "--out", str(work / "out" / "moe.json")]) == 0
    finally:
        torch.set_num_threads(threads)
    rows = json.loads((work / "out" / "moe.json").read_text())["rows"]
    return work, {(r["case"], r["kind"], r["batch"]): r for r in rows}


def test_every_case_has_its_rows_with_the_figures_a_result_needs(dry_run):
    _, rows = dry_run
    assert sorted(rows) == [
        ("tiny-gpt-oss-120b", "train", 1),
        ("tiny-gpt-oss-20b", "train", 1),
        ("tiny-qwen3-moe", "decode", 1),
        ("tiny-qwen3-moe", "decode", 8),
        ("tiny-qwen3-moe", "train", 1),
    ]
    for key, row in rows.items():
        kind_keys = TRAIN_KEYS if row["kind"] == "train" else DECODE_KEYS
        assert ROW_KEYS | kind_keys | COUNTED_KEYS <= set(row), (key, sorted((ROW_KEYS | kind_keys) - set(row)))
        assert row["quantization"] == "nf4" and row["command"].startswith("python benchmarks/moe.py --dry-run")
        assert {"torch", "transformers", "peft", "trl", "bitsandbytes"} <= set(row["machine"])
        assert "error" not in row, row.get("error")
        assert row["peak_allocated_gib"] is None, "no GPU: no peak, and none made up"
        for name in ("experts_copied", "expert_visits"):
            assert row[name] is None or (isinstance(row[name], int) and row[name] >= 0)
        if row["kind"] == "train":
            assert row["trained"] is True and all(math.isfinite(x) for x in row["losses"])
            assert row["step_s"] > 0 and row["resident_step_s"] > 0 and row["copy_bound_s"] > 0
            assert row["speed_vs_resident"] > 0 and row["fraction_of_copy_bound"] > 0
            assert row["tokens"] == 64 and row["target_vs_resident"] == moe.TARGET_VS_RESIDENT
            assert row["loss"] == moe.TRL_LOSS == "trl-fused-head"
        else:
            assert row["decode_ms"] > 0 and row["resident_decode_ms"] > 0
            assert len(row["decode_ms_all"]) == moe.TINY_CASES[row["case"]].new_tokens - 1


def test_each_tiny_case_takes_the_route_its_real_case_takes(dry_run):
    """Qwen3-30B-A3B's checkpoint is too large for the disk: the API; gpt-oss-20b: TRL's
    script; gpt-oss-120b: its MXFP4 checkpoint is too large for the disk, its packed store fits
    the host RAM: the API, every layer."""
    _, rows = dry_run
    assert rows[("tiny-qwen3-moe", "train", 1)]["route"] == "api"
    assert rows[("tiny-gpt-oss-20b", "train", 1)]["route"] == "trl-sft"
    deep = rows[("tiny-gpt-oss-120b", "train", 1)]
    assert deep["route"] == "api" and deep["layers"] == deep["layers_of_model"] == 6
    assert deep["sizes"]["store_fits_host_ram"] is True and deep["sizes"]["checkpoint_fits_disk"] is False
    assert deep["routed_expert_share"] > 0


@pytest.mark.parametrize("case", ["tiny-qwen3-moe", "tiny-gpt-oss-120b"])
def test_the_api_route_trains_through_sfttrainer_streamed_and_resident_alike(dry_run, case):
    """Both runs are SFTTrainer's, from the same adapters on the same rows: the same first
    step's loss; each step timed, the warm-up ones left out."""
    work, rows = dry_run
    row = rows[(case, "train", 1)]
    tiny = moe.TINY_CASES[case]
    assert row["route"] == "api" and row["trained"] is True
    assert len(row["losses"]) == len(row["resident_losses"]) == tiny.warmup + tiny.steps
    assert row["losses"][0] == row["resident_losses"][0], "the same loss on the same first batch"
    assert len(row["step_s_all"]) == len(row["resident_step_s_all"]) == tiny.steps
    assert (work / f"{case}-api-streamed").is_dir() and (work / f"{case}-api-resident").is_dir()


def test_trls_script_runs_unchanged_streamed_and_plain_on_the_mxfp4_checkpoint(dry_run):
    """gpt-oss is written in MXFP4, as published: the streamed script trains QLoRA on it
    (``--load_in_4bit``: NF4 attention, experts kept packed); transformers refuses a
    BitsAndBytesConfig for an MXFP4 checkpoint, so the plain script runs without it
    (transformers dequantises, bf16), said in the row. Both train."""
    work, rows = dry_run
    row = rows[("tiny-gpt-oss-20b", "train", 1)]
    streamed, plain = row["script_command"].split(), row["resident_command"].split()
    assert streamed[:5] == ["layerstream", "run", "-m", "trl.scripts.sft", "--model_name_or_path"]
    assert plain[:3] == ["python", "-m", "trl.scripts.sft"] and "--load_in_4bit" in streamed
    assert "--load_in_4bit" not in plain and row["resident_quantization"].startswith("bf16")
    assert [a for a in streamed[2:] if "-streamed" not in a and a != "--load_in_4bit"] == [
        a for a in plain[1:] if "-plain" not in a
    ]
    assert row["returncode"] == 0 and row["resident_trained"] is True
    assert json.loads((work / "tiny-gpt-oss" / "config.json").read_text())["quantization_config"]["quant_method"] == (
        "mxfp4"
    )
    assert len(row["step_s_all"]) == moe.TINY_CASES["tiny-gpt-oss-20b"].steps
    assert row["window_layers"] == 0, "no GPU: every layer streams"
    assert (work / "out" / "moe" / "moe-tiny-gpt-oss-20b-streamed.log").stat().st_size > 0


def test_decoding_counts_the_experts_routed_and_bounds_below_the_whole_layers(dry_run):
    """One token chooses top-k distinct experts per layer; eight choose more; the by-need
    bound copies fewer bytes than whole layers, and the fewer the experts chosen, the fewer."""
    _, rows = dry_run
    one, eight = rows[("tiny-qwen3-moe", "decode", 1)], rows[("tiny-qwen3-moe", "decode", 8)]
    top_k = moe.TINY_SHAPES["tiny-qwen3-moe"]["num_experts_per_tok"]
    assert one["routed_experts_per_layer"] == top_k and one["experts_per_layer"] == 8
    assert top_k < eight["routed_experts_per_layer"] <= 8
    assert one["by_need_copy_bound_ms"] < eight["by_need_copy_bound_ms"] <= eight["copy_bound_ms"]
    assert one["copy_bound_ms"] == eight["copy_bound_ms"], "whole layers: the same bytes at any batch"
    assert one["bytes_per_token_step"] > 0


class _Routing:
    def __init__(self, chosen):
        self.experts = {0: (8, 100), 1: (8, 100)}  # 8 experts of 100 bytes in each layer
        self.chosen = chosen

    def distinct(self, skip_first=False):
        return self.chosen


def test_the_by_need_bound_copies_the_chosen_experts_and_holds_the_smallest_layers():
    layers = {0: 1000, 1: 1000, 2: 500}  # layer 2 has no experts
    chosen = {0: [2, 4], 1: [8, 8]}  # layer 0 chose 3 on average, layer 1 all 8
    bytes_copied = moe_measure.by_need_bound_s(_Routing(chosen), layers, 0, 1.0) * 1e9
    assert bytes_copied == pytest.approx((1000 - 500) + 1000 + 500)
    held_one = moe_measure.by_need_bound_s(_Routing(chosen), layers, 1, 1.0) * 1e9
    assert held_one == pytest.approx(1000 + 500), "the smallest layer (layer 2, 500 bytes) is held"


def test_counters_layerstream_does_not_keep_are_null_not_zero():
    assert moe_measure.counter_delta({"experts_copied": 3}, {"experts_copied": 10}, "experts_copied") == 7
    assert moe_measure.counter_delta({}, {"experts_copied": 10}, "experts_copied") is None
    assert moe_measure.per_visit(None, 4) is None and moe_measure.per_visit(6, 4) == 1.5


def test_the_real_cases_sizes_decide_their_routes():
    """bf16 Qwen3-30B-A3B (61 GB) does not fit the disk's share: the API; gpt-oss is written as
    published, its experts in MXFP4: gpt-oss-20b (13.8 GB) is written and its store (9.8 GiB)
    fits the RAM; gpt-oss-120b (65.3 GB) does not fit the disk's share, but its store (57.3
    GiB) fits the RAM: all 36 layers, built in memory."""
    sizes = {name: moe.case_sizes(case, moe.SHAPES[case.shape]) for name, case in moe.CASES.items()}
    qwen, small, large = sizes["qwen3-30b-a3b"], sizes["gpt-oss-20b"], sizes["gpt-oss-120b"]
    assert qwen["route"] == "api" and not qwen["checkpoint_fits_disk"] and qwen["store_fits_host_ram"]
    assert 60 < qwen["checkpoint_gb"] < 62 and qwen["layers_measured"] == 48
    assert small["route"] == "trl-sft" and small["checkpoint_fits_disk"] and small["resident_fits_gpu_full"]
    assert 13.7 < small["checkpoint_gb"] < 13.9 and small["store_nf4_gib"] < 10
    assert large["route"] == "api" and not large["checkpoint_fits_disk"] and large["store_fits_host_ram"]
    assert 65.1 < large["checkpoint_gb"] < 65.4 and large["layers_measured"] == 36
    assert large["resident_fits_gpu_measured"]


def test_the_real_shapes_plan_a_qlora_run_that_fits_with_trls_head(capsys):
    from layerstream.commands import cli

    # every case trains through SFTTrainer (TRL's sft.py or in the process), whose fused
    # log-prob head computes the loss
    for name, budget in (("gpt-oss-20b", "8GiB"), ("gpt-oss-120b", "24GiB"), ("qwen3-30b-a3b", "8GiB")):
        argv = ["plan", "--model", str(ROOT / "configs" / "shapes" / f"{name}.json"), "--seq", "2048"]
        argv += ["--quantization", "nf4", "--vram-budget", budget, "--lora-targets", ",".join(moe.LORA_TARGETS)]
        argv += ["--trl-fused-head"]
        assert cli.main(argv) == 0, capsys.readouterr().out
        assert moe.SHAPES[name]["model_type"] in capsys.readouterr().out


def test_rows_of_other_cases_are_kept_and_the_same_case_is_replaced(tmp_path):
    base = [{"case": "a", "kind": "train", "batch": 1, "step_s": 1.0}, {"case": "b", "kind": "decode", "batch": 8}]
    moe.save(tmp_path / "moe.json", base, [{"case": "a", "kind": "train", "batch": 1, "step_s": 2.0}])
    rows = json.loads((tmp_path / "moe.json").read_text())["rows"]
    assert rows == [{"case": "a", "kind": "train", "batch": 1, "step_s": 2.0}, base[1]]


def test_a_profiled_run_profiles_both_scripts_and_its_row_says_so(tmp_path, monkeypatch):
    """``--profile DIR``: both runs of the TRL route go to capped.py's profiled steps and
    write their profiles, one folder per run; the row says profiled (its times include the
    profilers) and carries the commit given as COMMIT (the GPU machine's .git can be older)."""
    monkeypatch.setenv("COMMIT", "abc1234")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    work, profiles = tmp_path / "work", tmp_path / "profiles"
    argv = ["--dry-run", "--case", "tiny-gpt-oss-20b", "--work", str(work), "--out", str(tmp_path / "moe.json")]
    assert moe.main([*argv, "--profile", str(profiles)]) == 0
    (row,) = json.loads((tmp_path / "moe.json").read_text())["rows"]
    assert row["profiled"] is True and row["commit"] == "abc1234"
    assert len(row["losses"]) == moe.PROFILED_STEPS and row["trained"] is True
    for run in ("streamed", "plain"):
        folder = profiles / f"tiny-gpt-oss-20b-{run}"
        assert (folder / "python-profile.txt").stat().st_size > 0
        assert (folder / "torch-profile.txt").stat().st_size > 0
